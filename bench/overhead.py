"""Loop overhead: steps/s of a hand-written PyTorch loop vs the Trainer, on a tiny MLP on the CPU.

Run: `.venv/bin/python bench/overhead.py [--steps 1500] [--reps 7]`. Contenders run interleaved, best of N;
each line is `NAME: S steps/s, R x raw`.
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

CONTENDERS = {'raw loop': raw_loop, 'trainer (no hooks)': trainer_no_hooks}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--steps', type=int, default=1500)
    ap.add_argument('--reps', type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for f in CONTENDERS.values(): f(100)   # warm up
    best = {n: 0.0 for n in CONTENDERS}
    for _ in range(a.reps):
        for n, f in CONTENDERS.items(): best[n] = max(best[n], f(a.steps))
    for n, v in best.items(): print(f"{n}: {v:.0f} steps/s, {v / best['raw loop']:.3f} x raw")

if __name__ == '__main__': main()
