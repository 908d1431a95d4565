"""Checkpoint runs on two processes for `tests/test_checkpoint_dist.py`, under `accelerate launch` (gloo on the CPU).

Usage: `accelerate launch --multi_gpu --num_processes 2 ... tests/ckpt_dist_script.py CONFIG_JSON`, with the keys:
dir (run directory), out (each process writes `{out}_rank{R}.pt`), ckpt (add a Checkpoint hook), resume (None |
'last'), kill_at (every process SIGKILLs itself before training iteration N), es_divergent (after the fit, a second
fit whose EarlyStopping sees a different value on each process).

Each process records the files it writes in the run directory (Python's audit events: opening for writing, renames,
removals, directories made), so the test can tell which process wrote what.
"""
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.checkpoint import Checkpoint

from trainer_nb.monitor import EarlyStopping, MetricsLog
from trainer_nb.base import Hook
from trainer_nb.core import Trainer

EPOCHS, BATCH, N_TRAIN, N_VALID = 6, 8, 96, 40   # 96 / (2 x 8): 6 iterations per epoch
CONFIG = {'data': 'regression-96', 'dropout': 0.3}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
writes = []


def audit_writes(run_dir):
    "Record, as (event, path relative to `run_dir`), what this process writes under `run_dir`."
    root = os.path.realpath(run_dir) + os.sep
    def rel(p):
        if isinstance(p, int) or p is None: return None
        p = os.path.realpath(os.fsdecode(p))
        return p[len(root):] if p.startswith(root) else None
    def hook(event, args):
        if event == 'open' and args[2] & _WRITE: paths = [args[0]]
        elif event == 'os.mkdir' and not os.path.isdir(os.fsdecode(args[0])): paths = [args[0]]   # makedirs(exist_ok) tries
        elif event == 'os.rename': paths = [args[0], args[1]]
        elif event in ('os.remove', 'os.rmdir', 'shutil.rmtree', 'os.truncate'): paths = [args[0]]
        else: return
        for p in paths:
            r = rel(p)
            if r is not None: writes.append((event, r))
    sys.addaudithook(hook)


def make_data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 1, generator=g)
    xt, xv = torch.randn(N_TRAIN, 6, generator=g), torch.randn(N_VALID, 6, generator=g)
    return (TensorDataset(xt, xt @ w + 0.1 * torch.randn(N_TRAIN, 1, generator=g)),
            TensorDataset(xv, xv @ w + 0.1 * torch.randn(N_VALID, 1, generator=g)))


def make_trainer(hooks):
    torch.manual_seed(0)
    train_ds, valid_ds = make_data()
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(CONFIG['dropout']),
                                torch.nn.Linear(16, 1))
    return Trainer(model, DataLoader(train_ds, batch_size=BATCH, shuffle=True), DataLoader(valid_ds, batch_size=10),
                   loss_func=F.mse_loss, lr=1e-2, hooks=hooks, default_hooks=False)


class Kill(Hook):
    "SIGKILL this process before training iteration `at`."
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.trainer.state.iteration == self.at:
            print(f'KILL rank {self.trainer.accelerator.process_index} at iteration {self.at}', flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class RankScore(Hook):
    "An epoch result that differs between processes: it improves every epoch on process 1, never on process 0."
    order = 50   # before EarlyStopping (82)
    def after_epoch(self):
        t = self.trainer
        e = float(t.state.epoch)
        t.epoch_results['score'] = e if t.accelerator.process_index == 0 else -e


def divergent_early_stopping() -> dict:
    es = EarlyStopping('score', mode='min', patience=1)
    t = make_trainer([RankScore(), es])
    t.valid_dl = None
    t.fit(4)
    return {'epoch': t.state.epoch, 'cancelled': repr(t.cancelled), 'es': es.state_dict()}


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    audit_writes(cfg['dir'])
    es = EarlyStopping('valid_loss', patience=2, min_delta=100.)   # stops at the end of epoch 2 (3 epochs of 6)
    hooks = [MetricsLog(cfg['dir'], every_steps=2), es, Kill(cfg.get('kill_at'))]
    if cfg.get('ckpt', True): hooks.append(Checkpoint(cfg['dir'], every_steps=2, keep_last=2, config=CONFIG))
    t = make_trainer(hooks)
    t.fit(EPOCHS, resume=cfg.get('resume'))
    acc = t.accelerator
    res = {'rank': acc.process_index, 'num_processes': acc.num_processes,
           'weights': {k: v.detach().cpu().clone() for k, v in t.unwrapped_model.state_dict().items()},
           'state': t.state.state_dict(), 'cancelled': repr(t.cancelled), 'es': es.state_dict(),
           'writes': list(writes)}
    if cfg.get('es_divergent'): res['divergent'] = divergent_early_stopping()
    torch.save(res, f"{cfg['out']}_rank{acc.process_index}.pt")
    acc.wait_for_everyone()


if __name__ == '__main__':
    main()
