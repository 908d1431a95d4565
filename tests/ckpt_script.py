"""A small training run for the checkpoint tests (`tests/test_checkpoint.py`), configured by one JSON argument.

Keys: dir (run directory), out (where to write the final weights and a JSON report), epochs, accum, sched
('none' | 'onecycle' | 'fit_one_cycle'), hidden (model width), every_steps, ckpt (add a Checkpoint hook), resume
(None | 'last' | a path), kill_at (SIGKILL itself before training iteration N), ready_at (print READY before
iteration N; ready_first: before the first batch this process trains), slow (seconds of sleep per batch).
"""
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.checkpoint import Checkpoint

from trainer_nb.monitor import MetricsLog, read_metrics
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.schedule import one_cycle


class Control(Hook):
    "Kills the process, or announces it is running, at a given iteration; sleeps per batch when asked."
    def __init__(self, cfg): self.cfg, self.seen, self.batches_run = cfg, [], 0
    def before_batch(self):
        it, c = self.trainer.state.iteration, self.cfg
        if it == c.get('ready_at') or (c.get('ready_first') and not self.batches_run): print('READY', it, flush=True)
        self.batches_run += 1
        if it == c.get('kill_at'): os.kill(os.getpid(), signal.SIGKILL)
        if c.get('slow'): time.sleep(c['slow'])
    def after_cancel(self): self.seen.append(['after_cancel', type(self.trainer.cancelled).__name__])
    def after_fit(self): self.seen.append(['after_fit', self.trainer.fitting])


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, h = 6, cfg.get('hidden', 16)
    x = torch.randn(96, d)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(96, 1)
    ds = TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(h, 1))
    ctl = Control(cfg)
    hooks = [Recorder(), MetricsLog(cfg['dir'], every_steps=2), ctl]
    if cfg.get('ckpt', True):
        hooks.append(Checkpoint(cfg['dir'], every_steps=cfg.get('every_steps', 3), keep_last=2, checksum=cfg.get('checksum', True)))
    sched = cfg.get('sched', 'none')
    t = Trainer(model, DataLoader(ds, batch_size=8, shuffle=True), DataLoader(ds, batch_size=32),
                loss_func=F.mse_loss, lr=1e-2, grad_accum=cfg.get('accum', 1), hooks=hooks, default_hooks=False,
                scheduler=one_cycle() if sched == 'onecycle' else None)
    report = {}
    try:
        if sched == 'fit_one_cycle': t.fit_one_cycle(cfg['epochs'], resume=cfg.get('resume'))
        else: t.fit(cfg['epochs'], resume=cfg.get('resume'))
    finally:
        report['events'], report['batches_run'] = ctl.seen, ctl.batches_run
        report['last'] = (lambda p: p and p.name)(t.get_hook(Checkpoint).last) if cfg.get('ckpt', True) else None
        print('REPORT', json.dumps(report), flush=True)
    rec = t.get_hook(Recorder)
    report.update(state=t.state.state_dict(), steps=rec.steps.to_dict('list'),
                  history=rec.history.drop(columns='time').to_dict('list'),
                  metrics=read_metrics(cfg['dir']).drop(columns='time').to_dict('list'))
    save_file({k: v.contiguous() for k, v in t.unwrapped_model.state_dict().items()}, cfg['out'] + '.safetensors')
    with open(cfg['out'] + '.json', 'w') as f: json.dump(report, f)


if __name__ == '__main__':
    main()
