"""The interactive LR finder as a user drives it: in a real JupyterLab (headless Chromium), read the verdict on the sweep
under the plot, drag the LR slider, see the dashed line move in the plot, click "Use this LR", and find that LR in
`trainer.lr` in the next cell."""
import base64, io, math, re, time

import numpy as np

from conftest import REPO
from jupyter_lab import lab_server, needs_browser, notebook_page, output_texts, run_cell, wait_for_text, write_notebook

CELLS = [f"""\
import sys
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
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
print('LR0', repr(trainer.lr), 'START', repr(start), 'EARLY', len(res.lrs) < 100, 'RELIABLE', res.reliable)""",
# where the figure puts the line for the first and the chosen LR (pixels from the left, as in the PNG)
"""\
ax = res.widget.fig.axes[0]
xs = ax.transData.transform([[start, 1.0], [trainer.lr, 1.0]])[:, 0]
print('NOW', repr(trainer.lr), repr(res.widget.slider.value), trainer.lr == res.widget.slider.value, *xs)"""]

FLOAT = r'([-+0-9.e]+)'


def _shown_png(img) -> bytes:
    "The PNG that the page's `img` element shows (the bytes behind its blob/data URL)."
    b64 = img.evaluate("""async (el) => { const buf = await (await fetch(el.src)).arrayBuffer();
        let s = ''; for (const b of new Uint8Array(buf)) s += String.fromCharCode(b); return btoa(s); }""")
    return base64.b64decode(b64)


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png)).convert('RGB')).astype(int)


def _line_moves(before: np.ndarray, after: np.ndarray):
    "`(old_x, new_x, changed_columns)`: where pixels got lighter (line gone) and darker (line drawn) between two images."
    delta = after.sum(-1) - before.sum(-1)
    darker, lighter = np.nonzero((delta < -60).any(0))[0], np.nonzero((delta > 60).any(0))[0]
    changed = np.nonzero((np.abs(after - before) > 30).any(-1).any(0))[0]
    assert len(darker) and len(lighter), 'the dashed line did not move in the image'
    return float(np.median(lighter)), float(np.median(darker)), changed


@needs_browser
def test_lr_find_widget_slider_and_apply(tmp_path):
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root/lr.ipynb', CELLS)
        with notebook_page(server, 'lr.ipynb', viewport=(1280, 1250)) as page:
            run_cell(page, 0)
            run_cell(page, 1)
            outs = wait_for_text(page, 'START', cell=1)
            pattern = rf'LR0 {FLOAT} START {FLOAT} EARLY (True|False) RELIABLE (True|False)'
            lr0, start, early, reliable = re.search(pattern, outs[1]).groups()
            lr0, start = float(lr0), float(start)

            img = page.locator('.tnb-lr-find img')
            readout = page.locator('.tnb-lr-slider .widget-readout')
            img.scroll_into_view_if_needed()
            readout0, src0, png0 = readout.inner_text().strip(), img.get_attribute('src'), _shown_png(img)
            state = page.locator('.tnb-lr-state')
            state_text, state_classes = state.inner_text().strip(), state.get_attribute('class')
            # the slider shows the suggestion it starts at, to within one of its steps (0.01 decade)
            assert abs(math.log10(float(readout0) / start)) <= 0.011, (readout0, start)

            # drag the slider's handle well away from the suggestion it starts at
            handle = page.locator('.tnb-lr-slider .noUi-handle')
            track = page.locator('.tnb-lr-slider .noUi-target').bounding_box()
            hb = handle.bounding_box()
            hx, hy = hb['x'] + hb['width'] / 2, hb['y'] + hb['height'] / 2
            right = (hx - track['x']) / track['width'] < 0.5
            tx = track['x'] + track['width'] * (0.8 if right else 0.2)
            page.mouse.move(hx, hy)
            page.mouse.down()
            page.mouse.move(tx, hy, steps=12)
            page.mouse.up()

            # wait until the kernel has redrawn for the last position: the image stops changing
            end, last, since = time.time() + 20, None, time.time()
            while time.time() < end:
                src = img.get_attribute('src')
                if src != last: last, since = src, time.time()
                elif src != src0 and time.time() - since > 1.5: break
                time.sleep(0.1)
            readout1, png1 = readout.inner_text().strip(), _shown_png(img)

            page.locator('.tnb-lr-apply').click()
            label = page.locator('.tnb-lr-label')
            end = time.time() + 20
            while 'trainer.lr =' not in label.inner_text() and time.time() < end: time.sleep(0.1)
            label_text = label.inner_text()

            run_cell(page, 2)
            outs = wait_for_text(page, 'NOW', cell=2)
            page.locator('.jp-CodeCell').nth(2).scroll_into_view_if_needed()
            shot = tmp_path / 'lr_find_widget.png'
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nscreenshot: {shot}")
            texts = output_texts(page)

    m = re.search(rf'NOW {FLOAT} {FLOAT} (True|False) {FLOAT} {FLOAT}', outs[2])
    assert m, texts
    # the sweep stopped early (the loss diverged), yet no progress bar is left behind under the widget
    assert early == 'True' and 'lr_find' not in texts[1], texts[1]
    lr, slider_value, same, x_start, x_lr = m.groups()
    lr, slider_value, x_start, x_lr = float(lr), float(slider_value), float(x_start), float(x_lr)

    # under the plot, the verdict on the sweep: this regression's descent is clear
    assert reliable == 'True'
    assert state_text.startswith('Reliable: the smoothed loss falls from'), state_text
    assert 'tnb-lr-reliable' in state_classes and 'tnb-lr-unreliable' not in state_classes

    # the browser's slider moved, and the button put exactly the slider's value into trainer.lr
    assert readout1 != readout0
    assert same == 'True' and lr == slider_value
    assert float(readout1) == float(f'{lr:.2e}'), (lr, readout1)    # what the page showed is what the trainer got
    assert label_text.startswith(f'trainer.lr = {lr:.3e}'), label_text
    assert lr != lr0 and abs(math.log10(lr / start)) > 0.5           # a new LR, far from the suggestion
    assert (lr > start) == right                                     # in the direction of the drag

    # the plot changed only where the dashed line was and where it is now, at the chosen LR's position
    before, after = _pixels(png0), _pixels(png1)
    assert before.shape == after.shape == (400, 640, 3), before.shape
    old_x, new_x, changed = _line_moves(before, after)
    print(f"LR {start:.3e} -> {lr:.3e}; dashed line x {old_x} -> {new_x} (figure: {x_start:.1f} -> {x_lr:.1f})")
    assert abs(old_x - x_start) <= 2 and abs(new_x - x_lr) <= 2, (old_x, x_start, new_x, x_lr)
    assert abs(x_lr - x_start) > 30
    assert all(min(abs(c - old_x), abs(c - new_x)) <= 3 for c in changed), changed
