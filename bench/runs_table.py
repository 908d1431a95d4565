"""How long `runs()` takes over 200 run directories, and how big a record is.

One real fit of 2000 steps (its record holds 500 per-step points, the most a record keeps by default) is copied into
200 run directories, each with another LR in its config; `runs()` reads them all (best of 3), then `compare()` draws
them (the best 6). Run: `python bench/runs_table.py [N]`.
"""
import json, sys, tempfile, time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.runs import RECORD, RunRecorder, compare, runs


def main(n: int = 200):
    torch.manual_seed(0)
    x = torch.randn(2000, 8)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    tmp = Path(tempfile.mkdtemp())
    t = Trainer(torch.nn.Linear(8, 1), DataLoader(ds, batch_size=10), DataLoader(ds, batch_size=500),
                loss_func=F.mse_loss, lr=0.01, cpu=True, hooks=[Recorder(), RunRecorder(tmp / 'proto')],
                default_hooks=False)
    t.fit(10)
    text = (tmp / 'proto' / RECORD).read_text()
    rec = json.loads(text)
    print(f"a record of {rec['steps']} steps, {len(rec['epochs'])} epochs: {len(text)} bytes, "
          f"{len(rec['series']['step'])} per-step points, {len(rec['clock'])} clock points")
    runs_dir = tmp / 'runs'
    for i in range(n):
        d = runs_dir / f'run{i:03d}'
        d.mkdir(parents=True)
        r = dict(rec, name=d.name, start=rec['start'] + i, config={**rec['config'], 'lr': 10 ** -(1 + i % 4)})
        (d / RECORD).write_text(json.dumps(r))
    best = float('inf')
    for _ in range(3):
        t0 = time.perf_counter()
        df = runs(runs_dir, kernel=False)
        best = min(best, time.perf_counter() - t0)
    t0 = time.perf_counter()
    compare(df).save(tmp / 'cmp.png')
    print(f"runs() of {len(df)} runs: {best:.3f} s (best of 3); compare() of them, drawn and saved: "
          f"{time.perf_counter() - t0:.2f} s")


if __name__ == '__main__':
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
