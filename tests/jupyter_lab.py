"""Shared set-up for the real-browser tests: a JupyterLab server isolated in a temporary folder, with a kernel on this
venv's python, and headless Chromium (Debian's /usr/bin/chromium) driven by Playwright."""
import json, os, secrets, subprocess, sys, time, urllib.request
from contextlib import contextmanager

import pytest

from conftest import free_port

CHROMIUM = '/usr/bin/chromium'
KERNEL = 'trainer-nb-test'
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None


def needs_browser(test):
    "Skip `test` when Playwright or Chromium is missing."
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


@contextmanager
def lab_server(tmp_path):
    """A JupyterLab serving `tmp_path / 'root'` (write notebooks there); yields `(base_url, token)`.
    Its log is `tmp_path / 'jupyterlab.log'`; the server is stopped on exit."""
    root = tmp_path / 'root'
    root.mkdir(exist_ok=True)
    env = jupyter_env(tmp_path)
    port, token = free_port(), secrets.token_hex(16)
    log = tmp_path / 'jupyterlab.log'
    with open(log, 'w') as lf:
        server = subprocess.Popen(
            [sys.executable, '-m', 'jupyterlab', '--no-browser', '--ServerApp.ip=127.0.0.1', f'--ServerApp.port={port}',
             '--ServerApp.port_retries=0', '--ServerApp.allow_root=True', '--ServerApp.terminals_enabled=False',
             f'--IdentityProvider.token={token}', f'--ServerApp.root_dir={root}',
             '--LabApp.expose_app_in_browser=True', '--JupyterNotebookApp.expose_app_in_browser=True',
             '--KernelSpecManager.ensure_native_kernel=False',
             f'--LabApp.workspaces_dir={tmp_path / "workspaces"}', '--LabApp.news_url=None'],
            env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=root)
    try:
        base = f'http://127.0.0.1:{port}'
        wait_for_server(server, f'{base}/api/status?token={token}', log)
        yield base, token
    finally:
        server.terminate()
        try: server.wait(timeout=15)
        except subprocess.TimeoutExpired: server.kill(); server.wait()


_KERNEL_IDLE = ("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
                " return !!k && k.status === 'idle'; }")


@contextmanager
def notebook_page(server, notebook, viewport=(1280, 1100), app='lab'):
    """Headless Chromium showing `notebook` (a name under the server's root) in JupyterLab (`app='lab'`) or Notebook 7
    (`'notebook7'`), with its kernel started and idle; yields the page."""
    base, token = server
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
            '--disable-background-networking', '--disable-component-update', '--disable-sync'])
        try:
            page = browser.new_page(viewport={'width': viewport[0], 'height': viewport[1]})
            route = {'lab': 'lab/tree', 'notebook7': 'notebooks'}[app]
            page.goto(f'{base}/{route}/{notebook}?token={token}')
            page.wait_for_function(_KERNEL_IDLE, timeout=60_000)
            yield page
        finally:
            browser.close()


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
