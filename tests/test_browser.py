"""What a notebook user sees: a real JupyterLab in headless Chromium running a fit with Progress + LivePlot,
and notebooks executed headlessly (nbclient) whose saved files keep the static curves and the final dashboard, also
when a fit was stopped early or failed."""
import base64, re, time

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:   # (the browser tests are skipped then)
    PlaywrightTimeout = TimeoutError

from conftest import REPO
from jupyter_lab import (KERNEL, jupyter_env, lab_server, needs_browser, notebook_page, output_texts, run_all_cells,
                         wait_for_text, write_notebook)

# The notebook that both tests run: a fit of a few seconds with Recorder, Progress and LivePlot.
SETUP = f"""\
import sys, time
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook, CancelFit
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.progress import Progress, detect_mode
from trainer_nb.liveplot import LivePlot
print('mode', detect_mode())"""

def fit_cell(sleep, epochs, raise_at=None, exc=None):
    "A fit of `epochs` epochs of 250 batches; with `raise_at`, a hook raises `exc` (source code) at that iteration."
    stop = f"""
class Stop(Hook):
    def after_step(self):
        if self.trainer.state.iteration == {raise_at}: raise {exc}
""" if raise_at else ''
    return f"""\
class Slow(Hook):
    "Makes each step take a little time, so that the run lasts a few seconds."
    def after_step(self): time.sleep({sleep})
{stop}
torch.manual_seed(0)
x = torch.randn(2400, 8); y = x @ torch.randn(8, 1) + 0.1 * torch.randn(2400, 1)
dl = DataLoader(TensorDataset(x[:2000], y[:2000]), batch_size=8, shuffle=True)
vdl = DataLoader(TensorDataset(x[2000:], y[2000:]), batch_size=100)
plot = LivePlot(every=0.3)
tr = Trainer(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)), dl, vdl, loss_func=F.mse_loss,
             lr=3e-3, cpu=True, default_hooks=False, hooks=[Recorder(), Progress(every=0.2), plot, Slow()]{' + [Stop()]' if raise_at else ''},
             scheduler=lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=n))
tr.fit({epochs})"""

DONE = "print('ALL', 'DONE', plot.n_draws)"

JS_STATE = """() => {
  const p = document.querySelector('.trainer-nb-progress');
  const live = document.querySelector('.trainer-nb-liveplot');   // the live plot: its frames drawn, their last step
  const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const stat = outs.flatMap(o => [...o.querySelectorAll('img')]);
  return {progress: p ? p.innerText : null, live: live ? `${live.dataset.frames}:${live.dataset.step}` : null,
          static_imgs: stat.map(i => i.src.slice(0, 22)),
          static_sizes: stat.map(i => [i.naturalWidth, i.naturalHeight]),
          done_html: [...document.querySelectorAll('.trainer-nb-progress-done')].map(e => e.innerText),
          text: outs.map(o => o.innerText).join('\\n')};
}"""

@needs_browser
def test_jupyterlab_live_dashboard_and_plot(tmp_path):
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root/run.ipynb', [SETUP, fit_cell(sleep=0.004, epochs=3), DONE])
        with notebook_page(server, 'run.ipynb') as page:
            run_all_cells(page)
            progress, srcs, shot_mid = [], [], None
            end = time.time() + 90
            while time.time() < end:
                st = page.evaluate(JS_STATE)
                if st['progress'] and (not progress or progress[-1] != st['progress']): progress.append(st['progress'])
                if st['live'] and (not srcs or srcs[-1] != st['live']): srcs.append(st['live'])
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
    assert 'ALL DONE' in st['text'], f"the notebook did not finish:\n{st['text'][-3000:]}"
    assert 'mode widget' in st['text']
    # the dashboard advanced: several distinct texts, and the batch counter went up
    assert len(progress) >= 3, progress
    assert any('epoch' in p and '/250' in p for p in progress), progress
    # with elapsed time and ETA, for the fit and for the epoch: '[00:01<00:02]', '[00:00<00:01, 98.1 it/s]'
    assert any(len(re.findall(r'\[\d\d:\d\d<\d\d:\d\d[,\]]', p)) == 2 for p in progress), progress
    # the live plot drew new frames at least twice while training
    assert len(srcs) >= 3, f"the live plot drew {len(srcs) - 1} new frames"
    # afterwards: the widgets are gone, a static PNG and the static results table are in the output
    assert st['progress'] is None and st['live'] is None, "the live widgets should be replaced at the end"
    assert any(s.startswith('data:image/png') for s in st['static_imgs']), st['static_imgs']
    assert any(w > 100 and h > 50 for w, h in st['static_sizes']), st['static_sizes']
    assert st['done_html'] and st['done_html'][0].startswith('done'), st['done_html']
    assert 'valid_loss' in st['done_html'][0]

def run_nbclient(tmp_path, monkeypatch, cells, allow_errors=False):
    "Execute a notebook of `cells` with nbclient on the test kernel; returns the saved (and re-read) notebook."
    import nbformat
    from nbclient import NotebookClient
    env = jupyter_env(tmp_path)
    for k in ('JUPYTER_PATH', 'JUPYTER_CONFIG_DIR', 'JUPYTER_RUNTIME_DIR', 'JUPYTER_DATA_DIR', 'IPYTHONDIR', 'MPLBACKEND'):
        monkeypatch.setenv(k, env[k])
    path = tmp_path / 'run.ipynb'
    write_notebook(path, cells)
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=120, kernel_name=KERNEL, allow_errors=allow_errors,
                   resources={'metadata': {'path': str(tmp_path)}}).execute()
    nbformat.write(nb, str(path))
    return nbformat.read(str(path), as_version=4)

def pngs_of(outs): return [base64.b64decode(o['data']['image/png']) for o in outs if 'image/png' in o.get('data', {})]
def htmls_of(outs): return [o['data']['text/html'] for o in outs if 'text/html' in o.get('data', {})]
def widget_views(outs): return [o for o in outs if 'application/vnd.jupyter.widget-view+json' in o.get('data', {})]

def test_nbclient_saved_notebook_keeps_static_png(tmp_path, monkeypatch):
    saved = run_nbclient(tmp_path, monkeypatch, [SETUP, fit_cell(sleep=0, epochs=2), DONE])
    outs = [o for c in saved.cells for o in c.get('outputs', [])]
    text = ''.join(o.get('text', '') for o in outs)
    assert 'mode widget' in text and 'ALL DONE' in text
    pngs = pngs_of(outs)
    assert len(pngs) == 1, "one static PNG of the curves"
    assert pngs[0][:8] == b'\x89PNG\r\n\x1a\n' and len(pngs[0]) > 5000
    htmls = htmls_of(outs)
    assert any('trainer-nb-progress-done' in h and 'valid_loss' in h and h.count('<tr') == 3 for h in htmls), htmls
    # the live widgets' outputs were replaced in place: nothing in the saved file needs a widget to show
    assert not widget_views(outs)

def test_nbclient_stopped_and_failed_fits_leave_static_outputs(tmp_path, monkeypatch):
    "A fit stopped by CancelFit in its second epoch, and one failing with an exception in its first."
    cells = [SETUP, fit_cell(sleep=0, epochs=2, raise_at=300, exc="CancelFit('enough')"),
             fit_cell(sleep=0, epochs=2, raise_at=100, exc="RuntimeError('bad batch')"), DONE]
    saved = run_nbclient(tmp_path, monkeypatch, cells, allow_errors=True)
    stopped, failed = saved.cells[1].outputs, saved.cells[2].outputs
    assert 'ALL DONE' in ''.join(o.get('text', '') for o in saved.cells[3].outputs)
    assert not [o for o in stopped if o.output_type == 'error']
    assert [o.ename for o in failed if o.output_type == 'error'] == ['RuntimeError']   # the error still surfaces
    for outs in (stopped, failed):
        pngs = pngs_of(outs)
        assert len(pngs) == 1 and pngs[0][:4] == b'\x89PNG' and len(pngs[0]) > 5000, "one static PNG of the curves"
        assert not widget_views(outs), "no live widget left in the saved file"
    # the dashboard's final state: how the fit ended, where, and the epochs that completed
    done = [h for h in htmls_of(stopped) if 'trainer-nb-progress-done' in h]
    assert len(done) == 1 and 'stopped early (enough)' in done[0] and 'epoch 2/2, batch 50/250' in done[0], done
    assert done[0].count('<tr') == 2   # the table: a header and the one epoch that finished
    done = [h for h in htmls_of(failed) if 'trainer-nb-progress-done' in h]
    assert len(done) == 1 and 'failed: RuntimeError: bad batch' in done[0] and 'epoch 1/2, batch 100/250' in done[0]
    assert '<tr' not in done[0]   # no epoch finished: no table

# A fit of 30 short epochs that waits twice for the test: after its first batch, and when epoch 15 starts; the test
# lets it go on by creating the files `go1` and `go2` beside the notebook.
BUILD_30 = f"""\
import os
def mae(preds, targets): return (preds - targets).abs().mean()
class Slow(Hook):
    "Makes each step take a little time, so that the plot redraws while the fit runs."
    def after_step(self): time.sleep(0.01)
class Wait(Hook):
    "Waits for the test (a file it creates) after the first batch and when epoch 15 starts."
    order = 40   # after Progress and LivePlot have drawn
    def wait(self, name):
        end = time.time() + 300
        while not os.path.exists(name):
            if time.time() > end: raise TimeoutError(name)
            time.sleep(0.02)
    def after_batch(self):
        if self.trainer.state.iteration == 1: self.wait('go1')
    def before_epoch(self):
        if self.trainer.state.epoch == 14: self.wait('go2')
torch.manual_seed(0)
x = torch.randn(320, 8); y = x @ torch.randn(8, 1) + 0.05 * torch.randn(320, 1)
dl = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16, shuffle=True)
vdl = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=64)"""

# the fit's cell: a few lines, as a person writes it
FIT_30 = """\
plot = LivePlot(every=0.3)
tr = Trainer(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)), dl, vdl,
             loss_func=F.mse_loss, lr=3e-3, cpu=True, default_hooks=False, metrics=[mae],
             hooks=[Recorder(), Progress(every=0.2), plot, Slow(), Wait()],
             scheduler=lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=n))
tr.fit(30)"""

JS_LIVE = """() => [...document.querySelectorAll('.jp-OutputArea-output .trainer-nb-liveplot')].map(e => ({
    frames: +e.dataset.frames || 0, step: +e.dataset.step, layout: e.dataset.layout,
    shown: e.querySelector('canvas').getBoundingClientRect().width,
    height: e.querySelector('canvas').getBoundingClientRect().height,
    area: e.closest('.jp-OutputArea-output').getBoundingClientRect().width}))"""

JS_PICTURES = """() => [...document.querySelectorAll('.jp-OutputArea-output picture img')].map(i => ({
    complete: i.complete, w: i.naturalWidth, shown: i.getBoundingClientRect().width,
    area: i.closest('.jp-OutputArea-output').getBoundingClientRect().width}))"""

JS_TABLE = """(sel) => {
  const t = document.querySelector(sel + ' table.trainer-nb-results');
  if (!t) return null;
  const td = t.querySelector('tbody td'), cs = getComputedStyle(td);
  return {align: cs.textAlign, font: cs.fontSize, padding: cs.paddingTop,
          row_h: t.querySelector('tbody tr').getBoundingClientRect().height,
          epochs: [...t.querySelectorAll('tbody tr')].map(r => r.cells[0].innerText.trim())};
}"""

JS_VIEW = """() => {
  const img = document.querySelector('.trainer-nb-liveplot canvas'), r = img.getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, vw: window.innerWidth, vh: window.innerHeight,
          status: document.querySelector('.trainer-nb-progress').innerText};
}"""

JS_PROGRESS = "() => { const p = document.querySelector('.trainer-nb-progress'); return p ? p.innerText : ''; }"

def fits_window(page):
    "Wait until JupyterLab has laid the notebook out again for the window's new size."
    page.wait_for_function("() => { const o = document.querySelector('.jp-Notebook');"
                           " return o && o.getBoundingClientRect().right <= window.innerWidth + 1; }", timeout=30_000)

@needs_browser
def test_jupyterlab_live_view_stays_readable(tmp_path):
    """At a 1400x900 window: the plot's panels drawn from the start, the plot in view at epoch 15 of 30 above a short
    live table styled as the final one, one epoch numbering; at 900 and 420 px the plot fits the output area."""
    root = tmp_path / 'root'
    shots = {}
    with lab_server(tmp_path) as server:
        write_notebook(root / 'run.ipynb', [SETUP, BUILD_30, FIT_30, DONE])
        with notebook_page(server, 'run.ipynb', viewport=(1400, 900)) as page:
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")   # the file browser closed: the notebook
            run_all_cells(page)
            # paused after the first batch: the live plot's panels are there, drawn at their size (the cell's layout
            # will not jump when the curves come)
            page.wait_for_function("() => document.querySelector('.trainer-nb-liveplot[data-frames]')", timeout=120_000)
            start = page.evaluate(JS_LIVE)
            (root / 'go1').touch()
            # until epoch 15 starts (the fit waits there), the plot keeps its size
            seen = [start]
            while '15/30 [' not in page.evaluate(JS_PROGRESS):
                seen.append(page.evaluate(JS_LIVE))
                assert 'Error' not in ''.join(output_texts(page)), output_texts(page)
                time.sleep(0.05)
            # the plot has drawn curves from epoch 14 by now (16 steps an epoch)
            page.wait_for_function("() => +document.querySelector('.trainer-nb-liveplot').dataset.step > 13 * 16",
                                   timeout=120_000)
            # a person following the fit: the fit's cell at the top of the notebook's panel
            page.evaluate("() => document.querySelectorAll('.jp-CodeCell')[2].scrollIntoView({block: 'start'})")
            page.wait_for_function("() => Math.abs(document.querySelectorAll('.jp-CodeCell')[2]"
                                   ".getBoundingClientRect().top) < 150", timeout=30_000)
            view, live = page.evaluate(JS_VIEW), page.evaluate(JS_TABLE, '.trainer-nb-progress')
            shots['1400'] = tmp_path / 'live_1400.png'
            page.screenshot(path=str(shots['1400']))
            widths = {}
            for w in (900, 420):
                page.set_viewport_size({'width': w, 'height': 900})
                fits_window(page)
                # the widget redraws for its new width at its next frame: wait for it to fit its output area
                page.wait_for_function("() => { const c = document.querySelector('.trainer-nb-liveplot canvas'); "
                                       "return c.getBoundingClientRect().width <= "
                                       "c.closest('.jp-OutputArea-output').getBoundingClientRect().width + 0.5; }",
                                       timeout=30_000)
                widths[w] = page.evaluate(JS_LIVE)
                shots[w] = tmp_path / f'live_{w}.png'
                page.screenshot(path=str(shots[w]))
            page.set_viewport_size({'width': 1400, 'height': 900})
            (root / 'go2').touch()
            wait_for_text(page, 'ALL DONE', timeout=300)
            page.wait_for_function("() => !document.querySelector('.trainer-nb-progress')", timeout=60_000)
            final = page.evaluate(JS_TABLE, '.trainer-nb-progress-done')
            status = page.evaluate("() => document.querySelector('.trainer-nb-progress-done p').innerText")
            page.set_viewport_size({'width': 900, 'height': 900})
            fits_window(page)
            page.wait_for_function(f"({JS_PICTURES})().length > 0", timeout=60_000)
            static = page.evaluate(JS_PICTURES)
            print(f"\nscreenshots: {shots}")
    # the panels were there from the start, at the size they keep
    assert start and start[0]['frames'] >= 1 and start[0]['shown'] >= 800 and start[0]['layout'] == 'row', start
    assert all(len(l) == 1 and l[0]['height'] == start[0]['height'] for l in seen), seen
    # epoch 15 of 30: one numbering (the status line's epoch 15 above a table ending at 14), only the last 5 rows
    assert '15/30 [' in view['status'] and live['epochs'] == ['10', '11', '12', '13', '14'], (view, live)
    # the plot is in view at 1400x900, whole
    assert 0 <= view['top'] and view['bottom'] <= view['vh'] and view['right'] <= view['vw'], view
    # the live table looks as the final one: numbers right-aligned, the same compact rows
    assert live['align'] == final['align'] == 'right', (live, final)
    assert (live['font'], live['padding']) == (final['font'], final['padding']) and live['row_h'] <= 24, (live, final)
    assert abs(live['row_h'] - final['row_h']) <= 1, (live, final)
    # the whole table and the same numbering at the end
    assert final['epochs'] == [str(i) for i in range(1, 31)] and status.startswith('done: epoch 30/30'), status
    # the plot is shown no wider than the output area, at 900 and at 420 px, its panels one under another at 420
    for w, live in widths.items():
        assert len(live) == 1 and live[0]['shown'] <= live[0]['area'] + 0.5, (w, live)
    assert widths[900][0]['layout'] == 'row' and widths[420][0]['layout'] == 'column', widths
    # the picture left behind: drawn at 2x, shown no wider than the output area
    assert static and all(i['complete'] and i['w'] == 1720 and i['shown'] <= i['area'] + 0.5 for i in static), static
