"""The interactive LR finder as a user drives it: in a real JupyterLab (headless Chromium), read the verdict on the sweep
under the plot, drag the LR slider and see the dashed line follow within 50 ms a move (measured in the page), pick a
suggestion and apply exactly the LR its button shows, and find that LR in `trainer.lr` in the next cell; one display per
call; readable at 1400 and 420 px. Then the README's example: an LR chosen in the widget is the LR its next cell trains
at."""
import json, math, os, re, shutil

import nbformat

from conftest import REPO
from jupyter_lab import lab_server, needs_browser, notebook_page, output_texts, run_cell, wait_for_text, write_notebook

CELLS = [f"""\
import sys
sys.path.insert(0, {str(REPO)!r})
import json, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
import trainer_nb.lr_find""",
"""\
torch.manual_seed(0)
x = torch.randn(512, 8); y = x @ torch.randn(8, 1) + 0.1 * torch.randn(512, 1)
trainer = Trainer(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)),
                  DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
                  loss_func=F.mse_loss, lr=1e-3, cpu=True, default_hooks=False)
res = trainer.lr_find()
start = res.widget.slider.value
def smallest(fig):   # the smallest text (ticks, axis labels, legend) of a drawn figure, in points
    texts = [t for ax in fig.axes for t in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label,
                                            ax.yaxis.label)] + [t for g in fig.legends for t in g.get_texts()]
    return min(t.get_fontsize() for t in texts if t.get_text())
# where the drawn figure puts two LRs (pixels from its left edge), and its width: to check the line's place on the page
ax, W = res.widget.fig.axes[0], res.widget.fig.canvas.get_width_height()[0]
p0, p1 = ax.transData.transform([[1e-4, 1.0], [1e-1, 1.0]])[:, 0]
print('LR0', repr(trainer.lr), 'START', repr(start), 'EARLY', len(res.lrs) < 100, 'RELIABLE', res.reliable,
      'AXIS', p0, p1, W)
print('FONTS', json.dumps({k: [smallest(f), f.get_figwidth()] for k, f in (('wide', res.widget.fig),
                                                                         ('narrow', res.widget.fig_narrow))}))
res   # shown already: nothing more (one display per call)""",
"print('NOW', repr(trainer.lr))"]

FLOAT = r'([-+0-9.e]+)'

# page-side probes: when the pointer moved, and when the dashed line over the plot changed
PROBE = """() => {
  const t = window.__tnb = {moves: [], marks: []};
  document.addEventListener('pointermove', () => t.moves.push(performance.now()), true);
  const m = document.querySelector('.tnb-lr-marker .noUi-origin');
  new MutationObserver(() => t.marks.push(performance.now()))
    .observe(m, {subtree: true, childList: true, attributes: true, characterData: true});
}"""
LINE_AT = """() => {
  const img = document.querySelector('.tnb-lr-find img.tnb-lr-wide').getBoundingClientRect();
  const line = document.querySelector('.tnb-lr-marker.tnb-lr-wide .noUi-handle').getBoundingClientRect();
  return [(line.left + line.width / 2 - img.left) / img.width, img.width];
}"""
# what a reader sees of the widget: which picture shows, how wide; text cut or scrolled sideways; the slider's track
SEEN = """() => {
  const box = document.querySelector('.tnb-lr-find'), shown = e => e.getBoundingClientRect().width > 0;
  const img = [...box.querySelectorAll('img')].filter(shown);
  const cut = [...box.querySelectorAll('.tnb-lr-state, .tnb-lr-label, .widget-readout, button, .widget-label')]
    .filter(e => shown(e) && e.scrollWidth > e.clientWidth + 1).map(e => e.className + ': ' + e.innerText);
  const out = box.closest('.jp-OutputArea-output'), page = document.scrollingElement;
  const kind = i => i.className.includes('tnb-lr-wide') ? 'wide' : 'narrow';
  return {pictures: img.map(i => [kind(i), i.getBoundingClientRect().width]), box: box.getBoundingClientRect().width,
          cut, sideways: [out.scrollWidth - out.clientWidth, page.scrollWidth - page.clientWidth],
          track: box.querySelector('.tnb-lr-slider .noUi-target').getBoundingClientRect().width,
          lines: [...box.querySelectorAll('.tnb-lr-marker .noUi-handle')].filter(shown).length};
}"""


def _line_x(axis, lr):
    "Where `lr` lies on the drawn figure, as a fraction of its width (from the `AXIS` the kernel printed)."
    p0, p1, w = axis
    return (p0 + (math.log10(lr) + 4) / 3 * (p1 - p0)) / w


def _wait_text(page, selector, pred, timeout=20_000):
    page.wait_for_function("([s, re]) => { const e = document.querySelector(s);"
                           " return !!e && new RegExp(re).test(e.innerText); }", arg=[selector, pred], timeout=timeout)
    return page.locator(selector).inner_text().strip()


@needs_browser
def test_lr_find_widget_slider_and_apply(tmp_path):
    shots = os.environ.get('TNB_SHOTS')
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root/lr.ipynb', CELLS)
        with notebook_page(server, 'lr.ipynb', viewport=(1400, 1300)) as page:
            run_cell(page, 0)
            run_cell(page, 1)
            outs = wait_for_text(page, 'AXIS', cell=1)
            m = re.search(rf'LR0 {FLOAT} START {FLOAT} EARLY (True|False) RELIABLE (True|False) AXIS {FLOAT} {FLOAT} {FLOAT}',
                          outs[1])
            lr0, start, early, reliable = float(m[1]), float(m[2]), m[3], m[4]
            axis = tuple(float(v) for v in m.groups()[4:])
            page.wait_for_selector('.tnb-lr-marker.tnb-lr-wide .noUi-handle')
            page.locator('.tnb-lr-find').scroll_into_view_if_needed()
            seen_wide = page.evaluate(SEEN)
            page.locator('.tnb-lr-find').screenshot(path=str(tmp_path / 'lr_find_widget_1400.png'))
            displays = page.evaluate("() => document.querySelectorAll('.jp-CodeCell')[1].querySelectorAll("
                                     "'.tnb-lr-find').length")
            img = page.locator('.tnb-lr-find img.tnb-lr-wide')
            readout = page.locator('.tnb-lr-slider .widget-readout')
            readout0, src0 = readout.inner_text().strip(), img.get_attribute('src')
            state = page.locator('.tnb-lr-state')
            state_text, state_classes = state.inner_text().strip(), state.get_attribute('class')
            at0, width0 = page.evaluate(LINE_AT)

            # drag the slider's handle step by step, away from the suggestion it starts at; after each move, wait for the
            # line over the plot to change, and take the time from the pointer's move to the line's change
            page.evaluate(PROBE)
            handle = page.locator('.tnb-lr-slider .noUi-handle')
            track = page.locator('.tnb-lr-slider .noUi-target').bounding_box()
            hb = handle.bounding_box()
            hx, hy = hb['x'] + hb['width'] / 2, hb['y'] + hb['height'] / 2
            right = (hx - track['x']) / track['width'] < 0.5
            tx = track['x'] + track['width'] * (0.8 if right else 0.2)
            page.mouse.move(hx, hy)
            page.mouse.down()
            latencies, steps = [], 12
            for k in range(1, steps + 1):
                n = page.evaluate('() => window.__tnb.marks.length')
                page.mouse.move(hx + (tx - hx) * k / steps, hy)
                page.wait_for_function(f'() => window.__tnb.marks.length > {n}', timeout=20_000)
                latencies.append(page.evaluate(f"""() => {{ const t = window.__tnb;
                    return t.marks[{n}] - Math.max(...t.moves.filter(m => m <= t.marks[{n}])); }}"""))
            page.mouse.up()
            readout1 = readout.inner_text().strip()
            at1, _ = page.evaluate(LINE_AT)
            src1 = img.get_attribute('src')

            # the kernel gets the slider's last value a moment after the browser shows it: the button's tooltip says when
            page.wait_for_function("(r) => document.querySelector('.tnb-lr-apply').title.endsWith(r)", arg=readout1)
            page.locator('.tnb-lr-apply').click()
            label1 = _wait_text(page, '.tnb-lr-label', f'trainer.lr = {re.escape(readout1)}')
            # pick a suggestion: the readout shows what its button shows, and that is what is applied
            pick = page.locator('.tnb-lr-picks button', has_text='steep')
            pick_text = pick.inner_text().strip()
            pick.click()
            shown = pick_text.split()[1]
            _wait_text(page, '.tnb-lr-slider .widget-readout', f'^{re.escape(shown)}$')
            page.locator('.tnb-lr-apply').click()
            label2 = _wait_text(page, '.tnb-lr-label', f'trainer.lr = {re.escape(shown)}')
            page.locator('.tnb-lr-find').screenshot(path=str(tmp_path / 'lr_find_widget_1400_steep.png'))
            # a phone's width: the narrow picture in the wide one's place
            page.evaluate('() => window.jupyterapp.shell.collapseLeft()')
            page.set_viewport_size({'width': 420, 'height': 1300})
            page.wait_for_function("() => document.querySelector('.tnb-lr-find img.tnb-lr-narrow')"
                                   ".getBoundingClientRect().width > 0")
            page.locator('.tnb-lr-find').scroll_into_view_if_needed()
            seen_narrow = page.evaluate(SEEN)
            page.locator('.tnb-lr-find').screenshot(path=str(tmp_path / 'lr_find_widget_420.png'))
            page.screenshot(path=str(tmp_path / 'lr_find_page_420.png'))
            page.set_viewport_size({'width': 1400, 'height': 1300})

            run_cell(page, 2)
            outs = wait_for_text(page, 'NOW', cell=2)
            texts = output_texts(page)
    print(f"\nslider move -> line moved, ms: {json.dumps([round(v, 1) for v in latencies])}")
    print(f"at 1400 px: {seen_wide}\nat 420 px: {seen_narrow}\nscreenshots in {tmp_path}")
    if shots:
        for f in tmp_path.glob('lr_find_*.png'): shutil.copy(f, shots)
    m = re.search(rf'NOW {FLOAT}', outs[2])
    assert m, texts
    lr = float(m[1])

    # the sweep stopped early (the loss diverged), yet no progress bar is left behind under the widget; one display of
    # the finder for the call, though the cell ends with the result
    assert early == 'True' and 'lr_find: step' not in texts[1], texts[1]
    assert displays == 1 and 'LRFindResult(' not in texts[1], (displays, texts[1])

    # readable at 1400 and 420 px: the picture drawn for the width, every tick and legend text at least 10 CSS px as
    # shown, no text cut, nothing to scroll sideways, one line over the plot, a slider track to drag
    fonts = json.loads(re.search(r'FONTS (.*)', outs[1])[1])
    for seen, kind in ((seen_wide, 'wide'), (seen_narrow, 'narrow')):
        (shown_kind, width), = seen['pictures']
        pt, inches = fonts[kind]
        assert shown_kind == kind and pt / 72 * width / inches >= 10, (seen, fonts)
        assert seen['cut'] == [] and seen['sideways'] == [0, 0] and seen['lines'] == 1, seen
    assert seen_wide['pictures'][0][1] == 500 and seen_wide['track'] > 400, seen_wide
    assert seen_narrow['box'] < 400 and seen_narrow['pictures'][0][1] == seen_narrow['box'], seen_narrow
    assert seen_narrow['track'] >= 150, seen_narrow
    # under the plot, the verdict on the sweep: this regression's descent is clear
    assert reliable == 'True'
    assert state_text.startswith('Reliable: the smoothed loss falls from'), state_text
    assert 'tnb-lr-reliable' in state_classes and 'tnb-lr-unreliable' not in state_classes
    # the readout shows the suggestion the slider starts at, in the finder's one format
    m, e = f'{start:.2e}'.split('e')
    assert readout0 == f'{m}e{int(e):+d}', (readout0, start)

    # every move answered within 50 ms, without a new picture: only the line moved
    assert len(latencies) == steps and max(latencies) < 50, latencies
    assert src1 == src0
    # the line sits at the LR shown, and the picture is shown as wide as it was drawn (100 CSS px an inch)
    assert round(width0) == 500, width0
    # ... on the figure's own axis (to 2 px of the picture as shown)
    assert abs(at0 - _line_x(axis, start)) * width0 < 2, (at0, _line_x(axis, start))
    assert abs(at1 - _line_x(axis, float(readout1))) * width0 < 2, (at1, _line_x(axis, float(readout1)))
    assert abs(math.log10(float(readout1) / start)) > 0.5 and (float(readout1) > start) == right

    # "Use this LR" applied what the readout showed; a picked suggestion applies exactly what its button shows
    assert label1.startswith(f'trainer.lr = {readout1}'), label1
    assert label2.startswith(f'trainer.lr = {shown}'), label2
    assert lr == float(shown) and lr != lr0, (lr, shown)


def readme_cells() -> tuple[str, str]:
    "The README's cell that runs the LR finder, and its next code cell (nbs/index.ipynb: the README is made from it)."
    code = [c.source for c in nbformat.read(REPO / 'nbs' / 'index.ipynb', as_version=4).cells if c.cell_type == 'code']
    i = next(i for i, c in enumerate(code) if 'lrs = trainer.lr_find()' in c)
    return code[i], code[i + 1]


@needs_browser
def test_the_lr_chosen_in_the_widget_is_the_lr_the_readmes_next_cell_trains_at(tmp_path):
    """The README's example in JupyterLab: drag the slider (no click on "Use this LR"), run the README's next cell, and
    its fit's first step trains at the LR the readout showed divided by the one-cycle's `div` (25), the cycle peaking at
    that LR; the finder's default pick is not what it trains at."""
    finder, fit = readme_cells()
    assert 'lrs.apply()' in fit and 'fit_one_cycle' in fit
    cells = [f"import sys\nsys.path.insert(0, {str(REPO)!r})",
             finder + "\nprint('DEFAULT', repr(lrs.choices[lrs.default]), 'LR0', repr(trainer.lr))",
             fit,
             "from trainer_nb.recorder import Recorder\nsteps = trainer.get_hook(Recorder).steps\n"
             "print('FIRST', repr(float(steps.lr.iloc[0])), 'PEAK', repr(float(steps.lr.max())),\n"
             "      'CHOSEN', repr(lrs.chosen), 'LR', repr(trainer.lr))"]
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root/readme.ipynb', cells)
        with notebook_page(server, 'readme.ipynb', viewport=(1400, 1300)) as page:
            run_cell(page, 0)
            run_cell(page, 1)
            outs = wait_for_text(page, 'DEFAULT', cell=1, timeout=120)
            m = re.search(rf'DEFAULT {FLOAT} LR0 {FLOAT}', outs[1])
            default, lr0 = float(m[1]), float(m[2])
            page.wait_for_selector('.tnb-lr-slider .noUi-handle')
            page.locator('.tnb-lr-find').scroll_into_view_if_needed()
            label0 = page.locator('.tnb-lr-label').inner_text().strip()
            # drag the handle to a tenth of the track: far below the default pick
            handle = page.locator('.tnb-lr-slider .noUi-handle').bounding_box()
            track = page.locator('.tnb-lr-slider .noUi-target').bounding_box()
            y = handle['y'] + handle['height'] / 2
            page.mouse.move(handle['x'] + handle['width'] / 2, y)
            page.mouse.down()
            for k in range(1, 9):
                page.mouse.move(handle['x'] + (track['x'] + 0.1 * track['width'] - handle['x']) * k / 8, y)
            page.mouse.up()
            readout = page.locator('.tnb-lr-slider .widget-readout').inner_text().strip()
            label = _wait_text(page, '.tnb-lr-label', f'^trainer.lr = {re.escape(readout)}:')   # applied at once
            run_cell(page, 2)
            outs = wait_for_text(page, 'valid_loss', cell=2, timeout=120)
            # the widget gave way to its static record, which says what was chosen
            record = page.evaluate("() => document.querySelectorAll('.jp-CodeCell')[1].querySelector("
                                   "'.jp-OutputArea').innerText")
            run_cell(page, 3)
            outs = wait_for_text(page, 'CHOSEN', cell=3)
    m = re.search(rf'FIRST {FLOAT} PEAK {FLOAT} CHOSEN {FLOAT} LR {FLOAT}', outs[3])
    first, peak, chosen, lr = map(float, m.groups())
    assert label0 == '' and lr0 == 1e-3                        # before the drag: nothing chosen, nothing applied
    assert label.startswith(f'trainer.lr = {readout}: the next fit uses it'), label
    assert chosen == lr == float(readout) and float(readout) < default / 10, (readout, default)
    # the first step at the chosen LR / 25; the peak (between two steps) just under it
    assert math.isclose(first, chosen / 25, rel_tol=1e-9) and 0.99 * chosen < peak <= chosen, (first, peak, chosen)
    assert f'trainer.lr = {readout}' in record and '.tnb-lr-find' not in record, record
