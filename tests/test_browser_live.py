"""The live plot as a person sees it, on a busy machine: a 14-second fit in JupyterLab and in Notebook 7 (headless
Chromium) with two CPU-bound processes beside it. The browser draws each frame it is sent; the page counts the
frames drawn (the widget's `data-frames`, `data-step`) and the test reads when each one landed."""
import os, subprocess, sys, time
from contextlib import contextmanager

import pytest

from conftest import REPO
from jupyter_lab import lab_server, needs_browser, notebook_page, output_texts, run_all_cells, run_cell, \
    wait_for_text, write_notebook

SETUP = f"""\
import sys, time
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
def mae(preds, targets): return (preds - targets).abs().mean()
class Pace(Hook):
    "Steps of about 10 ms, as a small model's on a laptop."
    def after_step(self): time.sleep(0.008)
torch.manual_seed(0)
x = torch.randn(4000, 8); y = x @ torch.randn(8, 1) + 0.1 * torch.randn(4000, 1)
dl = DataLoader(TensorDataset(x[:3200], y[:3200]), batch_size=16, shuffle=True)
vdl = DataLoader(TensorDataset(x[3200:], y[3200:]), batch_size=200)"""

FIT = """\
tr = Trainer(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1)), dl, vdl, loss_func=F.mse_loss,
             metrics=[mae], hooks=[Pace()], cpu=True)
tr.fit_one_cycle(EPOCHS, 1e-2)"""

DONE = "print('ALL', 'DONE', tr.state.step)"

# every frame the page draws: when (ms since the page's start) and the last step it shows
RECORD = """() => {
  window.tnbFrames = [];
  const seen = new WeakSet();
  const watch = new MutationObserver(ms => { for (const m of ms) if (m.attributeName === 'data-frames')
    window.tnbFrames.push([performance.now(), +m.target.dataset.step, m.target.dataset.layout]); });
  watch.observe(document.body, {attributes: true, subtree: true, attributeFilter: ['data-frames']});
}"""


# a CPU-bound loop that ends when its parent, whose pid it is given (read there, it could be read too late), is gone
BUSY = "import os\nwhile os.getppid() == {pid}:\n    for _ in range(1_000_000): pass"


@contextmanager
def busy(n=2):
    """`n` CPU-bound processes beside the test, as a laptop is when the browser, the kernel and training share it; each
    ends by itself when the test's process is gone (killed, its `finally` not run), not left spinning."""
    procs = [subprocess.Popen([sys.executable, '-c', BUSY.format(pid=os.getpid())]) for _ in range(n)]
    try: yield
    finally:
        for p in procs: p.kill()
        for p in procs: p.wait()


def frames_of(page):
    "The frames drawn so far that showed new data: `[(seconds, step), ...]` (a redraw for a new width is left out)."
    out = []
    for t, step, _ in page.evaluate("() => window.tnbFrames"):
        if not out or step != out[-1][1]: out.append((t / 1000, step))
    return out


JS_LIVE = """() => {
  const r = document.querySelector('.trainer-nb-liveplot'), c = r.querySelector('canvas');
  const area = r.closest('.jp-OutputArea-output').getBoundingClientRect();
  const table = document.querySelector('.trainer-nb-progress table.trainer-nb-results');
  const lines = [...document.querySelectorAll('.trainer-nb-progress .tnb-text, .trainer-nb-progress .tnb-nw')]
    .filter(e => getComputedStyle(e).whiteSpace === 'nowrap').map(e => e.getClientRects().length);
  return {layout: r.dataset.layout, step: +r.dataset.step, canvas: c.getBoundingClientRect().width,
          area: area.width, doc: document.documentElement.scrollWidth, vw: window.innerWidth,
          panels_h: c.getBoundingClientRect().height, table: table ? table.getBoundingClientRect().right : 0,
          right: area.right, unbroken: lines};
}"""

JS_RECORD_TABLE = """() => {
  const t = document.querySelector('.trainer-nb-progress-done table.trainer-nb-results');
  const area = t.closest('.jp-OutputArea-output').getBoundingClientRect();
  return {table: t.getBoundingClientRect().right, right: area.right, columns: t.rows[0].cells.length,
          font: parseFloat(getComputedStyle(t.rows[1].cells[1]).fontSize)};
}"""

JS_PICTURE = """() => {
  const i = document.querySelector('picture.trainer-nb-curves img');
  if (!i || !i.complete) return null;
  const area = i.closest('.jp-OutputArea-output').getBoundingClientRect().width;
  return {natural: i.naturalWidth, shown: i.getBoundingClientRect().width, area, narrow: i.currentSrc !== i.src,
          doc: document.documentElement.scrollWidth, vw: window.innerWidth};
}"""


def at_width(page, w):
    page.set_viewport_size({'width': w, 'height': 1000})
    page.wait_for_function("(w) => window.innerWidth === w && document.querySelector('.jp-Notebook, .jp-NotebookPanel')"
                           ".getBoundingClientRect().right <= w + 1", arg=w, timeout=30_000)
    time.sleep(0.5)   # the widget's own redraw for its new width (a frame of the page)


@contextmanager
def running(tmp_path, cells):
    "A notebook of `cells` running in JupyterLab, at 1400 px with its left panel closed: the page."
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root' / 'run.ipynb', cells)
        with notebook_page(server, 'run.ipynb', viewport=(1400, 1000)) as page:
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
            run_all_cells(page)
            yield page


def widths_then_end(page, prefix, read):
    """`read()` and a screenshot of the live view at 1400 px, then at 420 px (`{width: ...}` each, the screenshots at
    `<prefix>_<width>.png`); then, back at 1400 px, the fit's end and its picture: `(seen, shots, output texts)`."""
    seen, shots = {}, {}
    for w in (1400, 420):
        if w != 1400: at_width(page, w)
        seen[w], shots[w] = read(), prefix.parent / f'{prefix.name}_{w}.png'
        page.locator('.trainer-nb-liveplot').last.screenshot(path=str(shots[w]))
    at_width(page, 1400)
    wait_for_text(page, 'ALL DONE', timeout=300)
    page.wait_for_function(f"({JS_PICTURE}) !== null", timeout=60_000)
    return seen, shots, output_texts(page)


@needs_browser
@pytest.mark.serial   # (it makes the machine busy itself: another test beside it would change what it measures)
@pytest.mark.parametrize('app', ['lab', 'notebook7'])
def test_live_plot_keeps_up_on_a_busy_machine(tmp_path, app):
    """Two CPU-bound processes beside a 14-second fit (1,400 steps of 8 ms or more): a frame with new data at least
    twice a second, no gap over 1 s, the steps in order up to the last; at 420 px the panels stack and fit the output;
    the picture left behind takes the narrow form there."""
    epochs, shots = 7, {}
    root = tmp_path / 'root'
    with lab_server(tmp_path) as server:
        write_notebook(root / 'run.ipynb', [SETUP + "\nprint('SET', 'UP')", FIT.replace('EPOCHS', str(epochs)), DONE])
        with notebook_page(server, 'run.ipynb', viewport=(1400, 1000), app=app) as page:
            if app == 'lab': page.evaluate("() => window.jupyterapp.shell.collapseLeft()")   # the notebook alone
            page.evaluate(RECORD)
            run_cell(page, 0)   # the imports and the data, before the machine is made busy: the fit is what is watched
            wait_for_text(page, 'SET UP', timeout=120, cell=0)
            with busy():
                run_cell(page, 1)
                run_cell(page, 2)
                page.wait_for_function("() => window.tnbFrames.length && window.tnbFrames.at(-1)[1] >= 1000",
                                       timeout=300_000)
                live = {1400: page.evaluate(JS_LIVE)}
                shots['live_1400'] = tmp_path / f'{app}_live_1400.png'
                page.screenshot(path=str(shots['live_1400']))
                at_width(page, 420)
                live[420] = page.evaluate(JS_LIVE)
                shots['live_420'] = tmp_path / f'{app}_live_420.png'
                page.screenshot(path=str(shots['live_420']), full_page=True)
                at_width(page, 1400)
                wait_for_text(page, 'ALL DONE', timeout=300)
                frames = frames_of(page)
            page.wait_for_function(f"({JS_PICTURE}) !== null", timeout=60_000)
            picture = {1400: page.evaluate(JS_PICTURE)}
            shots['done_1400'] = tmp_path / f'{app}_done_1400.png'
            page.screenshot(path=str(shots['done_1400']), full_page=True)
            at_width(page, 420)
            page.wait_for_function(f"(() => {{ const p = ({JS_PICTURE})(); return p && p.narrow; }})", timeout=30_000)
            picture[420] = page.evaluate(JS_PICTURE)
            record = page.evaluate(JS_RECORD_TABLE)
            shots['done_420'] = tmp_path / f'{app}_done_420.png'
            page.screenshot(path=str(shots['done_420']), full_page=True)
            outs = output_texts(page)
    times, steps = [f[0] for f in frames], [f[1] for f in frames]
    span = times[-1] - times[0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    worst = sorted(range(len(gaps)), key=gaps.__getitem__)[-5:]
    print(f"\n{app}: {len(frames)} frames with new data over {span:.1f} s: {(len(frames) - 1) / span:.2f} frames/s, "
          f"longest gaps (s, from step) {[(round(gaps[i], 2), steps[i]) for i in worst]}; screenshots {shots}")
    assert f'ALL DONE {200 * epochs}' in outs[-1], outs
    assert span > 10, span   # the fit lasted long enough to say something
    assert (len(frames) - 1) / span >= 2, (len(frames), span)
    assert max(gaps) <= 1.0, sorted(gaps)[-5:]
    assert steps == sorted(steps) and steps[-1] == 200 * epochs, steps   # in order, up to the fit's last step
    # 1400 px: the panels side by side, as wide as the widget allows; 420 px: one under another, within the output
    assert live[1400]['layout'] == 'row' and live[1400]['canvas'] >= 800, live
    assert live[420]['layout'] == 'column' and live[420]['canvas'] <= live[420]['area'] + 0.5, live
    assert live[420]['doc'] <= 420, live   # no sideways scroll
    # the dashboard at 420 px: its table whole within the output, each part of its texts on one line
    assert 0 < live[420]['table'] <= live[420]['right'] + 0.5 and set(live[420]['unbroken']) == {1}, live[420]
    # the record left behind: the whole table (epoch, train_loss, valid_loss, mae, time), its font 10 px or more
    assert record['columns'] == 5 and record['table'] <= record['right'] + 0.5 and record['font'] >= 10, record
    assert picture[1400]['natural'] == 1720 and not picture[1400]['narrow'], picture
    assert picture[420]['narrow'] and picture[420]['shown'] <= picture[420]['area'] + 0.5, picture
    # the narrow picture is drawn for about its width there: its 11 px labels stay at 10 px or more
    assert picture[420]['shown'] >= 0.9 * picture[420]['natural'] / 2, picture
    assert picture[420]['doc'] <= 420, picture


BASELINE = """\
from trainer_nb.liveplot import LivePlot
def model(): torch.manual_seed(0); return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
Trainer(model(), dl, vdl, loss_func=F.mse_loss, metrics=[mae], cpu=True).fit_one_cycle(3, 1e-3)   # the baseline
tr = Trainer(model(), dl, vdl, loss_func=F.mse_loss, metrics=[mae], hooks=[Pace()], cpu=True)
tr.remove_hooks(LivePlot).add_hooks(LivePlot(compare='last'))
tr.fit_one_cycle(4, 1e-2)"""


@needs_browser
def test_live_baseline_is_drawn_under_the_fit(tmp_path):
    """`LivePlot(compare='last')` in JupyterLab: the widget is sent the last fit's curves (its label on the page) and
    draws them from the first frame on, side by side at 1400 px, one panel under another at 420 px, no sideways
    scroll; the picture left behind holds them too."""
    with running(tmp_path, [SETUP, BASELINE, DONE]) as page:
        page.wait_for_function("() => [...document.querySelectorAll('.trainer-nb-liveplot')].some(e => "
                               "e.dataset.baseline && +e.dataset.step >= 300)", timeout=180_000)
        label = page.evaluate("() => [...document.querySelectorAll('.trainer-nb-liveplot')].at(-1).dataset.baseline")
        live, shots, outs = widths_then_end(page, tmp_path / 'baseline', lambda: page.evaluate(JS_LIVE))
    print(f"\nscreenshots {shots}")
    assert 'ALL DONE 800' in outs[-1], outs
    assert label.startswith('baseline: fit-'), label
    assert live[1400]['layout'] == 'row' and live[420]['layout'] == 'column' and live[420]['doc'] <= 420, live


LAYERS = """\
from trainer_nb.inside import LayerStats
from trainer_nb.hooks import Timing
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                    nn.Linear(64, 1))
with torch.no_grad(): net[4].bias.fill_(-30.)   # its ReLU dead from the start
tr = Trainer(net, dl, vdl, loss_func=F.mse_loss, metrics=[mae], cpu=True,
             hooks=[Pace(), LayerStats(every=4, modules=(nn.Linear, nn.ReLU)), Timing()])
tr.fit_one_cycle(4, 1e-2)"""

# the heat maps as drawn: their layers and samples (the widget's `data-heat`), and the pixels of the dead ReLU's row:
# viridis' yellow (a share of 1) in the area under the curves
JS_HEAT = """() => {
  const r = [...document.querySelectorAll('.trainer-nb-liveplot')].at(-1), c = r && r.querySelector('canvas');
  if (!r || !r.dataset.heat) return null;
  const h = JSON.parse(r.dataset.heat), k = c.width / c.getBoundingClientRect().width, y = Math.round(h.top * k);
  const px = c.getContext('2d').getImageData(0, y, c.width, c.height - y).data;
  let yellow = 0;
  for (let i = 0; i < px.length; i += 4) if (px[i] > 240 && px[i + 1] > 215 && px[i + 2] < 60) yellow++;
  const area = r.closest('.jp-OutputArea-output').getBoundingClientRect();
  const time = document.querySelector('.trainer-nb-progress .tnb-time');   // the dashboard's status line (Timing)
  return {...h, yellow: yellow / (k * k), layout: r.dataset.layout, canvas: c.getBoundingClientRect().width,
          height: c.getBoundingClientRect().height, area: area.width, doc: document.documentElement.scrollWidth,
          time: time ? time.innerText : '', time_right: time ? time.getBoundingClientRect().right : 0,
          dash_right: time ? time.closest('.jp-OutputArea-output').getBoundingClientRect().right : 0};
}"""


@needs_browser
def test_layer_stats_heat_maps_in_the_live_view(tmp_path):
    """With a `LayerStats` hook in the fit, the live view draws its heat maps under the curves in JupyterLab: a row per
    watched layer (7), a column per sample, growing while the fit runs; the dead ReLU's row is yellow (a share of 1
    near zero); side by side at 1400 px, one under another within the output at 420 px; the picture left behind holds
    them too (it is taller than the curves alone). With a `Timing` hook, the dashboard's status line says where the
    time goes, within the output at both widths."""
    shots = {}
    with running(tmp_path, [SETUP, LAYERS, DONE]) as page:
        page.wait_for_function(f"(() => {{ const h = ({JS_HEAT})(); return h && h.samples >= 60; }})",
                               timeout=180_000)
        heat = {1400: page.evaluate(JS_HEAT)}
        shots[1400] = tmp_path / 'layerstats-panel-1400.png'
        page.locator('.trainer-nb-liveplot').last.screenshot(path=str(shots[1400]))
        at_width(page, 420)
        page.set_viewport_size({'width': 420, 'height': 1600})   # a phone's page scrolled: the whole widget in view
        page.wait_for_function("() => window.innerHeight === 1600")
        heat[420] = page.evaluate(JS_HEAT)
        shots[420] = tmp_path / 'layerstats-panel-420.png'
        page.locator('.trainer-nb-liveplot').last.screenshot(path=str(shots[420]))
        shots['dashboard_420'] = tmp_path / 'dashboard-timing-420.png'
        page.locator('.trainer-nb-progress').last.screenshot(path=str(shots['dashboard_420']))
        at_width(page, 1400)
        wait_for_text(page, 'ALL DONE', timeout=300)
        page.wait_for_function(f"({JS_PICTURE}) !== null", timeout=60_000)
        natural = page.evaluate("() => { const i = document.querySelector('picture.trainer-nb-curves img');"
                                " return [i.naturalWidth, i.naturalHeight]; }")
        outs = output_texts(page)
    print(f"\nscreenshots {shots}\nheat {heat}\npicture {natural}")
    assert 'ALL DONE 800' in outs[-1], outs
    assert 'LayerStats, epoch 1: 5 (100% of its output zero)' in outs[1], outs[1]   # the text a terminal shows too
    for w in (1400, 420):
        h = heat[w]
        assert h['layers'] == 7 and h['samples'] >= 60 and h['cells'] == [7 * h['samples']] * 2, h
        assert h['yellow'] > 1000, h   # the dead ReLU's row: at least 1000 CSS pixels of it
    assert heat[420]['samples'] >= heat[1400]['samples']
    assert heat[1400]['layout'] == 'row' and heat[1400]['canvas'] >= 800, heat
    assert heat[420]['layout'] == 'column' and heat[420]['canvas'] <= heat[420]['area'] + 0.5, heat
    assert heat[420]['doc'] <= 420, heat   # no sideways scroll
    for w in (1400, 420):   # the dashboard's status line: where the time goes, within the output
        assert heat[w]['time'].startswith('time: data wait ') and ' · step ' in heat[w]['time'], heat[w]
        assert heat[w]['time_right'] <= heat[w]['dash_right'] + 0.5, heat[w]
    assert natural[0] == 1720 and natural[1] > 580, natural   # the curves' 290 px and the heat maps under them


NAMED = """\
from trainer_nb.liveplot import LivePlot
def named(hooks):
    torch.manual_seed(0)
    return Trainer(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1)),
                   DataLoader(TensorDataset(x[:3200], y[:3200]), batch_size=16, shuffle=True),
                   {'near': vdl, 'far': DataLoader(TensorDataset(3 * x[3200:], 3 * y[3200:]), batch_size=200)},
                   loss_func=F.mse_loss, hooks=hooks, cpu=True)
named([]).fit_one_cycle(2, 1e-3)   # the baseline
tr = named([Pace()])
tr.remove_hooks(LivePlot).add_hooks(LivePlot(compare='last'))
tr.fit_one_cycle(3, 1e-2)"""

# the live widget's pixels of the validation curves' colour (COLORS[1], #ff7f0e), in CSS pixels
JS_ORANGE = """() => {
  const r = [...document.querySelectorAll('.trainer-nb-liveplot')].at(-1), c = r && r.querySelector('canvas');
  if (!r || !(+r.dataset.step >= 420)) return null;   // (no frame yet: no data-step)
  const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  const k = c.width / c.getBoundingClientRect().width;
  let n = 0;
  for (let i = 0; i < px.length; i += 4) if (px[i] > 235 && Math.abs(px[i + 1] - 127) < 25 && px[i + 2] < 60) n++;
  return {orange: n / (k * k), step: +r.dataset.step, layout: r.dataset.layout, baseline: r.dataset.baseline,
          doc: document.documentElement.scrollWidth};
}"""


@needs_browser
def test_named_validation_loaders_each_draw_a_curve(tmp_path):
    """With validation loaders under names, the live view draws a validation curve for each (`valid near`, `valid
    far`, the second dotted) where it drew none before: the validation colour on the canvas after two validations, at
    1400 and 420 px; the last fit's, faint, under them (`compare='last'`); the picture left behind holds them too."""
    with running(tmp_path, [SETUP, NAMED, DONE]) as page:
        page.wait_for_function(f"({JS_ORANGE})()", timeout=180_000)
        seen, shots, outs = widths_then_end(page, tmp_path / 'named_valid', lambda: page.evaluate(JS_ORANGE))
    print(f"\nscreenshots {shots}\nseen {seen}")
    assert 'ALL DONE 600' in outs[-1], outs
    for w in (1400, 420):
        assert seen[w] is not None and seen[w]['orange'] > 150, seen   # two curves of dots and lines, not none
        assert seen[w]['baseline'].startswith('baseline: fit-'), seen
    assert seen[1400]['layout'] == 'row' and seen[420]['layout'] == 'column' and seen[420]['doc'] <= 420, seen
