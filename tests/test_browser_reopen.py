"""A saved notebook shows, reopened without its kernel, what it showed when it ran: a notebook with a fit, an LR
finder (its widget used: a suggestion picked and applied) and the figures, run in a real JupyterLab in headless
Chromium, saved, its kernel shut down and its kernelspec gone; then opened again in JupyterLab and in Jupyter
Notebook 7. No widget is left in the file, nothing reads "Error displaying widget", every figure is there. The same
notebook run by nbclient (a kernel, no browser) leaves the same file."""
import json, os, re, shutil, time

import nbformat
import pytest

from conftest import REPO
from jupyter_lab import (KERNEL, lab_server, needs_browser, notebook_page, output_texts, run_all_cells, shared_browser,
                         wait_for_text, write_notebook)

WIDGET = 'application/vnd.jupyter.widget-view+json'
CELLS = [f"""\
import sys
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder""",
"""\
torch.manual_seed(0)
x = torch.randn(640, 8); y = x @ torch.randn(8, 1) + 0.1 * torch.randn(640, 1)
trainer = Trainer(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)),
                  DataLoader(TensorDataset(x[:512], y[:512]), batch_size=16, shuffle=True),
                  DataLoader(TensorDataset(x[512:], y[512:]), batch_size=64), loss_func=F.mse_loss, lr=1e-3, cpu=True)
trainer.fit(2)""",
"""\
res = trainer.lr_find()
res.widget.picks.value = 'steep'     # as a click on the 'steep' button and on 'Use this LR' do
res.widget.button.click()""",
"trainer.fit_one_cycle(2, trainer.lr)   # trains at the LR the widget set",
"res.plot()",
"trainer.get_hook(Recorder).plot_loss()",
"print('ALL', 'DONE', trainer.lr == res.suggestions['steep'])"]


def _outputs(path):
    return [o for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == 'code' for o in c.outputs]


def _check_saved(path):
    "The saved file: no widget view in any output; the LR finder's static record, with the LR applied; PNGs."
    nb = nbformat.read(str(path), as_version=4)
    outs = _outputs(path)
    widgets = [o for o in outs if WIDGET in o.get('data', {})]
    assert not widgets, [o['data'].get('text/plain', '')[:80] for o in widgets]
    lr_outs = [o for o in nb.cells[2].outputs if o.get('data')]
    assert len(lr_outs) == 1, lr_outs                         # the record; the sweep's progress line left nothing
    rec = lr_outs[0]['data']
    assert set(rec) == {'text/html', 'image/png', 'text/plain'}
    assert re.search(r'trainer\.lr = \S+: the next fit uses it', rec['text/plain']), rec['text/plain']
    for i in (4, 5):                                          # res.plot() and plot_loss() show themselves
        assert any('image/png' in o.get('data', {}) for o in nb.cells[i].outputs), nb.cells[i].outputs
    return sum('image/png' in o.get('data', {}) for o in outs)


STATE = """const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const imgs = outs.flatMap(o => [...o.querySelectorAll('img')]);
  const s = {n: outs.length, imgs: imgs.length, loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
             text: outs.map(o => o.innerText).join('\\n')};"""
REOPENED = f"() => {{ {STATE} return s; }}"
# rendered: as many pictures as the file holds, every one loaded, no widget still loading
RENDERED = f"(n) => {{ {STATE} return s.imgs >= n && s.loaded === s.imgs && !/Loading widget/.test(s.text); }}"


def _reopen(browser, url, width, pngs, shot=None):
    "What the notebook at `url` shows, once its `pngs` pictures are rendered (and no widget is still loading)."
    # tall enough to hold the whole notebook: JupyterLab and Notebook 7 render only the cells in view
    page = browser.new_page(viewport={'width': width, 'height': 9000})
    page.goto(url)
    page.wait_for_function(RENDERED, arg=pngs, timeout=60_000)
    page.keyboard.press('Escape')                             # the "select a kernel" dialog, if it shows
    state = page.evaluate(REOPENED)
    if shot:
        page.screenshot(path=shot, full_page=True)
    page.close()
    return state


def _shut_down_kernels(server):
    kernels = server.api('api/kernels')
    for k in kernels: server.api(f"api/kernels/{k['id']}", 'DELETE')
    return len(kernels)


@needs_browser
def test_saved_notebook_reopens_without_its_kernel_in_lab_and_notebook7(tmp_path):
    pytest.importorskip('notebook', reason='Jupyter Notebook 7 is not installed: pip install notebook')
    shots = os.environ.get('TNB_SHOTS')
    path = tmp_path / 'root/reopen.ipynb'
    with lab_server(tmp_path, shared=False) as server:   # (its kernelspec is taken away below)
        write_notebook(path, CELLS)
        with notebook_page(server, 'reopen.ipynb', viewport=(1400, 1000)) as page:
            run_all_cells(page)
            outs = wait_for_text(page, 'ALL DONE', timeout=240, cell=len(CELLS) - 1)
            live = output_texts(page)
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            end = time.time() + 30   # the save is done when the file holds the last cell's output
            while 'ALL DONE' not in json.dumps(nbformat.read(str(path), as_version=4).cells[-1].outputs):
                assert time.time() < end, 'the notebook was not saved'
                time.sleep(0.2)
        assert 'ALL DONE True' in outs[-1]
        assert _shut_down_kernels(server) == 1
        shutil.rmtree(tmp_path / 'kprefix/share/jupyter/kernels' / KERNEL)   # no kernel to start on reopening
        pngs = _check_saved(path)

        base, token = server.base, server.token
        browser = shared_browser()
        seen = {name: _reopen(browser, f'{base}/{route}/reopen.ipynb?token={token}', width, pngs,
                              shot=shots and f'{shots}/reopened_{name}.png')
                for name, route, width in [('lab_1400', 'lab/tree', 1400), ('nb7_1400', 'notebooks', 1400),
                                           ('nb7_420', 'notebooks', 420)]}
    for name, s in seen.items():
        assert 'Error displaying widget' not in s['text'] and 'model not found' not in s['text'], (name, s['text'])
        # every picture of the file is shown (the LR finder's record carries its plot twice: as HTML and as PNG)
        assert s['loaded'] == s['imgs'] >= pngs, (name, s, pngs)
        assert 'trainer.lr = ' in s['text'] and 'Reliable' in s['text'], (name, s['text'][-2000:])
    assert 'trainer.lr = ' in live[2]


def test_nbclient_run_leaves_no_widget(tmp_path, monkeypatch):
    "The same notebook executed by nbclient: the file it writes has the LR finder's static record, no widget."
    from nbclient import NotebookClient
    from jupyter_lab import jupyter_env
    for k, v in jupyter_env(tmp_path).items(): monkeypatch.setenv(k, v)
    path = tmp_path / 'run.ipynb'
    write_notebook(path, CELLS)
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name=KERNEL, resources={'metadata': {'path': str(tmp_path)}}).execute()
    nbformat.write(nb, str(path))
    assert 'ALL DONE True' in json.dumps(nb.cells[-1].outputs)
    _check_saved(path)
