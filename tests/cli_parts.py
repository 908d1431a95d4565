"""A user's own pieces for the command-line tests, found through a config's `imports: [cli_parts]`.

`regression_data` and `regression_model` make a small deterministic regression; `SaveWeights` writes each process's
final weights to `OUT/rank{R}.pt` (outside the run directory); `Pause` prints a marker at a given step and then
slows each step down, so that a test can send a signal to a fit that is surely running.
"""
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Hook
from trainer_nb.registry import register


@register('data')
def regression_data(n: int = 64, n_valid: int = 101, bs: int = 8, shuffle: bool = True):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 1, generator=g)
    xt, xv = torch.randn(n, 4, generator=g), torch.randn(n_valid, 4, generator=g)
    return (DataLoader(TensorDataset(xt, xt @ w + 0.1), batch_size=bs, shuffle=shuffle,
                       generator=torch.Generator().manual_seed(1)),
            DataLoader(TensorDataset(xv, xv @ w + 0.1), batch_size=10))


@register('model')
def regression_model(hidden: int = 8):
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


@register('metric')
def mae(preds, targets): return (preds - targets).abs().mean()


@register('hook')
class SaveWeights(Hook):
    "After the fit, save this process's weights, counters and run directory to `out/rank{R}.pt`."
    order = 95

    def __init__(self, out: str): self.out = Path(out)

    def after_fit(self):
        t = self.trainer
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({'rank': t.accelerator.process_index, 'num_processes': t.accelerator.num_processes,
                    'weights': {k: v.detach().cpu().clone() for k, v in t.unwrapped_model.state_dict().items()},
                    'state': t.state.state_dict(), 'run_dir': t.config['run_dir'], 'pid': os.getpid()},
                   self.out / f'rank{t.accelerator.process_index}.pt')


@register('hook')
class Pause(Hook):
    "Print `PAUSED <step>` once `at_step` optimizer steps are done, then sleep `sleep` seconds after every step."
    def __init__(self, at_step: int = 5, sleep: float = 0.2): self.at_step, self.sleep = at_step, sleep

    def after_batch(self):
        s = self.trainer.state
        if s.step == self.at_step and s.opt_stepped: print(f"PAUSED {s.step}", flush=True)
        if s.step >= self.at_step: time.sleep(self.sleep)
