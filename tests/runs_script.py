"""A small run with a run directory, for the records' tests (`tests/test_runs.py`), configured by one JSON argument.

Keys: dir (run directory), epochs, lr, resume (None | 'last'), kill_at (SIGKILL itself before training iteration N),
wait_at (print WAITING before iteration N, then wait for a line on stdin).
"""
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.base import Hook
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.monitor import MetricsLog
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.runs import RunRecorder


class Control(Hook):
    "Kills the process, or waits for a line on stdin, before a given iteration."
    def __init__(self, cfg): self.cfg = cfg
    def before_batch(self):
        it, c = self.trainer.state.iteration, self.cfg
        if it == c.get('kill_at'): os.kill(os.getpid(), signal.SIGKILL)
        if it == c.get('wait_at'):
            print('WAITING', it, flush=True)
            sys.stdin.readline()


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(96, 6)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    hooks = [Recorder(), MetricsLog(cfg['dir'], every_steps=2), Control(cfg), RunRecorder(),
             Checkpoint(cfg['dir'], every_steps=3, keep_last=2, config={'lr': cfg.get('lr', 0.01)})]
    t = Trainer(model, DataLoader(ds, batch_size=8, shuffle=True), DataLoader(ds, batch_size=32),
                loss_func=F.mse_loss, lr=cfg.get('lr', 0.01), hooks=hooks, default_hooks=False, cpu=True)
    t.fit(cfg['epochs'], resume=cfg.get('resume'))
    print('DONE', flush=True)


if __name__ == '__main__':
    main()
