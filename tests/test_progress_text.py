"""Progress and LivePlot outside a notebook frontend. In a terminal (a plain python process, no kernel): a text bar, one
line per epoch, the curves written to a file, and a clean close on Ctrl-C. With a real clock: the redraws keep to
their throttle, and the dashboard shows an ETA. With two processes: only the main one shows or writes anything."""
import os, re, subprocess, sys, time

import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO, VENV_BIN, free_port

SCRIPT = """\
import sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, {repo!r})
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.progress import Progress, detect_mode
from trainer_nb.liveplot import LivePlot

class Interrupt(Hook):
    def after_batch(self):
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
    assert [row[0] for row in rows] == ['1', '2', '3'], out          # one line per epoch, counted from 1
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
    assert [l.split()[0] for l in out[2:-1]] == ['1'], out             # the first epoch (40 batches) completed
    assert out[-1] == 'fit interrupted'
    assert png.read_bytes()[:4] == b'\x89PNG'                          # the curves so far are still written


# ---- in this process, with the real clock ----

def sleepy_trainer(hooks, n_batches=40, sleep=0.012, epochs=2):
    "A fit of about `epochs * n_batches * sleep` seconds (a hook sleeps at each batch)."
    from trainer_nb.base import Hook
    from trainer_nb.core import Trainer
    from trainer_nb.recorder import Recorder
    class Sleep(Hook):
        def after_batch(self): time.sleep(sleep)
    torch.manual_seed(0)
    x = torch.randn(n_batches * 8, 4); y = x @ torch.tensor([[1.], [-2.], [3.], [.5]])
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    return Trainer(nn.Linear(4, 1), dl, dl, loss_func=F.mse_loss, lr=0.05, cpu=True, default_hooks=False,
                   hooks=[Recorder(), Sleep(), *hooks])

def test_default_throttles_are_honoured():
    "Default `every`: 0.25 s for the plot, 0.3 s for the dashboard, over a fit of about 2 s timed by the real clock."
    from trainer_nb.base import Hook
    from trainer_nb.progress import Progress
    from trainer_nb.liveplot import LivePlot
    prog, plot = Progress(mode='widget'), LivePlot(mode='widget')
    assert (prog.every, plot.every) == (0.3, 0.25)
    plot_times, prog_times = [], []   # when each frame was sent (read by the view), when each dashboard redraw ended
    class Watch(Hook):
        "Notes when the plot's view is sent each frame, and when each redraw of the dashboard made during the batches ended."
        order = 40
        def before_fit(self):
            self.m, show = 0, plot.view.show
            def timed(*a):
                plot_times.append((time.perf_counter(), tr.state.batch))
                show(*a)
            plot.view.show = timed
        def after_batch(self):
            if prog.n_draws > self.m: prog_times.append(time.perf_counter()); self.m = prog.n_draws
    tr = sleepy_trainer([prog, plot, Watch()], n_batches=80)
    t = time.perf_counter()
    tr.fit(2)
    wall = time.perf_counter() - t
    assert wall > 1.8
    # the plot: a frame every 0.25 s while batches run, one before and one after each validation at least 0.25 / 4
    # after the one before, and the last epoch's at once: it sent frames while training, and kept to its pace
    assert 4 <= plot.n_draws <= wall / 0.25 + 2 * 2 + 2, (plot.n_draws, wall)
    gaps = [b[0] - a[0] for a, b in zip(plot_times, plot_times[1:])]
    assert len(gaps) >= 3 and all(g >= 0.25 / 4 for g in gaps[:-1]), plot_times
    assert sum(g < 0.25 for g in gaps) <= 2 * 2, gaps   # the sooner ones: at most two an epoch
    # the dashboard: at most one redraw per 0.3 s, plus those an epoch forces (start, validation, end: 3 an epoch)
    assert 4 <= prog.n_draws <= wall / 0.3 + 2 * 3 + 1, (prog.n_draws, wall)
    assert len(prog_times) >= 3, prog_times

def test_dashboard_shows_an_eta():
    from trainer_nb.base import Hook
    from trainer_nb.progress import Progress
    prog = Progress(mode='widget', every=0.1)
    seen = {}
    class Look(Hook):
        order = 40
        def after_batch(self):
            if self.trainer.state.iteration == 60:   # a quarter of the fit: 2 epochs of 120 batches
                seen.update(epoch=prog.view.texts['epoch'], batch=prog.view.texts['batch'])
    tr = sleepy_trainer([prog, Look()], n_batches=120, sleep=0.008)
    tr.fit(2)
    eta = re.compile(r'\[(\d\d):(\d\d)&lt;(\d\d):(\d\d)')
    m = eta.search(seen['epoch'])   # the fit's elapsed time and ETA, e.g. '1/2 [00:01&lt;00:03]'
    assert m and seen['epoch'].startswith('1/2'), seen
    # the ETA is the time so far scaled by what is left of the whole fit (2 epochs of 120 batches), as of that redraw,
    # whatever the machine's speed: each shown rounded to the second
    elapsed, fit_eta, b = 60 * int(m[1]) + int(m[2]), 60 * int(m[3]) + int(m[4]), int(seen['batch'].split('/')[0])
    left = (240 - b) / b
    assert (elapsed - 0.5) * left - 0.5 <= fit_eta <= (elapsed + 0.5) * left + 0.5, seen
    m = eta.search(seen['batch'])   # the epoch's (as of the last redraw, at most 0.1 s before): '59/120 [00:01&lt;00:01, ...'
    # (batches take 8 ms or more: at most 0.1 / 0.008 of them, and the one under way, since that redraw)
    assert m and 47 <= int(seen['batch'].split('/')[0]) <= 60 and '/120 [' in seen['batch'] and 'it/s' in seen['batch'], seen
    assert '?' not in seen['epoch'] + seen['batch']
    assert prog.view.bounds == {'epoch': (0, 2), 'batch': (0, 120)}


# ---- two processes ----

DIST_SCRIPT = """\
import os, sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, {repo!r})
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.progress import Progress
from trainer_nb.liveplot import LivePlot
rank = int(os.environ['RANK'])
sys.stderr = open(f'stderr{{rank}}.txt', 'w')   # the text bar writes to stderr: one file per process
out = open(f'stdout{{rank}}.txt', 'w')
torch.manual_seed(0)
x = torch.randn(256, 4); y = x @ torch.tensor([[1.], [-2.], [3.], [.5]])
dl = DataLoader(TensorDataset(x, y), batch_size=16)
prog, plot = Progress(mode='text', file=out, every=0), LivePlot(mode='text', path=f'curves{{rank}}.png')
tr = Trainer(nn.Linear(4, 1), dl, dl, loss_func=F.mse_loss, lr=0.05, default_hooks=False, hooks=[Recorder(), prog, plot])
tr.fit(2)
print('rank', rank, 'of', tr.accelerator.num_processes, 'redraws', prog.n_draws, plot.n_draws,
      'steps', len(tr.get_hook(Recorder).steps), file=out, flush=True)
"""

def test_only_the_main_process_shows_anything(tmp_path):
    "Progress and LivePlot are MainProcessHooks: in a real two-process run (gloo, CPU) the other process stays silent."
    script = tmp_path / 'two.py'
    script.write_text(DIST_SCRIPT.format(repo=str(REPO)))
    env = dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()), str(script)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = [(tmp_path / f'stdout{k}.txt').read_text().splitlines() for k in (0, 1)]
    err = [(tmp_path / f'stderr{k}.txt').read_text() for k in (0, 1)]
    # the main process: a line per epoch, the bar, the curves
    assert out[0][0].split() == ['epoch', 'train_loss', 'valid_loss', 'time'] and len(out[0]) == 4, out[0]
    _, rank, _, n, _, prog_draws, plot_draws, _, steps = out[0][-1].split()
    assert (rank, n, steps) == ('0', '2', '16') and int(prog_draws) > 0 and int(plot_draws) == 0   # (no live view)
    assert 'epoch 2/2' in err[0] and (tmp_path / 'curves0.png').read_bytes()[:4] == b'\x89PNG'
    # the other: trained (and recorded) as well, but showed and wrote nothing
    assert out[1] == ['rank 1 of 2 redraws 0 0 steps 16'], out[1]
    assert 'epoch' not in err[1] and not (tmp_path / 'curves1.png').exists()


def test_one_epoch_numbering_in_text_mode_across_fits(capsys):
    "Epochs counted from 1, going on across fits: the bar's 'epoch N/M', the epoch lines and the history agree."
    import io
    from trainer_nb.progress import Progress
    out = io.StringIO()
    tr = sleepy_trainer([Progress(mode='text', file=out, every=0)], n_batches=4, sleep=0)
    tr.fit(2)
    tr.fit(2)   # goes on: epochs 3 and 4
    bars = sorted(set(re.findall(r'epoch (\d+)/(\d+)', capsys.readouterr().err)))
    assert bars == [('1', '2'), ('2', '2'), ('3', '4'), ('4', '4')], bars
    lines = [l.split() for l in out.getvalue().splitlines()]
    assert [l[0] for l in lines] == ['epoch', '1', '2', 'epoch', '3', '4'], lines   # a header per fit
    assert list(tr.history.index) == [1, 2, 3, 4] and tr.epoch_results['epoch'] == tr.state.epoch == 4
