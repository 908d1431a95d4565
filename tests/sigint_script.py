"""Trains slowly until it gets SIGINT (Ctrl-C), which stops the fit after its batch, then reports and fits again.

`tests/test_loop.py` starts it, waits for the line `READY`, sends SIGINT, and reads the JSON line it prints.
"""
import json
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Hook, Trainer

SLOW = True


class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
    def forward(self, x):
        if SLOW: time.sleep(0.02)
        return self.lin(x)


class Events(Hook):
    def __init__(self): self.seen = []
    def after_batch(self):
        if self.trainer.state.iteration == 3: print('READY', flush=True)
    def after_cancel(self): self.seen.append(('after_cancel', type(self.trainer.cancelled).__name__))
    def after_fit(self): self.seen.append(('after_fit', self.trainer.fitting))


def main():
    global SLOW
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, also when this was started from a shell that ignores SIGINT
    # (a background job), whose children inherit the ignoring
    signal.signal(signal.SIGINT, signal.default_int_handler)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 4, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    ev = Events()
    t = Trainer(Slow(), DataLoader(ds, batch_size=2), loss_func=F.mse_loss, hooks=[ev], default_hooks=False)
    report = {}
    try:
        t.fit(1)          # 1000 batches of >= 20 ms: interrupted long before the end
        report['interrupted'] = False
    except KeyboardInterrupt as e:   # `FitStopped`: the first Ctrl-C stops the fit after its batch
        report.update(interrupted=True, resumable=getattr(e, 'resumable', None), message=str(e))
    report.update(losses_at_stop=len(t.losses),
                  handler_back=signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    report.update(events=list(ev.seen), fitting=t.fitting, iteration=t.state.iteration, epoch=t.state.epoch,
                  grads_cleared=all(p.grad is None for p in t.model.parameters()),
                  pending_losses=len(t.losses) - t.losses.n_host, model_works=bool(torch.isfinite(t.model(x[:3])).all()))
    SLOW = False
    ev.seen.clear()
    t.train_dl = DataLoader(TensorDataset(x[:64], x[:64].sum(1, keepdim=True)), batch_size=8)
    before = t.state.iteration
    t.fit(2)
    report.update(second_fit_batches=t.state.iteration - before, second_fit_events=list(ev.seen),
                  second_fit_epochs=t.state.epoch, weights_finite=all(bool(torch.isfinite(p).all()) for p in t.model.parameters()),
                  losses_logged=len(t.losses))
    print(json.dumps(report), flush=True)


if __name__ == '__main__':
    main()
