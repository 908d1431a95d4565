"""How good is lr_find's default suggestion? Train with it, and with a grid of LRs, and compare validation losses.

Data: scikit-learn's bundled digits (8x8 images, no download), pixels / 16, a fixed train/valid split.
Models: a small CNN and an MLP. Each is trained for EPOCHS epochs with a one-cycle schedule at the suggested
LR (valley) and at each LR of a 10-point log grid, with the same seeds; the line printed per model is
`MODEL: suggestion loss L, best grid loss G, ratio R` (validation losses; R = L / G, lower is better), followed
by the sweep's time as a fraction of one training epoch.

    .venv/bin/python bench/lr_find_quality.py
"""
import importlib.util, inspect, math, time, warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits

from trainer_nb.core import Trainer
import trainer_nb.lr_find  # noqa: F401  (adds Trainer.lr_find)

EPOCHS, BS, SEED = 5, 64, 0
GRID = np.logspace(-4, 0, 10)
HAS_SCHEDULE = importlib.util.find_spec('trainer_nb.schedule') is not None
if HAS_SCHEDULE: import trainer_nb.schedule  # noqa: F401  (adds Trainer.fit_one_cycle)


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


def trainer(make, train_ds, valid_ds, lr, one_cycle=False):
    torch.manual_seed(SEED)
    model = make()
    g = torch.Generator().manual_seed(SEED)
    dl = DataLoader(train_ds, batch_size=BS, shuffle=True, generator=g)
    vdl = DataLoader(valid_ds, batch_size=256)
    sched = None
    if one_cycle and not HAS_SCHEDULE:
        sched = lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    return Trainer(model, dl, vdl, loss_func=F.cross_entropy, lr=lr, scheduler=sched, default_hooks=False, cpu=True)


def train(make, train_ds, valid_ds, lr):
    "Validation loss after EPOCHS epochs of one-cycle at max LR `lr` (inf if it diverged)."
    t = trainer(make, train_ds, valid_ds, lr, one_cycle=True)
    try:
        if HAS_SCHEDULE:
            f = t.fit_one_cycle
            params = inspect.signature(f).parameters
            f(EPOCHS, lr_max=lr) if 'lr_max' in params else f(EPOCHS, lr)
        else: t.fit(EPOCHS)
    except FloatingPointError: return math.inf
    v = t.evaluate()['valid_loss']
    return v if math.isfinite(v) else math.inf


def main():
    torch.set_num_threads(2)
    warnings.filterwarnings('ignore')
    train_ds, valid_ds = data()
    print(f"digits: {len(train_ds)} train / {len(valid_ds)} valid, {EPOCHS} epochs one-cycle "
          f"({'trainer_nb.schedule' if HAS_SCHEDULE else 'torch OneCycleLR'}), grid {GRID[0]:.0e}..{GRID[-1]:.0e}")
    for name, make in [('CNN', cnn), ('MLP', mlp)]:
        t = trainer(make, train_ds, valid_ds, 1e-3)
        t.fit(1)   # warm-up: the first epoch pays one-time costs
        t0 = time.perf_counter(); t.fit(1); epoch = time.perf_counter() - t0
        t = trainer(make, train_ds, valid_ds, 1e-3)
        t0 = time.perf_counter(); res = t.lr_find(show=False); sweep = time.perf_counter() - t0
        L = train(make, train_ds, valid_ds, res.valley)
        grid = [train(make, train_ds, valid_ds, lr) for lr in GRID]
        G = min(grid)
        print(f"  {name} suggestions: " + ', '.join(f"{k} {v:.2e}" for k, v in res.suggestions.items())
              + f"; grid: " + ' '.join(f"{lr:.0e}:{g:.3f}" for lr, g in zip(GRID, grid)))
        print(f"{name}: suggestion loss {L:.4f}, best grid loss {G:.4f}, ratio {L / G:.3f}")
        print(f"{name}: sweep time {sweep:.2f}s = {sweep / epoch:.1f}x one training epoch ({epoch:.2f}s with validation; "
              f"the sweep took {len(res.lrs)} steps, an epoch has {len(t.train_dl)})")


if __name__ == '__main__':
    main()
