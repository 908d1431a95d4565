"""Shared set-up for the real-browser tests: a JupyterLab server isolated in a temporary folder, with a kernel on this
venv's python, and headless Chromium (Debian's /usr/bin/chromium) driven by Playwright."""
import atexit, json, os, secrets, subprocess, sys, time, urllib.request
from contextlib import contextmanager
from typing import NamedTuple

import pytest

from conftest import free_port

CHROMIUM = '/usr/bin/chromium'
KERNEL = 'trainer-nb-test'
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None


def needs_browser(test):
    """Skip `test` when Playwright or Chromium is missing; mark it `browser` (the shared Chromium stays open from one
    such test to the next, see `shared_browser`)."""
    test = pytest.mark.browser(test)
    test = pytest.mark.skipif(sync_playwright is None,
                              reason="playwright (Python package) is not installed: pip install playwright")(test)
    return pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium")(test)


def write_notebook(path, cells):
    "A notebook of code `cells` (strings), with the test kernel as its kernelspec."
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata['kernelspec'] = {'name': KERNEL, 'display_name': 'trainer_nb test', 'language': 'python'}
    nbformat.write(nb, str(path))


def jupyter_env(tmp):
    "Environment for a Jupyter server/client isolated in `tmp`, with a kernelspec for this venv's python."
    prefix = tmp / 'kprefix'
    subprocess.run([sys.executable, '-m', 'ipykernel', 'install', '--prefix', str(prefix), '--name', KERNEL,
                    '--display-name', 'trainer_nb test'], check=True, capture_output=True)
    spec = json.loads((prefix / 'share/jupyter/kernels' / KERNEL / 'kernel.json').read_text())
    assert spec['argv'][0] == sys.executable
    cfg = tmp / 'config'
    (cfg / 'labconfig').mkdir(parents=True)
    # no news pop-up in the screenshot (and no attempt to fetch news)
    (cfg / 'labconfig/page_config.json').write_text(json.dumps(
        {'disabledExtensions': {'@jupyterlab/apputils-extension:announcements': True}}))
    return dict(os.environ, JUPYTER_PATH=str(prefix / 'share/jupyter'), JUPYTER_CONFIG_DIR=str(cfg),
                JUPYTER_RUNTIME_DIR=str(tmp / 'runtime'), JUPYTER_DATA_DIR=str(tmp / 'data'),
                IPYTHONDIR=str(tmp / 'ipython'), MPLBACKEND='Agg', PYTHONUNBUFFERED='1')


def wait_for_server(proc, url, log, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None: pytest.fail(f"JupyterLab exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200: return
        except OSError: pass
        time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer in {timeout}s:\n{log.read_text()[-3000:]}")


class Server(NamedTuple):
    "A running JupyterLab: its address and token, and the folder (under its root) that a test's notebooks are in."
    base: str
    token: str
    prefix: str = ''

    def api(self, path: str, method: str = 'GET'):
        "The server's REST API: the JSON answer to `method` on `path` (e.g. 'api/sessions'), or None if it has none."
        req = urllib.request.Request(f'{self.base}/{path}?token={self.token}', method=method)
        with urllib.request.urlopen(req, timeout=30) as r: body = r.read()
        return json.loads(body) if body else None


def _start_lab(home, root):
    "A JupyterLab serving `root`, its settings and kernelspec in `home`: `(process, Server)` once it answers."
    env = jupyter_env(home)
    port, token = free_port(), secrets.token_hex(16)
    log = home / 'jupyterlab.log'
    with open(log, 'w') as lf:
        proc = subprocess.Popen(
            [sys.executable, '-m', 'jupyterlab', '--no-browser', '--ServerApp.ip=127.0.0.1', f'--ServerApp.port={port}',
             '--ServerApp.port_retries=0', '--ServerApp.allow_root=True', '--ServerApp.terminals_enabled=False',
             f'--IdentityProvider.token={token}', f'--ServerApp.root_dir={root}',
             '--LabApp.expose_app_in_browser=True', '--JupyterNotebookApp.expose_app_in_browser=True',
             '--KernelSpecManager.ensure_native_kernel=False',
             f'--LabApp.workspaces_dir={home / "workspaces"}', '--LabApp.news_url=None'],
            env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=root)
    server = Server(f'http://127.0.0.1:{port}', token)
    try: wait_for_server(proc, f'{server.base}/api/status?token={token}', log)
    except BaseException: _stop(proc); raise
    return proc, server


def _stop(proc):
    proc.terminate()
    try: proc.wait(timeout=15)
    except subprocess.TimeoutExpired: proc.kill(); proc.wait()


_SHARED = {}   # the test process's own JupyterLab, by its root: (process, Server)


def _shared_lab(base_temp):
    "The JupyterLab this test process shares among its tests (started at its first use, stopped at the process's end)."
    if base_temp not in _SHARED or _SHARED[base_temp][0].poll() is not None:
        home = base_temp / 'shared-jupyterlab'
        home.mkdir(exist_ok=True)
        _SHARED[base_temp] = _start_lab(home, base_temp)
        atexit.register(_stop, _SHARED[base_temp][0])
    return _SHARED[base_temp][1]


def _end_sessions(server):
    "Shut down the kernels of the notebooks under `server.prefix` (a shared server outlives the test)."
    for s in server.api('api/sessions'):
        if s['path'].startswith(server.prefix): server.api(f"api/sessions/{s['id']}", 'DELETE')


@contextmanager
def lab_server(tmp_path, shared=True):
    """A JupyterLab serving `tmp_path / 'root'` (write notebooks there); yields a `Server`.
    `shared`: the test process's one JupyterLab, whose root holds every test's `tmp_path` (pytest's base temporary
    folder): a server starts in about 5 s of CPU, once a process instead of once a test; the test's notebooks are under
    `server.prefix`, each page opens in a workspace of its own, and the test's kernels are shut down when it leaves.
    `shared=False`: a server of its own, for a test that changes the server's kernelspecs; its log is
    `tmp_path / 'jupyterlab.log'` and it is stopped on exit."""
    root = tmp_path / 'root'
    root.mkdir(exist_ok=True)
    if shared:
        server = _shared_lab(tmp_path.parent)
        server = server._replace(prefix=f'{tmp_path.name}/root/')
        try: yield server
        finally: _end_sessions(server)
        return
    proc, server = _start_lab(tmp_path, root)
    try: yield server
    finally: _stop(proc)


_KERNEL_IDLE = ("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
                " return !!k && k.status === 'idle'; }")


# what the tests' Chromium is started with (headless; no GPU, sandbox, QUIC, first-run page, extensions or traffic of
# its own)
ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
        '--disable-background-networking', '--disable-component-update', '--disable-sync',
        '--disable-default-apps', '--disable-extensions']
_BROWSER = {}   # the test process's Playwright driver ('pw') and its one Chromium ('browser')


def close_browser():
    "Close the shared Chromium and stop its Playwright driver, if they run."
    pw, browser = _BROWSER.pop('pw', None), _BROWSER.pop('browser', None)
    try:
        if browser is not None and browser.is_connected(): browser.close()
    finally:
        if pw is not None: pw.stop()


atexit.register(close_browser)


def shared_browser():
    """Headless Chromium shared by the tests marked `browser` (`needs_browser`) that run one after another in a test
    process: a Playwright driver and a Chromium start in about 2 s of CPU, once for such a run of tests instead of
    once a page. Open pages with `browser.new_page(...)`: each is in a context of its own (its own cookies, storage
    and cache, as a fresh browser's), closed with the page. The next test not marked `browser` closes it
    (`tests/conftest.py`): Playwright's synchronous API keeps an asyncio loop marked running while it is started,
    where `asyncio.run` (nbclient's, say) would refuse to start."""
    if 'pw' not in _BROWSER: _BROWSER['pw'] = sync_playwright().start()
    if _BROWSER.get('browser') is None or not _BROWSER['browser'].is_connected():
        _BROWSER['browser'] = _BROWSER['pw'].chromium.launch(executable_path=CHROMIUM, args=ARGS)
    return _BROWSER['browser']


@contextmanager
def notebook_page(server, notebook, viewport=(1280, 1100), app='lab'):
    """Headless Chromium showing `notebook` (a name in the test's root folder) in JupyterLab (`app='lab'`) or Notebook 7
    (`'notebook7'`), with its kernel started and idle; yields the page (closed on exit)."""
    page = shared_browser().new_page(viewport={'width': viewport[0], 'height': viewport[1]})
    try:
        # a workspace of its own in JupyterLab: a shared server's last one would open the last test's notebooks
        route = {'lab': f'lab/workspaces/t{secrets.token_hex(4)}/tree', 'notebook7': 'notebooks'}[app]
        page.goto(f'{server.base}/{route}/{server.prefix}{notebook}?token={server.token}')
        page.wait_for_function(_KERNEL_IDLE, timeout=60_000)
        yield page
    finally:
        page.close()


def run_all_cells(page):
    "Start running every cell of the notebook shown in `page` (returns at once)."
    # don't wait for the command's promise: it resolves only when every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def run_cell(page, index):
    "Start running the cell at `index` of the notebook shown in `page` (returns at once)."
    page.evaluate("""(i) => { const nb = window.jupyterapp.shell.currentWidget.content;
                              nb.activeCellIndex = i; window.jupyterapp.commands.execute('notebook:run-cell'); }""", index)


def output_texts(page) -> list:
    "The text of each code cell's output area, in order."
    return page.evaluate("""() => [...document.querySelectorAll('.jp-CodeCell')].map(c => {
        const o = c.querySelector('.jp-OutputArea'); return o ? o.innerText : ''; })""")


def wait_for_text(page, text, timeout=60, cell=None):
    """Wait until `text` shows in the outputs (of code cell `cell`, if given); fails on a Python error shown there.
    Returns the output texts."""
    end = time.time() + timeout
    while True:
        outs = output_texts(page)
        shown = '\n'.join(outs) if cell is None else (outs[cell] if cell < len(outs) else '')
        if text in shown: return outs
        if 'Traceback' in shown or 'Error' in shown:
            pytest.fail(f"the notebook failed while waiting for {text!r}:\n{shown[-3000:]}")
        if time.time() > end:
            pytest.fail(f"{text!r} did not show in {timeout}s; outputs:\n{shown[-3000:]}")
        time.sleep(0.1)
