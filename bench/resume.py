"""How long a resume takes to reach its first trained batch, and whether that depends on where the run was killed.

A dataset whose `__getitem__` costs 1 ms, 10,000 batches an epoch (batch size 1, shuffled). A run saves a checkpoint
after batch K and is killed there with SIGKILL (a real kill, in a subprocess), for K at 10% and at 90% of the epoch.
A fresh process then builds the same trainer and calls `fit(resume='last')`; the time from that call to the end of
the first trained batch is T, and the time spent in `__getitem__` meanwhile is U. For each K it prints

    resume to first batch: T s (loading the skipped batches: U s)   [killed at batch K, batches skipped by index]

and the same with `Checkpoint(replay_batches=True)`, which loads and discards the batches done (exact also for random
augmentation done while loading, at that cost). Target: T under 1 s with the default, whatever K.

    .venv/bin/python bench/resume.py [--batches 10000]
"""
import argparse, json, os, signal, subprocess, sys, tempfile, time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    "`n` samples, each costing 1 ms to load; `load_time` adds up the time spent loading."
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.load_time = torch.randn(n, 8, generator=g), 0.0
        self.y = self.x.sum(1, keepdim=True)
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        t = time.perf_counter()
        while time.perf_counter() - t < 1e-3: pass   # 1 ms of work (a sleep would return late on a busy machine)
        self.load_time += time.perf_counter() - t
        return self.x[i], self.y[i]


def trainer(n, run, hooks=(), **ck):
    from trainer_nb.core import Trainer
    from trainer_nb.checkpoint import Checkpoint
    torch.manual_seed(0)
    ds = Slow(n)
    dl = DataLoader(ds, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0))
    t = Trainer(torch.nn.Linear(8, 1), dl, loss_func=F.mse_loss, lr=1e-3, cpu=True, default_hooks=False,
                hooks=[Checkpoint(run, at_epoch_end=False, keep_last=1, monitor=None, **ck), *hooks])
    return t, ds


def killed_run(n, run, at):
    "Train, save after batch `at`, and die there by SIGKILL."
    from trainer_nb.base import Hook
    class Kill(Hook):
        order = 100   # after the Checkpoint has saved this step
        def after_batch(self):
            if self.trainer.state.iteration == at: os.kill(os.getpid(), signal.SIGKILL)
    t, _ = trainer(n, run, [Kill()], every_steps=at)
    t.fit(1)


def resumed_run(n, run, replay):
    "Resume, and time the way to the end of the first trained batch."
    from trainer_nb.base import CancelFit, Hook
    class First(Hook):
        def after_batch(self):
            self.t = time.perf_counter()
            raise CancelFit()
    first = First()
    t, ds = trainer(n, run, [first], replay_batches=replay)
    start = time.perf_counter()
    t.fit(1, resume='last')
    print(json.dumps({'T': first.t - start, 'U': ds.load_time, 'batch': t.state.batch}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--batches', type=int, default=10_000)
    ap.add_argument('--phase', choices=['kill', 'resume', 'replay'], help=argparse.SUPPRESS)
    ap.add_argument('--run', help=argparse.SUPPRESS)
    ap.add_argument('--at', type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase == 'kill': return killed_run(a.batches, a.run, a.at)
    if a.phase: return resumed_run(a.batches, a.run, a.phase == 'replay')
    me = [sys.executable, __file__, '--batches', str(a.batches)]
    for at in (a.batches // 10, a.batches * 9 // 10):
        run = tempfile.mkdtemp(prefix='resume-bench-')
        p = subprocess.run(me + ['--phase', 'kill', '--run', run, '--at', str(at)])
        assert p.returncode == -signal.SIGKILL, p.returncode
        for phase, how in (('resume', 'batches skipped by index'), ('replay', 'replay_batches=True')):
            out = subprocess.run(me + ['--phase', phase, '--run', run], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            assert r['batch'] == at, r   # the first batch trained is the one after the kill
            print(f"resume to first batch: {r['T']:.2f} s (loading the skipped batches: {r['U']:.2f} s)   "
                  f"[killed at batch {at} of {a.batches}, {how}]", flush=True)


if __name__ == '__main__': main()
