"""How good is lr_find's default pick? Train with it, and with a grid of LRs, and compare validation losses; and the same
for fastai's lr_find valley, on the same problems, where fastai is importable.

Problems (all data made here or bundled with scikit-learn, no download; a fixed train/valid split each):
  CNN, MLP   scikit-learn's digits (8x8 images, pixels / 16), a small CNN and an MLP, batch 64
  noisyreg   a noisy nonlinear regression: 512 samples, batch 16, MSE
  shuffled   a 3-class Gaussian-mixture classifier: 512 samples, batch 32, shuffled, dropout
  shortdl    a classifier whose loader has 4 batches (128 samples, batch 32): the sweep cycles through it ~25 times
  batchnorm  an MLP with BatchNorm on two interleaved moons with noise features, batch 32
  gru        a GRU reading 20 symbols of 4 kinds and telling which of two kinds is more frequent, batch 32
  batch8     a small MLP on a 4-class tabular problem, batch 8
One sweep (seed 0, lr_find's defaults) gives the default pick (`result.apply()`'s LR: the valley, or the fallback when
the sweep is not reliable). Each LR (the pick, each LR of a 10-point log grid from 1e-4 to 1, fastai's valley) is scored
the same way: train for the problem's few epochs with a one-cycle schedule peaking at that LR, once per seed in SEEDS
(the seed sets the initial weights, the shuffling and dropout; the same seeds for every LR), and take the mean of the
final validation losses (inf if a run diverged). Per problem:
    NAME: suggestion loss L, best grid loss G, ratio R        (R = L / G, lower is better)
    NAME: fastai ratio F                                       (fastai's valley scored the same way, / G)
with details on indented lines (the sweep, the grid, every suggestion, the seed-to-seed spread: the ratios are only as
precise as that). For the digits models also the sweep's time as a fraction of one training epoch (training only; each
the fastest of REPEATS runs, on one thread).

    .venv/bin/python bench/lr_find_quality.py               # ours only
    .venv-fastai/bin/python bench/lr_find_quality.py        # ours and fastai's side by side

fastai's fastcore conflicts with nbdev 2's pins, so fastai lives in a second virtual environment (git-ignored), with
the same CPU torch and trainer_nb; fastai's lr_find needs neither torchvision nor spacy, so they are left out:
    python3 -m venv .venv-fastai && .venv-fastai/bin/pip install torch==2.13.0 -e . scikit-learn fastcore \
        fasttransform fastprogress fastdownload plum-dispatch scipy pyyaml pillow cloudpickle requests packaging
    .venv-fastai/bin/pip install --no-deps fastai
"""
import importlib.util, math, sys, tempfile, time, warnings
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits, make_moons

from trainer_nb.core import Trainer

SEEDS = (0, 1, 2)
THREADS = 2   # for training
REPEATS = 3   # timings: the fastest of this many runs (the machine may be busy with other work)
GRID = np.logspace(-4, 0, 10)
HAS_FASTAI = importlib.util.find_spec('fastai') is not None


def split(X, y, n_train, seed=42):
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    tr, va = perm[:n_train], perm[n_train:]
    return TensorDataset(X[tr], y[tr]), TensorDataset(X[va], y[va])


def digits():
    X, y = load_digits(return_X_y=True)
    return split(torch.tensor(X / 16, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(y), 1400)


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def noisyreg():
    g = torch.Generator().manual_seed(11)
    X = torch.randn(768, 6, generator=g)
    y = X[:, :1] * X[:, 1:2] + torch.sin(2 * X[:, 2:3]) + 0.5 * X[:, 3:4] + 0.5 * torch.randn(768, 1, generator=g)
    return split(X, y, 512)


def shuffled():
    g = torch.Generator().manual_seed(12)
    centres = 1.2 * torch.randn(6, 10, generator=g)
    k = torch.randint(0, 6, (768,), generator=g)
    return split(centres[k] + torch.randn(768, 10, generator=g), k % 3, 512)


def shortdl():
    g = torch.Generator().manual_seed(13)
    X = torch.randn(640, 6, generator=g)
    y = ((X[:, 0] * X[:, 1] > 0) ^ (X[:, 2] > 0.5)).long()
    return split(X, y, 128)


def moons():
    X, y = make_moons(800, noise=0.25, random_state=14)
    noise = np.random.default_rng(14).normal(size=(800, 8))
    return split(torch.tensor(np.c_[X, noise], dtype=torch.float32), torch.tensor(y), 600)


def symbols():
    g = torch.Generator().manual_seed(15)
    s = torch.randint(0, 4, (1200, 20), generator=g)
    y = ((s == 0).sum(1) > (s == 1).sum(1)).long()
    return split(F.one_hot(s, 4).float(), y, 900)


def tabular4():
    g = torch.Generator().manual_seed(16)
    X = torch.randn(600, 12, generator=g)
    W = torch.randn(12, 4, generator=g)
    y = (X @ W + 0.8 * torch.randn(600, 4, generator=g)).argmax(1)
    return split(X, y, 400)


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 32, batch_first=True), nn.Linear(32, 2)
    def forward(self, x): return self.head(self.rnn(x)[0][:, -1])


# name: (data, model, loss, batch size, epochs)
PROBLEMS = {
    'CNN': (digits, cnn, F.cross_entropy, 64, 5),
    'MLP': (digits, mlp, F.cross_entropy, 64, 5),
    'noisyreg': (noisyreg, lambda: nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1)), F.mse_loss, 16, 5),
    'shuffled': (shuffled, lambda: nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3)),
                 F.cross_entropy, 32, 5),
    'shortdl': (shortdl, lambda: nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 2)), F.cross_entropy, 32, 10),
    'batchnorm': (moons, lambda: nn.Sequential(nn.Linear(10, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
                                               nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2)), F.cross_entropy, 32, 5),
    'gru': (symbols, GRUNet, F.cross_entropy, 32, 5),
    'batch8': (tabular4, lambda: nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)), F.cross_entropy, 8, 3),
}


def loaders(train_ds, valid_ds, bs, seed):
    dl = DataLoader(train_ds, batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return dl, None if valid_ds is None else DataLoader(valid_ds, batch_size=256)


def trainer(p, lr, seed, valid=True):
    "A fresh trainer: weights, shuffling and dropout from `seed`; no validation when `valid` is False."
    (train_ds, valid_ds), make, loss, bs, _ = p
    torch.manual_seed(seed)
    model = make()
    return Trainer(model, *loaders(train_ds, valid_ds if valid else None, bs, seed), loss_func=loss, lr=lr,
                   default_hooks=False, cpu=True)


def train(p, lr, seed):
    "Validation loss after the problem's epochs of one-cycle at max LR `lr` (inf if it diverged)."
    t = trainer(p, lr, seed)
    try: t.fit_one_cycle(p[4], lr_max=lr)
    except FloatingPointError: return math.inf
    v = t.evaluate()['valid_loss']
    return v if math.isfinite(v) else math.inf


def scorer(p):
    """`score(lr)`: the mean validation loss over SEEDS of the same training at `lr` (trained once per LR);
    `score.runs[lr]` holds the loss of each seed."""
    def score(lr):
        lr = float(lr)
        if lr not in score.runs: score.runs[lr] = [train(p, lr, s) for s in SEEDS]
        return float(np.mean(score.runs[lr]))
    score.runs = {}
    return score


def spread(runs) -> str:
    "The seed-to-seed standard deviation of `runs`, and the standard error of their mean."
    sd = float(np.std(runs, ddof=1))
    return f"sd {sd:.4f}, se of the mean {sd / math.sqrt(len(runs)):.4f}"


def fastai_valley(p) -> float:
    "fastai's lr_find valley for the same model (seed SEEDS[0]), data, loss and optimizer (AdamW)."
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper
    import fastai.callback.schedule  # noqa: F401  (adds Learner.lr_find)
    (train_ds, valid_ds), make, loss, bs, _ = p
    torch.manual_seed(SEEDS[0])
    model = make()
    dls = DataLoaders(*loaders(train_ds, valid_ds, bs, SEEDS[0]))   # plain torch DataLoaders: the model stays on the CPU
    with tempfile.TemporaryDirectory() as d:   # fastai saves the model there during its sweep
        learn = Learner(dls, model, loss_func=loss, opt_func=partial(OptimWrapper, opt=torch.optim.AdamW), path=d)
        with learn.no_bar(): return float(learn.lr_find(show_plot=False).valley)


def timed(f, *args, **kw):
    "`(f(*args, **kw), seconds)`."
    t0 = time.perf_counter()
    out = f(*args, **kw)
    return out, time.perf_counter() - t0


def sweep_time(p, res, name):
    "The sweep's time as a fraction of one training epoch (one thread, fastest of REPEATS)."
    torch.set_num_threads(1)
    t = trainer(p, 1e-3, SEEDS[0], valid=False)
    t.fit(1)   # warm-up: the first epoch pays one-time costs
    epoch = min(timed(t.fit, 1)[1] for _ in range(REPEATS))
    t = trainer(p, 1e-3, SEEDS[0], valid=False)
    runs = [timed(t.lr_find, show=False) for _ in range(REPEATS)]   # the same sweep each time: it leaves no trace
    assert all(r.suggestions == res.suggestions for r, _ in runs)
    sweep = min(dt for _, dt in runs)
    torch.set_num_threads(THREADS)
    print(f"{name}: sweep time {sweep:.2f}s = {sweep / epoch:.1f}x one training epoch ({epoch:.2f}s, training only, "
          f"fastest of {REPEATS}, 1 thread; the sweep took {len(res.lrs)} steps, an epoch has {len(t.train_dl)})")


def main(names):
    torch.set_num_threads(THREADS)
    warnings.filterwarnings('ignore')
    print(f"{len(names)} problems, one-cycle fits, grid {GRID[0]:.0e}..{GRID[-1]:.0e} ({len(GRID)} LRs), each LR scored by "
          f"the mean final valid loss over seeds {SEEDS}; fastai {'compared' if HAS_FASTAI else 'is not installed'}")
    for name in names:
        data, make, loss, bs, epochs = PROBLEMS[name]
        p = (data(), make, loss, bs, epochs)
        res = trainer(p, 1e-3, SEEDS[0], valid=False).lr_find(show=False)
        pick = res._lr(None)
        score = scorer(p)
        grid = [score(lr) for lr in GRID]
        G, best = min(grid), float(GRID[int(np.argmin(grid))])
        n = len(p[0][0])
        print(f"  {name}: {n} train samples, batch {bs}, {len(trainer(p, 1e-3, 0).train_dl)} batches, {epochs} epochs; "
              f"sweep {len(res.lrs)} steps from {res.lrs[0]:.0e} to {res.lrs[-1]:.2e}, stopped: {res.stop_reason}")
        print(f"  {name} verdict: {res.verdict}")
        print(f"  {name} grid: " + ' '.join(f"{lr:.2e}:{g:.4f}" for lr, g in zip(GRID, grid)))
        print(f"  {name} picks: " + ', '.join(f"{k} {v:.2e} -> {score(v):.4f} ({score(v) / G:.3f})"
                                            for k, v in res.choices.items()))
        L = score(pick)
        print(f"  {name} seed spread: pick {spread(score.runs[pick])}; best grid LR {best:.2e} {spread(score.runs[best])}")
        print(f"{name}: suggestion loss {L:.4f}, best grid loss {G:.4f}, ratio {L / G:.3f}", flush=True)
        if HAS_FASTAI:
            fv = fastai_valley(p)
            print(f"  {name} fastai valley {fv:.2e}: loss {score(fv):.4f}")
            print(f"{name}: fastai ratio {score(fv) / G:.3f}", flush=True)
        if name in ('CNN', 'MLP'): sweep_time(p, res, name)


if __name__ == '__main__':
    main(sys.argv[1:] or list(PROBLEMS))
