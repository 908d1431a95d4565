"""A fit in the background as a person meets it in JupyterLab and Notebook 7 (headless Chromium): the view in the cell
that started it keeps updating while other cells run; a trivial cell's round trip is timed from the browser; a pause,
an LR change from a cell and from the view's box, a page reload and `attach`, the stop button of the view."""
import json, os, statistics, time

import pytest

from conftest import REPO
from jupyter_lab import _KERNEL_IDLE, lab_server, needs_browser, notebook_page, output_texts, run_cell, wait_for_text, write_notebook

SETUP = f"""\
import sys
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
import time
class Say(Hook):
    def after_epoch(self): print(f"hook print: epoch {{self.trainer.state.epoch + 1}} done")
class Pace(Hook):
    "Steps of a few ms, as a small model's on a laptop."
    def after_step(self): time.sleep(0.003)
torch.manual_seed(0)
x = torch.randn(4096, 16); y = x.sum(1, keepdim=True)
t = Trainer(nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1)),
            DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
            DataLoader(TensorDataset(x[:512], y[:512]), batch_size=256), loss_func=F.mse_loss, hooks=[Say(), Pace()])
print('SETUP', 'OK')"""

CELLS = [SETUP,
         "t.fit_one_cycle(EPOCHS, 1e-3, background=True)",
         "print('cell', 2, 'ran while running:', t.running)",
         "with t.paused():\n    b = next(iter(t.train_dl))\n    print('PAUSED at step', t.state.step, tuple(b[0].shape))",
         "t.set(lr=5e-4); print('SET', 'asked')",
         "t.attach()",
         "print('CHANGES', [(c['step'], c['new']) for c in t.changes])",
         "try: t.wait()\nexcept KeyboardInterrupt as e: print('STOPPED', type(e).__name__, t.state.step > 0)"]

ROUND_TRIP = """async () => {
  const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel, out = [];
  for (let i = 0; i < 30; i++) {
    const t0 = performance.now();
    await k.requestExecute({code: '1+1', silent: false, store_history: false}).done;
    out.push(performance.now() - t0);
  }
  return out;
}"""

VIEW = """() => [...document.querySelectorAll('.jp-CodeCell')].map(c => {
  const v = c.querySelector('.trainer-nb-fit');
  return v ? {dash: !!v.querySelector('.trainer-nb-progress .tnb-dash'), plot: !!v.querySelector('.trainer-nb-liveplot'),
              text: v.innerText} : null; })"""


def views(page): return page.evaluate(VIEW) + [None] * len(CELLS)   # (cells not drawn yet: None)


def wait_until(page, pred, what, timeout=120):
    end = time.time() + timeout
    while not pred():
        if time.time() > end: pytest.fail(f"{what} did not happen in {timeout}s; outputs:\n{output_texts(page)}")
        page.wait_for_timeout(100)


@needs_browser
@pytest.mark.parametrize('app', ['lab', 'notebook7'])
def test_background_fit_in_the_browser(tmp_path, app):
    shots = __import__('pathlib').Path(os.environ.get('TNB_SHOTS', tmp_path))   # (where the screenshots go)
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root' / 'bg.ipynb', [c.replace('EPOCHS', '30') for c in CELLS])
        with notebook_page(server, 'bg.ipynb', viewport=(1400, 1200), app=app) as page:
            if app == 'lab': page.evaluate("() => window.jupyterapp.shell.collapseLeft()")   # the notebook alone
            run_cell(page, 0)
            wait_for_text(page, 'SETUP OK', cell=0)
            run_cell(page, 1)
            wait_until(page, lambda: (views(page)[1] or {}).get('plot'), 'the live view in cell 1')
            run_cell(page, 2)
            outs = wait_for_text(page, 'ran while running: True', cell=2)
            assert outs[2].strip() == 'cell 2 ran while running: True'   # nothing of the fit's leaks here
            trips = page.evaluate(ROUND_TRIP)   # a trivial cell, from the browser, while the fit trains
            step0 = page.evaluate("() => +document.querySelector('.trainer-nb-liveplot').dataset.step")
            wait_until(page, lambda: page.evaluate(
                "() => +document.querySelector('.trainer-nb-liveplot').dataset.step") > step0, 'a new frame')
            run_cell(page, 3)
            wait_for_text(page, 'PAUSED at step', cell=3)
            run_cell(page, 4)
            wait_for_text(page, 'SET asked', cell=4)
            status = lambda i: (views(page)[i] or {}).get('text', '')
            wait_until(page, lambda: '\u2192 0.0005 at step' in status(1), 'the change shown in the view')
            wait_until(page, lambda: 'hook print: epoch 1 done' in status(1), "the hook's prints in the view")
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            page.reload()   # the page reloaded while the kernel trains on
            page.wait_for_function(_KERNEL_IDLE, timeout=60_000)
            page.wait_for_function(f"() => document.querySelectorAll('.jp-CodeCell').length === {len(CELLS)}")
            if app == 'lab': page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
            wait_until(page, lambda: (views(page)[1] or {}).get('plot'), 'the saved view live again after the reload')
            run_cell(page, 5)
            wait_until(page, lambda: (views(page)[5] or {}).get('plot'), 'the view attached in cell 5')
            wait_until(page, lambda: 'moved to a later cell' in status(1), 'the older view saying where it went')
            view = page.locator('.jp-CodeCell').nth(5).locator('.trainer-nb-fit')
            view.locator('input').fill('0.0002')   # the view's own controls: an LR from the page
            view.locator('input').press('Enter')
            view.get_by_role('button', name='Set LR').click()
            wait_until(page, lambda: '\u2192 0.0002 at step' in status(5), 'the LR set from the page')
            run_cell(page, 6)
            outs = wait_for_text(page, 'CHANGES [(', cell=6)
            n = sum(f'epoch {e} done' in status(5) for e in range(1, 31))
            wait_until(page, lambda: sum(f'epoch {e} done' in status(5) for e in range(1, 31)) > n,
                       "a hook's print after the reload, in the attached view")
            assert ', 0.0005), (' in outs[6] and ', 0.0002)]' in outs[6]
            page.wait_for_function("() => +document.querySelector('.trainer-nb-fit .trainer-nb-liveplot')"
                                   ".dataset.step > 0")
            if app == 'lab':
                view.scroll_into_view_if_needed()
                page.screenshot(path=str(shots / 'background-1400.png'))
                page.set_viewport_size({'width': 420, 'height': 1200})
                page.wait_for_function("() => document.querySelector('.trainer-nb-fit .trainer-nb-liveplot')"
                                       ".dataset.layout === 'column'")
                view.scroll_into_view_if_needed()
                page.screenshot(path=str(shots / 'background-420.png'))
                page.set_viewport_size({'width': 1400, 'height': 1200})
            view.get_by_role('button', name='Stop').click()   # the stop button of the view
            run_cell(page, 7)
            wait_for_text(page, 'STOPPED FitStopped True', cell=7)
            wait_until(page, lambda: 'stopped: trainer.resume() goes on' in status(5), 'the view saying stopped')
    trips = sorted(trips)
    print(f"\n{app}: '1+1' round trips while a background fit trains (ms): median {statistics.median(trips):.0f}, "
          f"p95 {trips[int(0.95 * len(trips)) - 1]:.0f}, max {trips[-1]:.0f}")


LR_CELLS = [SETUP.replace("nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1)",
                          "nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)"),
            "t.lr_find(num_it=60, check=25, runs=2, background=True)",
            "print('FREE', t.running)",
            "res = t.wait(); print('APPLIED', t.lr == res.chosen, res.chosen is not None)"]


@needs_browser
def test_lr_find_in_the_background_shows_its_widget_before_the_check_ends(tmp_path):
    "The sweep's widget in the view while the check trains; a suggestion clicked then is applied when it ends."
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root' / 'lr.ipynb', LR_CELLS)
        with notebook_page(server, 'lr.ipynb', viewport=(1400, 1200)) as page:
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
            run_cell(page, 0)
            wait_for_text(page, 'SETUP OK', cell=0)
            run_cell(page, 1)
            run_cell(page, 2)
            wait_for_text(page, 'FREE True', cell=2)
            view = page.locator('.jp-CodeCell').nth(1).locator('.trainer-nb-fit')
            view.locator('.tnb-lr-find').wait_for(timeout=120_000)
            running = view.locator('.tnb-status').inner_text()
            view.locator('.tnb-lr-picks button').first.click()   # a suggestion, while the check runs
            page.wait_for_function("() => [...document.querySelectorAll('.tnb-lr-label')].some(e => "
                                   "/chosen|trainer\\.lr = /.test(e.innerText))", timeout=120_000)
            run_cell(page, 3)
            outs = wait_for_text(page, 'APPLIED', cell=3, timeout=300)
            assert 'APPLIED True True' in outs[3]
            assert running == 'running'   # the widget was there before the check had ended
            assert view.locator('.tnb-lr-find').count() == 1   # shown once, updated in place
            page.wait_for_function("() => /trainer\\.lr = /.test(document.querySelector('.tnb-lr-label').innerText)")
            page.screenshot(path=str(tmp_path / 'lr.png'))
