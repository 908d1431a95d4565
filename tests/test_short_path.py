"""The short path (`Loop._short_epoch`): a fit that needs nothing inside a batch but the model, the loss and the step
takes it, and ends bitwise where the general path (`_train_batch`) ends, in every case the short path handles itself
(schedules, hooks at the step and after the batch, a step cancelled, a model returning a dict, batches that are not
pairs, a non-finite loss). The general path is forced by a hook at `before_batch` that does nothing."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import flat, regression_ds, small_model
from trainer_nb.core import CancelBatch, Hook, Trainer
from trainer_nb.recorder import Recorder

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Inner(Hook):
    "A hook inside the batch (it does nothing): the fit takes the general path."
    def before_batch(self): pass


class Seen(Hook):
    "What hooks at the step and after the batch see: the loss, the predictions, the counters."
    keep_preds = True
    def __init__(self): self.rows = []
    def after_step(self):
        t = self.trainer
        self.rows.append(('step', t.state.step, t.state.iteration, t.loss.item(), t.preds.sum().item()))
    def after_batch(self):
        s = self.trainer.state
        self.rows.append(('batch', s.step, s.iteration, s.samples, s.opt_stepped, self.trainer.loss is None))


class CancelEvery3rd(Hook):
    "Cancels the step of every third batch (its gradients are dropped)."
    def before_step(self):
        if self.trainer.state.iteration % 3 == 0: raise CancelBatch()


class Dict(torch.nn.Module):
    "The small model, returning its output under 'logits' with a second entry."
    def __init__(self):
        super().__init__()
        self.net = small_model()
    def forward(self, x): return {'logits': self.net(x), 'aux': x.sum()}


class Two(torch.nn.Module):
    "The small model on `x * w`: two inputs."
    def __init__(self):
        super().__init__()
        self.net = small_model()
    def forward(self, x, w): return self.net(x * w)


def fit(short: bool, model=None, hooks=(), batches=None, method='fit_one_cycle', **kw):
    torch.manual_seed(0)
    dl = batches if batches is not None else DataLoader(regression_ds(), batch_size=8, shuffle=True)
    hooks = [*hooks, Recorder()] + ([] if short else [Inner()])
    t = Trainer(model or small_model(), dl, loss_func=kw.pop('loss_func', F.mse_loss), lr=1e-2, cpu=True,
                default_hooks=False, hooks=hooks, **kw)
    getattr(t, method)(2)
    assert t._plain.short is short   # the path each fit took
    return t


def same(a, b):
    assert torch.equal(flat(a.model), flat(b.model))
    assert torch.equal(a.losses.values, b.losses.values)
    assert a.state == b.state
    ra, rb = a.get_hook(Recorder), b.get_hook(Recorder)
    assert ra.steps.equals(rb.steps)


@pytest.mark.parametrize('case', ['one_cycle', 'constant', 'hooks', 'cancelled', 'dict', 'triples'])
def test_short_and_general_paths_end_bitwise_equal(case):
    kw = {}
    if case == 'constant': kw['method'] = 'fit'
    if case == 'hooks': kw['hooks'] = lambda: [Seen()]
    if case == 'cancelled': kw['hooks'] = lambda: [CancelEvery3rd()]
    if case == 'dict': kw.update(model=lambda: Dict(), preds_key='logits')
    if case == 'triples':   # (x, w, y): not a pair, so each batch goes to `_train_batch` from the short path too
        x, y = regression_ds().tensors
        kw.update(batches=[(x[i:i + 8], torch.full((8, 1), 0.5), y[i:i + 8]) for i in range(0, 48, 8)],
                  model=lambda: Two())
    make = lambda: {k: v() if callable(v) and k in ('hooks', 'model') else v for k, v in kw.items()}
    a, b = fit(True, **make()), fit(False, **make())
    same(a, b)
    if case == 'hooks': assert a.get_hook(Seen).rows == b.get_hook(Seen).rows and len(a.get_hook(Seen).rows) == 24
    if case == 'cancelled': assert a.state.step == b.state.step == 8 and a.state.iteration == 12


def test_a_non_finite_loss_stops_both_paths_at_the_same_batch():
    errors = []
    for short in (True, False):
        torch.manual_seed(0)
        ds = regression_ds()
        x, y = ds.tensors[0].clone(), ds.tensors[1].clone()
        y[20] = float('nan')   # in the third batch
        t = Trainer(small_model(), [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)], loss_func=F.mse_loss, lr=1e-2,
                    cpu=True, default_hooks=False, hooks=[] if short else [Inner()])
        with pytest.raises(FloatingPointError) as e: t.fit(1)
        assert t._plain.short is short and t.state.iteration == 2 and t.state.step == 2
        errors.append((str(e.value).split('(iteration')[0], flat(t.model)))
    assert errors[0][0] == errors[1][0] and torch.equal(errors[0][1], errors[1][1])


def test_what_takes_the_general_path():
    """Anything the short path does not do itself: accumulation, a train_step, a summing loss, skipping. The gradients'
    check it does (on by default on the CPU: 'raise_grads' is 'raise')."""
    def train_step(batch, trainer):
        x, y = batch
        return {'loss': F.mse_loss(trainer.model(x), y)}
    ds = DataLoader(regression_ds(), batch_size=8)
    for kw in ({'grad_accum': 2}, {'train_step': train_step, 'loss_func': None},
               {'loss_func': torch.nn.MSELoss(reduction='sum')}, {'nan_policy': 'skip'}):
        kw.setdefault('loss_func', F.mse_loss)
        t = Trainer(small_model(), ds, lr=1e-2, cpu=True, default_hooks=False, **kw)
        t.fit(1)
        assert not t._plain.short, kw
    t = Trainer(small_model(), ds, loss_func=F.mse_loss, lr=1e-2, cpu=True)   # the default hooks keep the short path
    t.fit(1)
    assert t._plain.short and t._plain.grads   # (the gradients checked there)
    t = Trainer(small_model(), ds, loss_func=F.mse_loss, lr=1e-2, cpu=True, nan_policy='raise_grads')
    t.fit(1)
    assert t._plain.short and t._plain.grads
