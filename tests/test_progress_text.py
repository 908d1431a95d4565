"""In a terminal (a plain python process, no kernel): a text bar, one line per epoch, the curves written to a file,
and a clean close on Ctrl-C."""
import subprocess, sys, textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """\
import sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, {repo!r})
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer, Hook
from trainer_nb.recorder import Recorder
from trainer_nb.progress import Progress, detect_mode
from trainer_nb.liveplot import LivePlot

class Interrupt(Hook):
    def after_step(self):
        if self.trainer.state.iteration == {stop_at}: raise KeyboardInterrupt

torch.manual_seed(0)
x = torch.randn(640, 4); y = x @ torch.tensor([[1.], [-2.], [3.], [.5]])
dl = DataLoader(TensorDataset(x, y), batch_size=16)
prog, plot = Progress(every=0.05), LivePlot(path={png!r})
tr = Trainer(nn.Linear(4, 1), dl, dl, loss_func=F.mse_loss, lr=0.05, cpu=True, default_hooks=False,
             hooks=[Recorder(), prog, plot, Interrupt()])
print('mode', detect_mode(), flush=True)
tr.fit(3)
print('valid_losses', *tr.get_hook(Recorder).history['valid_loss'].round(6).tolist())
"""

def run(tmp_path, stop_at=-1):
    png = tmp_path / 'curves.png'
    code = SCRIPT.format(repo=str(REPO), png=str(png), stop_at=stop_at)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return r, png

def test_terminal_bar_and_epoch_lines(tmp_path):
    r, png = run(tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == 'mode text'
    assert out[1].split() == ['epoch', 'train_loss', 'valid_loss', 'time']
    rows = [l.split() for l in out[2:5]]
    assert [row[0] for row in rows] == ['0', '1', '2'], out          # one line per epoch
    valid = [float(v) for v in out[5].split()[1:]]
    assert [float(row[2]) for row in rows] == valid                    # the lines show the real numbers
    assert len(out) == 6, out
    # the tqdm bar (stderr): it counts the epoch's 40 batches and shows the smoothed loss
    assert 'epoch 1/3' in r.stderr and 'epoch 3/3' in r.stderr
    assert '40/40' in r.stderr and 'it/s' in r.stderr and 'loss ' in r.stderr
    # no live plot in a terminal, but the curves are written at the end
    data = png.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 5000

def test_terminal_keyboard_interrupt_closes_cleanly(tmp_path):
    r, png = run(tmp_path, stop_at=50)
    assert r.returncode != 0 and 'KeyboardInterrupt' in r.stderr
    out = r.stdout.splitlines()
    assert [l.split()[0] for l in out[2:-1]] == ['0'], out             # the first epoch (40 batches) completed
    assert out[-1] == 'fit interrupted'
    assert png.read_bytes()[:4] == b'\x89PNG'                          # the curves so far are still written
