"""Loop overhead: steps/s of a hand-written PyTorch loop vs the Trainer, on a tiny MLP on the CPU.

Run: `.venv/bin/python bench/overhead.py [--steps 1500] [--reps 9]`. Contenders run interleaved, best of N, each
repetition starting at the next contender (so none always runs right after another); each line is
`NAME: S steps/s, R x raw`. The run of `--redraw-steps` steps then shows where the notebook defaults' time goes: the
steady-state ratio against a raw loop of the same length, the share spent redrawing, and the fixed cost per fit.
"""
import argparse, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings('ignore')

def make(steps, bs=64):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(steps * bs, 32, generator=g), torch.randint(0, 10, (steps * bs,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, DataLoader(ds, batch_size=bs)

def raw_loop(steps):
    model, dl = make(steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = time.perf_counter()
    for x, y in dl:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return steps / (time.perf_counter() - t)

def trainer_no_hooks(steps):
    from trainer_nb.core import Trainer
    model, dl = make(steps)
    tr = Trainer(model, dl, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True, default_hooks=False)
    t = time.perf_counter()
    tr.fit(1)
    return steps / (time.perf_counter() - t)

def _notebook_trainer(steps):
    "The Trainer with Recorder, Progress and LivePlot, drawing as in a notebook (widgets with no frontend to show them)."
    from trainer_nb.core import Trainer
    from trainer_nb.recorder import Recorder
    from trainer_nb.progress import Progress
    from trainer_nb.liveplot import LivePlot
    model, dl = make(steps)
    hooks = [Recorder(), Progress(mode='widget'), LivePlot(mode='widget')]
    return Trainer(model, dl, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True,
                   default_hooks=False, hooks=hooks), hooks

def trainer_notebook(steps):
    tr, _ = _notebook_trainer(steps)
    t = time.perf_counter()
    tr.fit(1)
    return steps / (time.perf_counter() - t)

def redraw_share(steps=20_000):
    "Share of a long run's wall time spent redrawing the dashboard and the plot, with the notebook defaults."
    raw = raw_loop(steps)
    tr, (_, prog, plot) = _notebook_trainer(steps)
    t = time.perf_counter()
    tr.fit(1)
    wall = time.perf_counter() - t
    print(f"trainer (notebook defaults, {steps} steps): {steps / wall:.0f} steps/s, {steps / wall / raw:.3f} x raw "
          f"({raw:.0f} steps/s, one run each)")
    print(f"redraw share ({steps} steps, notebook defaults): {(prog.draw_time + plot.draw_time) / wall:.2%} of "
          f"{wall:.1f} s wall (plot: {plot.n_draws} draws, {plot.draw_time:.3f} s; dashboard: {prog.n_draws} "
          f"redraws, {prog.draw_time:.3f} s; one-time figure setup {plot.setup_time:.3f} s)")

CONTENDERS = {'raw loop': raw_loop, 'trainer (no hooks)': trainer_no_hooks, 'trainer (notebook defaults)': trainer_notebook}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--steps', type=int, default=1500)
    ap.add_argument('--reps', type=int, default=9)
    ap.add_argument('--redraw-steps', type=int, default=20_000, help='steps of the redraw-share run (0: skip it)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    for f in CONTENDERS.values(): f(100)   # warm up
    best = {n: 0.0 for n in CONTENDERS}
    names = list(CONTENDERS)
    for r in range(a.reps):
        for n in names[r % len(names):] + names[:r % len(names)]: best[n] = max(best[n], CONTENDERS[n](a.steps))
    for n, v in best.items(): print(f"{n}: {v:.0f} steps/s, {v / best['raw loop']:.3f} x raw")
    if a.redraw_steps: redraw_share(a.redraw_steps)

if __name__ == '__main__': main()
