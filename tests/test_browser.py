"""What a notebook user sees: a real JupyterLab in headless Chromium running a fit with Progress + LivePlot,
and a notebook executed headlessly (nbclient) whose saved file keeps the static curves."""
import base64, json, os, socket, subprocess, sys, time, urllib.request, secrets
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = '/usr/bin/chromium'
KERNEL = 'trainer-nb-test'
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

# The notebook that both tests run: a fit of a few seconds with Recorder, Progress and LivePlot.
SETUP = f"""\
import sys, time
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer, Hook
from trainer_nb.recorder import Recorder
from trainer_nb.progress import Progress, detect_mode
from trainer_nb.liveplot import LivePlot
print('mode', detect_mode())"""

def fit_cell(sleep, epochs):
    return f"""\
class Slow(Hook):
    "Makes each step take a little time, so that the run lasts a few seconds."
    def after_step(self): time.sleep({sleep})

torch.manual_seed(0)
x = torch.randn(2400, 8); y = x @ torch.randn(8, 1) + 0.1 * torch.randn(2400, 1)
dl = DataLoader(TensorDataset(x[:2000], y[:2000]), batch_size=8, shuffle=True)
vdl = DataLoader(TensorDataset(x[2000:], y[2000:]), batch_size=100)
plot = LivePlot(every=0.3, max_share=0.2)
tr = Trainer(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)), dl, vdl, loss_func=F.mse_loss,
             lr=3e-3, cpu=True, default_hooks=False, hooks=[Recorder(), Progress(every=0.2), plot, Slow()],
             scheduler=lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=n))
tr.fit({epochs})"""

DONE = "print('ALL', 'DONE', plot.n_draws)"

def write_notebook(path, cells):
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

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

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

JS_STATE = """() => {
  const p = document.querySelector('.trainer-nb-progress');
  const img = document.querySelector('img.trainer-nb-liveplot');
  const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const stat = outs.flatMap(o => [...o.querySelectorAll('img')]).filter(i => !i.classList.contains('trainer-nb-liveplot'));
  return {progress: p ? p.innerText : null, img: img ? img.src : null,
          static_imgs: stat.map(i => i.src.slice(0, 22)),
          static_sizes: stat.map(i => [i.naturalWidth, i.naturalHeight]),
          done_html: [...document.querySelectorAll('.trainer-nb-progress-done')].map(e => e.innerText),
          text: outs.map(o => o.innerText).join('\\n')};
}"""

@pytest.mark.skipif(sync_playwright is None, reason="playwright (Python package) is not installed: pip install playwright")
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium")
def test_jupyterlab_live_dashboard_and_plot(tmp_path):
    root = tmp_path / 'root'; root.mkdir()
    env = jupyter_env(tmp_path)
    write_notebook(root / 'run.ipynb', [SETUP, fit_cell(sleep=0.004, epochs=3), DONE])
    port, token = free_port(), secrets.token_hex(16)
    log = tmp_path / 'jupyterlab.log'
    with open(log, 'w') as lf:
        server = subprocess.Popen(
            [sys.executable, '-m', 'jupyterlab', '--no-browser', '--ServerApp.ip=127.0.0.1', f'--ServerApp.port={port}',
             '--ServerApp.port_retries=0', '--ServerApp.allow_root=True', '--ServerApp.terminals_enabled=False',
             f'--IdentityProvider.token={token}', f'--ServerApp.root_dir={root}',
             '--LabApp.expose_app_in_browser=True', '--KernelSpecManager.ensure_native_kernel=False',
             f'--LabApp.workspaces_dir={tmp_path / "workspaces"}', '--LabApp.news_url=None'],
            env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=root)
    try:
        base = f'http://127.0.0.1:{port}'
        wait_for_server(server, f'{base}/api/status?token={token}', log)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
                '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                '--disable-background-networking', '--disable-component-update', '--disable-sync'])
            try:
                page = browser.new_page(viewport={'width': 1280, 'height': 1100})
                page.goto(f'{base}/lab/tree/run.ipynb?token={token}')
                page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                       " && window.jupyterapp.shell.currentWidget.sessionContext"
                                       " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                                       " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                                       " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                                       timeout=60_000)
                # don't wait for the command's promise: it resolves only when every cell has run
                page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
                progress, srcs, shot_mid = [], [], None
                end = time.time() + 90
                while time.time() < end:
                    st = page.evaluate(JS_STATE)
                    if st['progress'] and (not progress or progress[-1] != st['progress']): progress.append(st['progress'])
                    if st['img'] and (not srcs or srcs[-1] != st['img']): srcs.append(st['img'])
                    if shot_mid is None and len(srcs) >= 3:
                        shot_mid = tmp_path / 'jupyterlab_running.png'
                        page.screenshot(path=str(shot_mid))
                    if 'ALL DONE' in st['text'] or 'Error' in st['text']: break
                    time.sleep(0.1)
                time.sleep(0.5)   # let the last display update land
                st = page.evaluate(JS_STATE)
                shot = tmp_path / 'jupyterlab_done.png'
                page.screenshot(path=str(shot), full_page=True)
                print(f"\nscreenshots: {shot_mid} {shot}")
            finally:
                browser.close()
        assert 'ALL DONE' in st['text'], f"the notebook did not finish:\n{st['text'][-3000:]}"
        assert 'mode widget' in st['text']
        # the dashboard advanced: several distinct texts, and the batch counter went up
        assert len(progress) >= 3, progress
        assert any('epoch' in p and '/250' in p for p in progress), progress
        # the live image changed at least twice while training
        assert len(srcs) >= 3, f"live plot image changed {len(srcs) - 1} times"
        # afterwards: the widgets are gone, a static PNG and the static results table are in the output
        assert st['progress'] is None and st['img'] is None, "the live widgets should be replaced at the end"
        assert any(s.startswith('data:image/png') for s in st['static_imgs']), st['static_imgs']
        assert any(w > 100 and h > 50 for w, h in st['static_sizes']), st['static_sizes']
        assert st['done_html'] and st['done_html'][0].startswith('done'), st['done_html']
        assert 'valid_loss' in st['done_html'][0]
    finally:
        server.terminate()
        try: server.wait(timeout=15)
        except subprocess.TimeoutExpired: server.kill(); server.wait()

def test_nbclient_saved_notebook_keeps_static_png(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    env = jupyter_env(tmp_path)
    for k in ('JUPYTER_PATH', 'JUPYTER_CONFIG_DIR', 'JUPYTER_RUNTIME_DIR', 'JUPYTER_DATA_DIR', 'IPYTHONDIR', 'MPLBACKEND'):
        monkeypatch.setenv(k, env[k])
    path = tmp_path / 'run.ipynb'
    write_notebook(path, [SETUP, fit_cell(sleep=0, epochs=2), DONE])
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=120, kernel_name=KERNEL, resources={'metadata': {'path': str(tmp_path)}}).execute()
    nbformat.write(nb, str(path))
    saved = nbformat.read(str(path), as_version=4)
    outs = [o for c in saved.cells for o in c.get('outputs', [])]
    text = ''.join(o.get('text', '') for o in outs)
    assert 'mode widget' in text and 'ALL DONE' in text
    pngs = [o['data']['image/png'] for o in outs if 'image/png' in o.get('data', {})]
    assert len(pngs) == 1, "one static PNG of the curves"
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b'\x89PNG\r\n\x1a\n' and len(raw) > 5000
    htmls = [o['data']['text/html'] for o in outs if 'text/html' in o.get('data', {})]
    assert any('trainer-nb-progress-done' in h and 'valid_loss' in h and h.count('<tr') == 3 for h in htmls), htmls
    # the live widgets' outputs were replaced in place: nothing in the saved file needs a widget to show
    assert not [o for o in outs if 'application/vnd.jupyter.widget-view+json' in o.get('data', {})]
