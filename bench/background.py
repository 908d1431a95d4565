"""A fit in the background against the same fit in the foreground, on the CPU, with the notebook idle: steps/s of each
and their ratio, interleaved; then, while a background fit trains, how long the main thread (the kernel's, which
answers the user's cells) waits to run a trivial piece of Python.

Run: `.venv/bin/python bench/background.py [--steps 3000] [--reps 5] [--threads N] [--hidden 256] [--bs 64] [--busy K]`. Each repetition runs the two
contenders in turn, starting with the other one each time; the lines give the median and the range of the ratio.
`--threads` sets torch's intra-op threads (default: torch's own choice, the number of cores) for both contenders;
`--busy K` runs K CPU-bound processes beside the whole measurement (a loaded machine). The
browser's view of the same (a trivial cell's round trip while a background fit trains, from JupyterLab and Notebook 7)
is printed by `tests/test_browser_background.py -s`.
"""
import argparse, contextlib, statistics, subprocess, sys, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Trainer

warnings.filterwarnings('ignore')


def trainer(steps, bs=64, hidden=256):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(steps * bs, 64, generator=g), torch.randint(0, 10, (steps * bs,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return Trainer(model, DataLoader(ds, batch_size=bs), loss_func=F.cross_entropy, default_hooks=False)


def fit_rate(steps, background, **kw):
    t = trainer(steps, **kw)
    t0 = time.perf_counter()
    if background:
        t.fit(1, lr=1e-2, background=True)
        t.wait()
    else: t.fit(1, lr=1e-2)
    return steps / (time.perf_counter() - t0)


def main_thread_waits(steps, n=200, every=0.01):
    """Seconds the main thread waits, past a sleep of `every` s, to run Python again (the interpreter's lock, which the
    fit's thread holds while it runs Python) beside a background fit, `n` times."""
    t = trainer(steps)
    t.fit(1, lr=1e-2, background=True)
    waits = []
    while t.running and len(waits) < n:
        a = time.perf_counter()
        time.sleep(every)
        waits.append(time.perf_counter() - a - every)
    t.wait()
    return waits


@contextlib.contextmanager
def busy(k):
    "`k` CPU-bound processes for the block's length."
    procs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(k)]
    try: yield
    finally:
        for p in procs: p.kill()
        for p in procs: p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=3000)
    ap.add_argument('--reps', type=int, default=5)
    ap.add_argument('--threads', type=int, default=None)
    ap.add_argument('--hidden', type=int, default=256)
    ap.add_argument('--bs', type=int, default=64)
    ap.add_argument('--busy', type=int, default=0)
    a = ap.parse_args()
    with busy(a.busy): measure(a)


def measure(a):
    if a.threads: torch.set_num_threads(a.threads)
    print(f"torch threads: {torch.get_num_threads()}, {a.steps} steps a fit of an MLP 64-{a.hidden}-10, batches of {a.bs}, "
          f"{a.reps} repetitions" + (f", beside {a.busy} CPU-bound processes" if a.busy else ""))
    fit_rate(300, False), fit_rate(300, True)   # warm-up
    ratios, fg, bg = [], [], []
    for r in range(a.reps):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {b: fit_rate(a.steps, b, hidden=a.hidden, bs=a.bs) for b in order}
        fg.append(got[False]); bg.append(got[True]); ratios.append(got[True] / got[False])
    print(f"foreground: {statistics.median(fg):.0f} steps/s, background: {statistics.median(bg):.0f} steps/s")
    print(f"background / foreground: median {statistics.median(ratios):.3f}x (range {min(ratios):.3f}-{max(ratios):.3f})")
    w = sorted(main_thread_waits(a.steps))
    print(f"main thread's wait to run a line beside the fit: median {1e3 * statistics.median(w):.2f} ms, "
          f"p95 {1e3 * w[int(0.95 * len(w)) - 1]:.2f} ms, max {1e3 * w[-1]:.2f} ms ({len(w)} samples)")


if __name__ == '__main__':
    main()
