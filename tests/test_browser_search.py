"""A search in the background as a person meets it in JupyterLab (headless Chromium): its view in the cell that started
it (the running trial's dashboard and curves, the table of trials, the best curves overlaid) fits a 1400 px and a 420 px
page, the kernel answers a cell while trials train, and when the search ends its still picture takes the view's place."""
import os, statistics
from pathlib import Path

import pytest

from conftest import REPO
from jupyter_lab import lab_server, needs_browser, notebook_page, output_texts, run_cell, wait_for_text, write_notebook
from test_browser_background import ROUND_TRIP, wait_until

pytest.importorskip('optuna')

CELLS = [f"""\
import sys, time
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'tests')!r})
import torch
import search_parts as P
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
from trainer_nb.search import search, loguniform
class Pace(Hook):
    "Steps of a few tens of ms: a trial lasts a few seconds."
    def after_step(self): time.sleep(0.05)
def make(lr, momentum):
    torch.manual_seed(0)
    return Trainer(torch.nn.Linear(8, 1), P.train_dl, P.valid_dl, loss_func=P.mse, lr=lr, hooks=[Pace()],
                   opt_func=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=momentum))
print('SETUP', 'OK')""",
         "s = search(make, {'lr': loguniform(1e-3, 1.0), 'momentum': [0.0, 0.5, 0.9], 'epochs': 3}, n_trials=8, "
         "study_name='seen', seed=0, background=True)",
         "print('free while', 'searching:', not s.done.is_set())",
         "s.wait(); print('ENDED', len(s.study.trials))"]

# the view of cell `i`: its parts, and how far each reaches right of its output area (> 0: cut or overflowing)
PARTS = """(i) => {
  const c = document.querySelectorAll('.jp-CodeCell')[i], v = c && c.querySelector('.tnb-search');
  if (!v) return null;
  const w = Math.min(document.documentElement.clientWidth, c.querySelector('.jp-OutputArea').getBoundingClientRect().right);
  const over = e => e ? Math.round(e.getBoundingClientRect().right - w) : null;
  const img = v.querySelector('img'), table = v.querySelector('table'), wide = v.querySelector('.tnb-wide');
  return {widget: !!c.querySelector('.jupyter-widgets'), stop: !!v.querySelector('button'),
          dash: !!v.querySelector('.trainer-nb-progress'), plot: !!v.querySelector('.trainer-nb-liveplot'),
          img: !!img && img.complete && img.naturalWidth > 0, rows: table ? table.querySelectorAll('tbody tr').length : 0,
          overs: [v, img, wide, v.querySelector('.trainer-nb-progress'), v.querySelector('.trainer-nb-liveplot')].map(over),
          page: (n => n.scrollWidth - n.clientWidth)(c.closest('.jp-Notebook')), text: v.innerText};
}"""


def parts(page, i=1):
    p = page.evaluate(PARTS, i) or {}
    if p: p['over'] = max(x for x in p['overs'] if x is not None)
    return p


def training(p): return bool(p.get('dash') and p.get('plot') and p.get('img') and p.get('rows', 0) >= 1)


def look(page, name, shots, width, ready):
    "The page at `width` px, the view scrolled into sight, once `ready(parts)`: what its parts are, and a screenshot."
    page.set_viewport_size({'width': width, 'height': 1300})
    page.wait_for_timeout(300)   # (a relayout: the live plot redraws at its new width)
    page.locator('.jp-CodeCell').nth(1).locator('.tnb-search').scroll_into_view_if_needed()
    wait_until(page, lambda: ready(parts(page)), f'the view {name} at {width} px')
    p = parts(page)
    page.screenshot(path=str(shots / f'search-{name}-{width}.png'))
    return p


@needs_browser
def test_background_search_in_jupyterlab(tmp_path):
    shots = Path(os.environ.get('TNB_SHOTS', tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root' / 'search.ipynb', CELLS)
        with notebook_page(server, 'search.ipynb', viewport=(1400, 1300)) as page:
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")   # the notebook alone
            run_cell(page, 0)
            wait_for_text(page, 'SETUP OK', cell=0)
            run_cell(page, 1)
            # a trial training (its dashboard and curves) and the trials ended so far (the table, the best curves)
            wait_until(page, lambda: training(parts(page)), 'the live view with a trial running and one ended')
            run_cell(page, 2)
            outs = wait_for_text(page, 'free while searching: True', cell=2)
            assert outs[2].strip() == 'free while searching: True'   # nothing of the search's leaks here
            trips = page.evaluate(ROUND_TRIP)   # a trivial cell, from the browser, while trials train
            mid = {w: look(page, 'running', shots, w, training) for w in (1400, 420)}
            page.set_viewport_size({'width': 1400, 'height': 1300})
            run_cell(page, 3)
            wait_for_text(page, 'ENDED 8', cell=3, timeout=300)
            wait_until(page, lambda: parts(page).get('rows') == 8 and not parts(page).get('widget'),
                       'the still picture in place of the view')
            end = {w: look(page, 'ended', shots, w, lambda p: p.get('img')) for w in (1400, 420)}
            texts = output_texts(page)
    for w, p in mid.items():
        assert p['widget'] and p['stop'] and training(p), (w, p)
        assert p['over'] <= 0 and p['page'] <= 0, (w, p['overs'], p['page'])   # nothing past the cell's right edge
        assert 'running:' in p['text'], (w, p['text'])
    for w, p in end.items():
        assert not p['widget'] and not p['stop'] and not p['plot'] and p['img'] and p['rows'] == 8, (w, p)
        assert p['over'] <= 0 and p['page'] <= 0, (w, p['overs'], p['page'])
        assert 'ended: 8 of 8 trials' in p['text'], (w, p['text'])
    assert 'ENDED 8' in texts[3] and 'ended:' not in texts[3]   # the still picture in the cell that started it only
    assert len(trips) == 30
    trips = sorted(trips)
    print(f"\n'1+1' round trips while a background search trains (ms): median {statistics.median(trips):.0f}, "
          f"p95 {trips[int(0.95 * len(trips)) - 1]:.0f}, max {trips[-1]:.0f}; screenshots in {shots}")
