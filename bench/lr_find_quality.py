"""How good is lr_find's default suggestion? Train with it, and with a grid of LRs, and compare validation losses.

Data: scikit-learn's bundled digits (8x8 images, no download), pixels / 16, a fixed train/valid split.
Models: a small CNN and an MLP. One sweep (seed 0) gives the suggestions. Each LR (every suggestion, and each LR of a
10-point log grid) is scored the same way: train for EPOCHS epochs with a one-cycle schedule peaking at that LR, once
per seed in SEEDS (the seed sets the initial weights, the shuffling and dropout; the same seeds for every LR), and take
the mean of the final validation losses (inf if a run diverged). The line printed per model is
`MODEL: suggestion loss L, best grid loss G, ratio R` (valley; R = L / G, lower is better), followed by the sweep's
time as a fraction of one training epoch (training only, no validation; each the fastest of REPEATS runs, on one
thread). Also printed: the scores of all four suggestions, and the seed-to-seed spread of the losses at the valley and
at the best grid LR (the ratio is only as precise as that); where fastai is installed, the score of fastai's own
lr_find valley on the same model and data (informational).

    .venv/bin/python bench/lr_find_quality.py
"""
import importlib.util, inspect, math, tempfile, time, warnings
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits

from trainer_nb.core import Trainer
import trainer_nb.lr_find  # noqa: F401  (adds Trainer.lr_find)

EPOCHS, BS, SEEDS = 5, 64, (0, 1, 2)
THREADS = 2   # for training
REPEATS = 3   # timings: the fastest of this many runs (the machine may be busy with other work)
GRID = np.logspace(-4, 0, 10)
HAS_SCHEDULE = importlib.util.find_spec('trainer_nb.schedule') is not None
if HAS_SCHEDULE: import trainer_nb.schedule  # noqa: F401  (adds Trainer.fit_one_cycle)
HAS_FASTAI = importlib.util.find_spec('fastai') is not None


def data():
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(42))
    tr, va = perm[:1400], perm[1400:]
    return TensorDataset(X[tr], y[tr]), TensorDataset(X[va], y[va])


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def loaders(train_ds, valid_ds, seed):
    dl = DataLoader(train_ds, batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return dl, None if valid_ds is None else DataLoader(valid_ds, batch_size=256)


def trainer(make, train_ds, valid_ds, lr, seed, one_cycle=False):
    "A fresh trainer: weights, shuffling and dropout from `seed`; no validation when `valid_ds` is None."
    torch.manual_seed(seed)
    model = make()
    dl, vdl = loaders(train_ds, valid_ds, seed)
    sched = None
    if one_cycle and not HAS_SCHEDULE:
        sched = lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    return Trainer(model, dl, vdl, loss_func=F.cross_entropy, lr=lr, scheduler=sched, default_hooks=False, cpu=True)


def train(make, train_ds, valid_ds, lr, seed):
    "Validation loss after EPOCHS epochs of one-cycle at max LR `lr` (inf if it diverged)."
    t = trainer(make, train_ds, valid_ds, lr, seed, one_cycle=True)
    try:
        if HAS_SCHEDULE:
            f = t.fit_one_cycle
            params = inspect.signature(f).parameters
            f(EPOCHS, lr_max=lr) if 'lr_max' in params else f(EPOCHS, lr)
        else: t.fit(EPOCHS)
    except FloatingPointError: return math.inf
    v = t.evaluate()['valid_loss']
    return v if math.isfinite(v) else math.inf


def scorer(make, train_ds, valid_ds):
    """`score(lr)`: the mean validation loss over SEEDS of the same training at `lr` (trained once per LR);
    `score.runs[lr]` holds the loss of each seed."""
    def score(lr):
        lr = float(lr)
        if lr not in score.runs: score.runs[lr] = [train(make, train_ds, valid_ds, lr, s) for s in SEEDS]
        return float(np.mean(score.runs[lr]))
    score.runs = {}
    return score


def spread(runs) -> str:
    "The seed-to-seed standard deviation of `runs`, and the standard error of their mean."
    sd = float(np.std(runs, ddof=1))
    return f"sd {sd:.4f}, se of the mean {sd / math.sqrt(len(runs)):.4f}"


def fastai_valley(make, train_ds, valid_ds) -> float:
    "fastai's lr_find valley for the same model (seed SEEDS[0]), data and optimizer (AdamW)."
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper
    import fastai.callback.schedule  # noqa: F401  (adds Learner.lr_find)
    torch.manual_seed(SEEDS[0])
    model = make()
    dls = DataLoaders(*loaders(train_ds, valid_ds, SEEDS[0]))   # plain torch DataLoaders: the model stays on the CPU
    with tempfile.TemporaryDirectory() as d:   # fastai saves the model there during its sweep
        learn = Learner(dls, model, loss_func=F.cross_entropy, opt_func=partial(OptimWrapper, opt=torch.optim.AdamW),
                        path=d)
        return float(learn.lr_find(show_plot=False).valley)


def timed(f, *args, **kw):
    "`(f(*args, **kw), seconds)`."
    t0 = time.perf_counter()
    out = f(*args, **kw)
    return out, time.perf_counter() - t0


def main():
    torch.set_num_threads(THREADS)
    warnings.filterwarnings('ignore')
    train_ds, valid_ds = data()
    print(f"digits: {len(train_ds)} train / {len(valid_ds)} valid, {EPOCHS} epochs one-cycle "
          f"({'trainer_nb.schedule' if HAS_SCHEDULE else 'torch OneCycleLR'}), grid {GRID[0]:.0e}..{GRID[-1]:.0e}, "
          f"each LR scored by the mean final valid loss over seeds {SEEDS}")
    if not HAS_FASTAI: print("fastai is not installed: its lr_find is not compared")
    for name, make in [('CNN', cnn), ('MLP', mlp)]:
        # timings on one thread: the ratio of the two is what counts, and a thread pool on a busy machine stalls
        torch.set_num_threads(1)
        t = trainer(make, train_ds, None, 1e-3, SEEDS[0])
        t.fit(1)   # warm-up: the first epoch pays one-time costs
        epoch = min(timed(t.fit, 1)[1] for _ in range(REPEATS))
        t = trainer(make, train_ds, valid_ds, 1e-3, SEEDS[0])
        runs = [timed(t.lr_find, show=False) for _ in range(REPEATS)]   # the same sweep each time: it leaves no trace
        res, sweep = runs[0][0], min(dt for _, dt in runs)
        assert all(r.suggestions == res.suggestions for r, _ in runs)
        torch.set_num_threads(THREADS)
        score = scorer(make, train_ds, valid_ds)
        grid = [score(lr) for lr in GRID]
        G = min(grid)
        print(f"  {name} sweep: {len(res.lrs)} steps from {res.lrs[0]:.0e} to {res.lrs[-1]:.2e}, stopped: {res.stop_reason}")
        print(f"  {name} grid: " + ' '.join(f"{lr:.2e}:{g:.4f}" for lr, g in zip(GRID, grid)))
        print(f"  {name} suggestions: " + ', '.join(f"{k} {v:.2e} -> {score(v):.4f} (ratio {score(v) / G:.3f})"
                                                  for k, v in res.suggestions.items()))
        L, best = score(res.valley), float(GRID[int(np.argmin(grid))])
        print(f"  {name} seed spread: valley {spread(score.runs[res.valley])}; "
              f"best grid LR {best:.2e} {spread(score.runs[best])}")
        print(f"{name}: suggestion loss {L:.4f}, best grid loss {G:.4f}, ratio {L / G:.3f}")
        print(f"{name}: sweep time {sweep:.2f}s = {sweep / epoch:.1f}x one training epoch ({epoch:.2f}s, training only, "
              f"fastest of {REPEATS}, 1 thread; "
              f"the sweep took {len(res.lrs)} steps, an epoch has {len(t.train_dl)})")
        if HAS_FASTAI:
            fv = fastai_valley(make, train_ds, valid_ds)
            print(f"{name}: fastai lr_find valley {fv:.2e}: loss {score(fv):.4f}, ratio {score(fv) / G:.3f} (informational)")


if __name__ == '__main__':
    main()
