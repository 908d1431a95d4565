"""How good is lr_find's default pick? Train with it, and with a grid of LRs, and compare validation losses; the same
for fastai's lr_find valley rule (reimplemented here, on the same sweep: fastai itself is not needed).

Problems (all data made here or bundled with scikit-learn, no download; a fixed train/valid split each):
  CNN, MLP   scikit-learn's digits (8x8 images, pixels / 16), a small CNN and an MLP, batch 64
  noisyreg   a noisy nonlinear regression: 512 samples, batch 16, MSE
  shuffled   a 3-class Gaussian-mixture classifier: 512 samples, batch 32, shuffled, dropout
  shortdl    a classifier whose loader has 4 batches (128 samples, batch 32): the sweep cycles through it ~25 times
  batchnorm  an MLP with BatchNorm on two interleaved moons with noise features, batch 32
  gru        a GRU reading 20 symbols of 4 kinds and telling which of two kinds is more frequent, batch 32
  batch8     a small MLP on a 4-class tabular problem, batch 8
and, held out (written before the default pick was designed, not run while it was; reported apart):
  huber8     a 256-sample regression with heavy-tailed noise, a Huber loss, batch 8
  padgru     a GRU over padded sequences of 4 to 40 symbols, packed by length (`pack_padded_sequence`), batch 32
  finetune   a fine-tune: a body trained here on digits 0-4, a new head for digits 5-9 (300 samples, batch 16); three
             parameter groups: the first layer frozen, the second at a tenth of the head's LR
  dropout    an MLP with two dropout layers of 0.5 on a 5-class mixture, batch 32
and noisy small-batch regressions (added when lr_find's check went off by default, to watch its curve-only pick where
the sweep is too noisy to be reliable; reported apart): a nonlinear function of 6 inputs with Gaussian noise, MSE,
  noisy8     384 samples, noise sd 1.0, batch 8, an MLP of 64
  noisy4     256 samples, noise sd 0.7, batch 4, an MLP of 32
  noisy16    512 samples, noise sd 1.5, batch 16, an MLP of 64
and a generated family of twelve more (`--family`, run apart): batches of 4, 8, 16 against noise sd 0.5, 1, 1.5, 2.

One lr_find (weights seed 0, lr_find's defaults unless `--check`/`--runs` say otherwise, the trainer with its
validation loader as a user's would have) gives the default pick (`result.apply()`'s LR). Each LR (the pick, each LR of
a 10-point log grid from 1e-4 to 1, the valley of fastai's rule) is scored the same way: train for the problem's few
epochs with a one-cycle schedule peaking at that LR, once per seed in SEEDS (the seed sets the initial weights, the
shuffling and dropout; the same seeds for every LR), and take the mean of the final validation losses (inf if a run
diverged). Per problem:
    NAME: pick P loss L, best grid loss G, ratio R (over the sweeps' picks M, worst W); fastai valley V ratio F;
    spread S
R = L / G and F (fastai's rule scored the same way, / G): lower is better. S: the largest over the smallest default
pick of four lr_finds that differ only in the seed of the sweep's batches (0, 1, 2; `--sweep-seeds` for more) or in
the thread count (1, 2). The pick of each batch seed is trained too: the ratio's mean and worst over those picks say
what a user gets from the default over sweeps, not from one.
Details on indented lines: the sweep, the check's candidates and scores, the grid, every suggestion, the seed-to-seed
spread of the losses (the ratios are only as precise as that), and the cost of lr_find (sweep and check): its optimizer
steps (counted by a hook on the optimizer) against the sweep's own and as a fraction of one epoch, and its time against
one training epoch. The table at the end has it all.

fastai's rule: on the sweep's smoothed losses (fastai's sweep is the same: 1e-7 to 10 in 100 steps, a debiased EMA
with beta 0.98, a stop at 4x the best), without the first tenth and the last 5 points, the longest decreasing
subsequence, and the point a third plus a sixth of the way along it (`valley_fastai_rule`).

    .venv/bin/python bench/lr_find_quality.py                        # everything (about 5 minutes on a quiet core)
    .venv/bin/python bench/lr_find_quality.py --jobs 2               # two problems at a time (under 3 minutes)
    .venv/bin/python bench/lr_find_quality.py --jobs 2 --sweep-seeds 6   # the stability over six batch seeds
    .venv/bin/python bench/lr_find_quality.py --quick --problems batch8,huber8   # one seed, no stability sweeps
    .venv/bin/python bench/lr_find_quality.py --jobs 2 --sweep-seeds 6 --check 40 --runs 3   # with lr_find's check
    .venv/bin/python bench/lr_find_quality.py --jobs 2 --family       # the generated family of noisy regressions
"""
import argparse, contextlib, math, multiprocessing, sys, time, warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits, make_moons

from trainer_nb.core import Trainer

SEEDS = (0, 1, 2)
THREADS = 1   # for training (and the sweeps; the stability check also sweeps on 2)
REPEATS = 3   # timings: the fastest of this many runs (the machine may be busy with other work)
GRID = np.logspace(-4, 0, 10)


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


class PaddedGRU(nn.Module):
    "Symbols embedded, a GRU over the padded batch packed by length, the last real step's state to a head."
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(5, 16, padding_idx=0), nn.GRU(16, 32, batch_first=True), nn.Linear(32, 2)
    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(x), lengths.cpu(), batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][-1])


def padded():
    "Sequences of 4 symbols (1..4), 4 to 40 long, padded with 0; the label: more 1s than 2s."
    g = torch.Generator().manual_seed(17)
    n, L = 1200, 40
    lengths = torch.randint(4, L + 1, (n,), generator=g)
    s = torch.randint(1, 5, (n, L), generator=g) * (torch.arange(L) < lengths[:, None])
    y = ((s == 1).sum(1) > (s == 2).sum(1)).long()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(42))
    tr, va = perm[:900], perm[900:]
    return TensorDataset(s[tr], lengths[tr], y[tr]), TensorDataset(s[va], lengths[va], y[va])


def huber():
    "A 256-sample regression with heavy-tailed noise (Student t, 2 degrees of freedom), for a Huber loss at batch 8."
    g = torch.Generator().manual_seed(18)
    X = torch.randn(512, 5, generator=g)
    # from a seeded generator of its own (a torch distribution's sample() draws from the global one, and the data
    # would change with whatever ran before)
    noise = 0.3 * torch.from_numpy(np.random.default_rng(18).standard_t(2.0, size=(512, 1))).float()
    y = torch.tanh(X[:, :1] + X[:, 1:2]) + 0.5 * X[:, 2:3] * X[:, 3:4] + noise
    return split(X, y, 256)


class FineTune(nn.Module):
    "A body trained on another task (digits 0-4), a new head for digits 5-9."
    def __init__(self):
        super().__init__()
        self.body1 = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU())
        self.body2 = nn.Sequential(nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 5)
        self.body1.load_state_dict(PRETRAINED['body1'])
        self.body2.load_state_dict(PRETRAINED['body2'])
    def forward(self, x): return self.head(self.body2(self.body1(x)))


PRETRAINED = {}


def noisy_small(seed, n_train, sd):
    "A nonlinear regression of 6 inputs with Gaussian noise of `sd` (a third of the samples for validation)."
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_train // 2
    X = torch.randn(n, 6, generator=g)
    y = torch.sin(1.5 * X[:, :1]) + X[:, 1:2] * X[:, 2:3] - 0.5 * X[:, 3:4] + sd * torch.randn(n, 1, generator=g)
    return split(X, y, n_train)


def finetune_data():
    "Digits 5-9 (a few hundred, relabelled 0-4); the body is pretrained here, once, on digits 0-4."
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(y)
    if not PRETRAINED:
        torch.manual_seed(99)
        src = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 5))
        dl = DataLoader(TensorDataset(X[y < 5], y[y < 5]), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(99))
        Trainer(src, dl, loss_func=F.cross_entropy, lr=2e-3, default_hooks=False, cpu=True).fit_one_cycle(3)
        PRETRAINED['body1'] = nn.Sequential(*src[:3]).state_dict()
        PRETRAINED['body2'] = nn.Sequential(*src[3:5]).state_dict()
    m = y >= 5
    return split(X[m], y[m] - 5, 300)


def finetune_setup(t):
    "Three groups: the first layer frozen, the second at a tenth of the head's LR."
    t.split('body1', 'body2', 'head')
    t.freeze(0)


def dropout_data():
    g = torch.Generator().manual_seed(19)
    centres = 1.5 * torch.randn(5, 20, generator=g)
    k = torch.randint(0, 5, (900,), generator=g)
    return split(centres[k] + 1.5 * torch.randn(900, 20, generator=g), k, 600)


# name: (data, model, loss, batch size, epochs, setup, LR ratios of the parameter groups)
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
    # noisy small batches (added when the check went off by default): regressions whose per-batch losses scatter
    'noisy8': (lambda: noisy_small(20, 384, 1.0), lambda: nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1)),
               F.mse_loss, 8, 4),
    'noisy4': (lambda: noisy_small(21, 256, 0.7), lambda: nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1)),
               F.mse_loss, 4, 3),
    'noisy16': (lambda: noisy_small(22, 512, 1.5), lambda: nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1)),
                F.mse_loss, 16, 5),
    # held out: written before the default pick was designed, and not looked at while it was
    'huber8': (huber, lambda: nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 1)), F.huber_loss, 8, 4),
    'padgru': (padded, PaddedGRU, F.cross_entropy, 32, 5),
    'finetune': (finetune_data, FineTune, F.cross_entropy, 16, 4, finetune_setup, (0.1, 0.1, 1.0)),
    'dropout': (dropout_data, lambda: nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 128),
                                                    nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 5)), F.cross_entropy, 32, 5),
}
HELD_OUT = ('huber8', 'padgru', 'finetune', 'dropout')
NOISY = ('noisy8', 'noisy4', 'noisy16')   # added with the check off by default: reported apart
# a family of noisy small-batch regressions, generated (defined before it was run, and not used to make the rules):
# batches of 4, 8 and 16 against noise sd 0.5, 1, 1.5 and 2, each its own data (seeds 30-41), 384 samples, an MLP of
# 64, 4 epochs; `--family` runs these (and only these)
FAMILY = {f'fam{bs}-{sd:g}': ((lambda seed=30 + i, sd=sd: noisy_small(seed, 384, sd)),
                              lambda: nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1)), F.mse_loss, bs, 4)
          for i, (bs, sd) in enumerate((bs, sd) for bs in (4, 8, 16) for sd in (0.5, 1.0, 1.5, 2.0))}
PROBLEMS.update(FAMILY)


def loaders(train_ds, valid_ds, bs, seed):
    dl = DataLoader(train_ds, batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return dl, None if valid_ds is None else DataLoader(valid_ds, batch_size=256)


def trainer(p, lr, seed, valid=True, batch_seed=None):
    """A fresh trainer: weights, shuffling and dropout from `seed` (the shuffling from `batch_seed` when given); no
    validation when `valid` is False; the problem's parameter groups, each at its ratio of `lr`."""
    (train_ds, valid_ds), make, loss, bs = p[:4]
    torch.manual_seed(seed)
    model = make()
    dl, vdl = loaders(train_ds, valid_ds if valid else None, bs, seed if batch_seed is None else batch_seed)
    t = Trainer(model, dl, vdl, loss_func=loss, lr=lr, default_hooks=False, cpu=True)
    if len(p) > 5:
        p[5](t)
        t.lr = [lr * r for r in p[6]]
    return t


def train(p, lr, seed):
    "Validation loss after the problem's epochs of one-cycle at max LR `lr` (inf if it diverged)."
    t = trainer(p, lr, seed)
    try: t.fit_one_cycle(p[4], lr_max=t.lr)
    except FloatingPointError: return math.inf
    v = t.evaluate()['valid_loss']
    return v if math.isfinite(v) else math.inf


def scorer(p, seeds):
    """`score(lr)`: the mean validation loss over `seeds` of the same training at `lr` (trained once per LR);
    `score.runs[lr]` holds the loss of each seed."""
    def score(lr):
        lr = float(lr)
        if lr not in score.runs: score.runs[lr] = [train(p, lr, s) for s in seeds]
        return float(np.mean(score.runs[lr]))
    score.runs = {}
    return score


def spread(runs) -> str:
    "The seed-to-seed standard deviation of `runs`, and the standard error of their mean."
    if len(runs) < 2: return "one seed"
    sd = float(np.std(runs, ddof=1))
    return f"sd {sd:.4f}, se of the mean {sd / math.sqrt(len(runs)):.4f}"


def valley_fastai_rule(res, num_it=100) -> float:
    """fastai's lr_find valley, reimplemented here from its published description, on the same sweep (fastai's sweep
    is the same: 1e-7 to 10 over 100 steps, a debiased EMA with beta 0.98, a stop at 4x the best): drop the first
    tenth and the last 5 points of the smoothed curve; find the longest strictly decreasing run of points (not
    necessarily adjacent: the longest decreasing subsequence); take the point a third plus a sixth of the way along
    it (from its first point to its last)."""
    lrs = np.asarray(res.lrs, float)[num_it // 10:-5]
    y = np.asarray(res.losses, float)[num_it // 10:-5]
    keep = np.isfinite(y)
    lrs, y = lrs[keep], y[keep]
    if len(y) < 2: return float(res.lrs[0])
    run = np.ones(len(y), dtype=int)   # run[i]: the longest decreasing subsequence ending at i
    for i in range(1, len(y)):
        before = run[:i][y[:i] > y[i]]
        if len(before): run[i] = before.max() + 1
    end = int(np.argmax(run))
    start = end - int(run[end])
    third = (end - start) / 3
    return float(lrs[start + int(third) + int(third / 2)])


def timed(f, *args, **kw):
    "`(f(*args, **kw), seconds)`."
    t0 = time.perf_counter()
    out = f(*args, **kw)
    return out, time.perf_counter() - t0


def pick_of(p, lf, batch_seed=0, threads=THREADS):
    """The default pick of one lr_find (`lf`: its arguments; weights from SEEDS[0], the sweep's batches from
    `batch_seed`)."""
    torch.set_num_threads(threads)
    try: return trainer(p, 1e-3, SEEDS[0], batch_seed=batch_seed).lr_find(show=False, **lf)._lr(None)
    finally: torch.set_num_threads(THREADS)


def run(name, seeds, stable, lf):
    "`(printed lines, table row)` for one problem (a failure is printed, and its row is None)."
    try: return run1(name, seeds, stable, lf)
    except Exception as e:   # one problem's failure should not hide the others' results
        import traceback
        return [f"{name}: FAILED: {e!r}", traceback.format_exc()], None


def run_args(a): return run(*a)


def run1(name, seeds, stable, lf):
    torch.set_num_threads(THREADS)
    warnings.filterwarnings('ignore')
    out = []
    say = out.append
    spec = PROBLEMS[name]
    p = (spec[0](), *spec[1:])
    t = trainer(p, 1e-3, SEEDS[0])   # with its validation loader, as a user's trainer: the check scores on it
    steps = []   # every optimizer step lr_find takes, sweep and check
    t.opt.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    res, took = timed(t.lr_find, show=False, **lf)
    pick = res._lr(None)
    epoch = timed(trainer(p, 1e-3, SEEDS[0], valid=False).fit, 1)[1]
    nb = len(t.train_dl)
    steps_check = len(steps) - len(res.lrs)
    score = scorer(p, seeds)
    grid = [score(lr) for lr in GRID]
    G, best = min(grid), float(GRID[int(np.argmin(grid))])
    say(f"  {name}: {len(p[0][0])} train samples, batch {p[3]}, {nb} batches, {p[4]} epochs; "
        f"sweep {len(res.lrs)} steps from {res.lrs[0]:.0e} to {res.lrs[-1]:.2e}, stopped: {res.stop_reason}")
    say(f"  {name} verdict: {res.verdict}")
    say(f"  {name} check (valid loss after {lf.get('check', 'its default')} steps): "
        + ' '.join(f"{lr:.2e}:{v:.4f}" for lr, v in sorted(res.check.items()))
        + (f"; within 10% of the best: {res.level[0]:.2e} to {res.level[1]:.2e}" if res.level else ''))
    say(f"  {name} grid: " + ' '.join(f"{lr:.2e}:{g:.4f}" for lr, g in zip(GRID, grid)))
    say(f"  {name} picks: " + ', '.join(f"{k} {v:.2e} -> {score(v):.4f} ({score(v) / G:.3f})"
                                      for k, v in res.choices.items()))
    L = score(pick)
    fv = valley_fastai_rule(res)
    F_ = score(fv) / G
    say(f"  {name} seed spread: pick {spread(score.runs[pick])}; best grid LR {best:.2e} {spread(score.runs[best])}")
    say(f"  {name} cost: the sweep {len(res.lrs)} + the check {steps_check} steps (+ {sum(map(len, res.check_runs.values())) + 1} evaluations) = "
        f"{(len(res.lrs) + steps_check) / nb:.1f} epochs of steps ({steps_check / nb:.1f} for the check); lr_find took "
        f"{took:.1f}s, one training epoch {epoch:.2f}s: {took / epoch:.1f}x")
    sp, over = math.nan, (math.nan, math.nan)
    if stable:   # `stable`: how many batch seeds (0, 1, ...), beside seed 0 on 2 threads
        seeded = [pick] + [pick_of(p, lf, s) for s in range(1, stable)]   # one pick per batch seed
        picks = {'seed0 1thr': pick, **{f'seed{s}': v for s, v in enumerate(seeded) if s},
                 'seed0 2thr': pick_of(p, lf, 0, 2)}
        sp = max(picks.values()) / min(picks.values())
        say(f"  {name} stability: " + ', '.join(f"{k} {v:.2e}" for k, v in picks.items()) + f": spread {sp:.2f}x")
        rs = [score(v) / G for v in seeded]
        over = (float(np.mean(rs)), max(rs))
        say(f"  {name} each batch seed's pick trained: " + ' '.join(f"{v:.2e}:{r:.3f}" for v, r in zip(seeded, rs))
            + f"; ratio mean {over[0]:.3f}, worst {over[1]:.3f}")
    say(f"{name}: pick {pick:.2e} loss {L:.4f}, best grid loss {G:.4f}, ratio {L / G:.3f}"
        + (f" (over the sweeps' picks {over[0]:.3f}, worst {over[1]:.3f})" if stable else '')
        + f"; fastai valley {fv:.2e} ratio {F_:.3f}" + (f"; spread {sp:.2f}x" if stable else ''))
    return out, (L / G, *over, F_, sp, len(steps) / len(res.lrs), len(steps) / nb, steps_check / nb, took / epoch)


def main(names, seeds, stable, jobs, lf):
    print(f"{len(names)} problems, one-cycle fits, grid {GRID[0]:.0e}..{GRID[-1]:.0e} ({len(GRID)} LRs), each LR scored "
          f"by the mean final valid loss over seeds {seeds}; 'fastai' is fastai's valley rule, reimplemented here, on "
          f"the same sweep; {jobs} problem(s) at a time; lr_find({', '.join(f'{k}={v}' for k, v in lf.items())})",
          flush=True)
    t0 = time.perf_counter()
    args = [(n, seeds, stable, lf) for n in names]
    rows = {}
    with multiprocessing.get_context('spawn').Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        results = pool.imap(run_args, args) if jobs > 1 else map(run_args, args)
        for n, (lines, row) in zip(names, results):   # in order, each as soon as it is done
            print('\n'.join(lines), flush=True)
            if row is not None: rows[n] = row
    seeds_ = f"batch seeds 0-{stable - 1}"
    over_, spread_ = ((f"ratio over the picks of {seeds_}: mean", f"pick spread ({seeds_}, 1 vs 2 threads)") if stable
                      else ("ratio over orders (not run: --quick)", "pick spread (not run: --quick)"))
    print(f"\n| problem | ratio | {over_} | worst | fastai valley | {spread_} | lr_find's steps / the sweep's | "
          "lr_find cost in epochs of steps (sweep + check) | the check alone | lr_find time / epoch time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for part, keep in (("designed on", lambda n: n not in HELD_OUT + NOISY and n not in FAMILY),
                       ("held out", lambda n: n in HELD_OUT), ("noisy small batch", lambda n: n in NOISY),
                       ("noisy family", lambda n: n in FAMILY)):
        for n, (r, rm, rw, f, sp, x, c, cc, tt) in rows.items():
            if not keep(n): continue
            m = (f"{rm:.3f} | {rw:.3f} | {f:.3f} | {sp:.2f}x" if stable else f"- | - | {f:.3f} | -")   # - : not run
            print(f"| {n} ({part}) | {r:.3f} | {m} | {x:.1f}x | {c:.1f} | {cc:.1f} | {tt:.1f}x |")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--problems', default=','.join(n for n in PROBLEMS if n not in FAMILY),
                    help='comma-separated names (default: all but the family)')
    ap.add_argument('--family', action='store_true', help='the generated family of noisy small-batch regressions')
    ap.add_argument('--quick', action='store_true', help='one seed per LR, no stability sweeps')
    ap.add_argument('--jobs', type=int, default=1, help='problems run side by side (processes)')
    ap.add_argument('--sweep-seeds', type=int, default=3, help="the stability: lr_finds with the sweep's batches from "
                    "seeds 0 to this - 1 (and seed 0 on 2 threads)")
    ap.add_argument('--check', type=int, default=None, help="lr_find's check (steps per trial; 0: none; default: "
                    "lr_find's default)")
    ap.add_argument('--runs', type=int, default=None, help="lr_find's runs of each candidate of the check (default: "
                    "lr_find's default)")
    a = ap.parse_args()
    names = list(FAMILY) if a.family else [n for n in a.problems.split(',') if n]
    unknown = [n for n in names if n not in PROBLEMS]
    if unknown: sys.exit(f"unknown problems {unknown}: choose from {list(PROBLEMS)}")
    if a.sweep_seeds < 1: sys.exit("--sweep-seeds must be at least 1")
    lf = {k: v for k, v in (('check', a.check), ('runs', a.runs)) if v is not None}   # lr_find's arguments
    main(names, SEEDS[:1] if a.quick else SEEDS, 0 if a.quick else a.sweep_seeds, a.jobs, lf)
