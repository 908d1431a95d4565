"Bad input gets an error that says what to do; NaN losses; errors raised by metrics."
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import flat, regression_ds, small_model
from trainer_nb.core import Hook, Trainer

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Calls(Hook):
    def __init__(self): self.log = []
    def before_fit(self): self.log.append('before_fit')
    def after_fit(self): self.log.append('after_fit')


# ---- what train_step / loss_func return ----

@pytest.mark.parametrize('step,exc,match', [
    (lambda b, t: F.mse_loss(t.model(b[0]), b[1]), TypeError, r"must return a dict .*return \{'loss': loss\}"),
    (lambda b, t: {'preds': t.model(b[0])}, ValueError, r"no 'loss'.*return \{'loss': loss"),
    (lambda b, t: {'loss': F.mse_loss(t.model(b[0]), b[1]).item()}, TypeError, r"scalar torch.Tensor.*not loss.item\(\) or a float"),
    (lambda b, t: {'loss': F.mse_loss(t.model(b[0]), b[1], reduction='none')}, ValueError, r"must be a scalar, got shape \(4, 1\).*\.mean\(\)"),
], ids=['not-a-dict', 'no-loss', 'float-loss', 'non-scalar-loss'])
def test_bad_train_step_output(make_trainer, step, exc, match):
    calls = Calls()
    t = make_trainer(n=8, bs=4, loss_func=None, train_step=step, hooks=[calls])
    w0 = flat(t.model)
    with pytest.raises(exc, match=match):
        t.fit(1)
    assert torch.equal(flat(t.model), w0)                 # no optimizer step happened
    assert calls.log == ['before_fit', 'after_fit'] and not t.fitting


def test_non_scalar_loss_func(make_trainer):
    t = make_trainer(n=8, bs=4, loss_func=lambda p, y: (p - y) ** 2)
    with pytest.raises(ValueError, match=r"loss_func's result must be a scalar.*\.mean\(\)"):
        t.fit(1)


def test_model_output_without_loss(make_trainer):
    "Dict batches with no loss_func: the model must return a loss."
    class M(torch.nn.Module):
        def __init__(self): super().__init__(); self.lin = torch.nn.Linear(5, 1)
        def forward(self, x, y): return {'logits': self.lin(x)}
    ds = [{'x': x, 'y': y} for x, y in regression_ds(8)]
    with warnings.catch_warnings():   # a normal setup (the Hugging Face way): no warning at construction
        warnings.simplefilter('error')
        t = Trainer(M(), DataLoader(ds, batch_size=4), default_hooks=False)
    with pytest.raises(ValueError, match=r"needs a `.loss`.*loss_func= or train_step="):
        t.fit(1)


def test_batch_that_cannot_be_split(make_trainer):
    t = Trainer(small_model(), DataLoader(list(range(8)), batch_size=4, collate_fn=lambda b: set(b)),
                loss_func=F.mse_loss, default_hooks=False)
    with pytest.raises(TypeError, match=r"Can't split the batch.*got a set.*train_step="):
        t.fit(1)


# ---- empty data ----

def test_empty_train_dataloader_fails_before_training():
    calls = Calls()
    empty = DataLoader(TensorDataset(torch.zeros(0, 5), torch.zeros(0, 1)), batch_size=4)
    t = Trainer(small_model(), empty, loss_func=F.mse_loss, hooks=[calls], default_hooks=False)
    with pytest.raises(ValueError, match='no batches'):
        t.fit(1)
    assert calls.log == [] and t.state.iteration == 0
    dropped = DataLoader(regression_ds(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match='drop_last'):
        Trainer(small_model(), dropped, loss_func=F.mse_loss, default_hooks=False).fit(1)


def test_no_train_dl():
    with pytest.raises(ValueError, match='No train_dl'):
        Trainer(small_model(), loss_func=F.mse_loss, default_hooks=False).fit(1)


def test_empty_eval_dataloader(make_trainer):
    t = make_trainer(n=8, bs=4)
    empty = DataLoader(TensorDataset(torch.zeros(0, 5), torch.zeros(0, 1)), batch_size=4)
    with pytest.raises(ValueError, match='no batches'):
        t.evaluate(empty)
    with pytest.raises(ValueError, match='no batches'):
        t.predict(empty)
    with pytest.raises(ValueError, match='No dataloader to evaluate'):
        t.evaluate()                                       # no valid_dl
    t.valid_dl = empty
    with pytest.raises(ValueError, match='no batches'):
        t.fit(1)


# ---- NaN ----

def _nan_ds(n=24, bad=13):
    x, y = regression_ds(n).tensors
    x = x.clone(); x[bad] = float('nan')
    return TensorDataset(x, y)


@pytest.mark.usefixtures('on_the_cpu')
def test_nan_loss_raises_naming_iteration():
    calls = Calls()
    t = Trainer(small_model(), DataLoader(_nan_ds(), batch_size=4), loss_func=F.mse_loss, hooks=[calls],
                default_hooks=False)
    assert t.nan_policy == 'raise'
    with pytest.raises(FloatingPointError) as info:
        t.fit(1)                                          # found at once on the CPU, before its backward pass
    msg = str(info.value)
    assert msg.startswith("Non-finite loss (nan) in epoch 1, batch 4 (iteration 3, step 3, LR 0.001).")
    assert "The batch itself holds non-finite inputs" in msg and "nan_policy='skip'" in msg
    assert "the weights and the optimizer are as they were before this batch" in msg
    assert "th batch" not in msg
    assert calls.log == ['before_fit', 'after_fit'] and not t.fitting


@pytest.mark.usefixtures('on_the_cpu')
def test_nan_loss_found_before_its_backward_pass():
    "On the CPU the NaN of batch 1 stops training before its backward pass: the batch isn't counted, nor stepped."
    t = Trainer(small_model(), DataLoader(_nan_ds(bad=5), batch_size=4), loss_func=F.mse_loss,
                sync_every=2, default_hooks=False)
    with pytest.raises(FloatingPointError, match=r"in epoch 1, batch 2 \(iteration 1, step 1, LR"):
        t.fit(1)
    assert (t.state.iteration, t.state.step) == (1, 1)


@pytest.mark.usefixtures('on_the_cpu')
def test_a_nan_loss_found_when_it_reaches_the_host_raises_the_same_error():
    """Where the loss is not checked at its batch (on a GPU, every `sync_every` batches; here manual optimization on
    the CPU, which takes that path), the NaN raises at the flush: a `NonFiniteError` too, naming its epoch, batch and
    iteration, with no module (its step has run)."""
    from trainer_nb.base import NonFiniteError
    def step(batch, t):
        loss = F.mse_loss(t.model(batch[0]), batch[1])
        t.backward(loss)
        t.step()
        return {'loss': loss.detach()}
    t = Trainer(small_model(), DataLoader(_nan_ds(), batch_size=4), train_step=step, manual=True, sync_every=100,
                default_hooks=False)
    with pytest.raises(NonFiniteError) as info: t.fit(1)
    assert str(info.value).startswith("Non-finite loss (nan) in epoch 1, batch 4 (iteration 3). Losses are checked when "
                                      "they reach the host")
    e = info.value
    assert (e.epoch, e.batch, e.iteration) == (1, 4, 3) and e.origin is None and e.module is None
    assert t.state.iteration == 6   # (found at the epoch's end, after its 6 batches)


@pytest.mark.usefixtures('on_the_cpu')
def test_nan_loss_iteration_counts_across_fits():
    t = Trainer(small_model(), DataLoader(regression_ds(24), batch_size=4), loss_func=F.mse_loss, default_hooks=False)
    t.fit(1)
    t.train_dl = DataLoader(_nan_ds(), batch_size=4)
    with pytest.raises(FloatingPointError, match=r"in epoch 2, batch 4 \(iteration 9,"):
        t.fit(1)


@pytest.mark.usefixtures('on_the_cpu')
def test_nan_loss_names_its_batch_after_a_shortened_epoch():
    "Epoch 0 ends after 2 batches (CancelEpoch): the NaN of epoch 1's batch 3 is iteration 5, not epoch 0's batch 5."
    from trainer_nb.core import CancelEpoch
    class ShortFirstEpoch(Hook):
        def before_batch(self):
            if self.trainer.state.epoch == 0 and self.trainer.state.batch == 2: raise CancelEpoch()
    t = Trainer(small_model(), DataLoader(regression_ds(24), batch_size=4), loss_func=F.mse_loss,
                hooks=[ShortFirstEpoch()], default_hooks=False)
    t.fit(1)
    assert t.state.iteration == 2
    t.train_dl = DataLoader(_nan_ds(), batch_size=4)
    with pytest.raises(FloatingPointError, match=r"in epoch 2, batch 4 \(iteration 5,"):
        t.fit(1)


def test_nan_skip_policy():
    t = Trainer(small_model(), DataLoader(_nan_ds(), batch_size=4), loss_func=F.mse_loss, nan_policy='skip',
                opt_func=torch.optim.SGD, lr=0.1, default_hooks=False)
    with pytest.warns(UserWarning, match=r"Skipped batch 4 of epoch 1 \(iteration 3\): non-finite loss nan"):
        t.fit(1)
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert (t.state.step, t.state.iteration, t.state.samples) == (5, 6, 24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        t.fit(1)
    assert sum('Skipped batch 4 of epoch 2 (iteration 9)' in str(w.message) for w in caught) == 1
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


# ---- metrics ----

def test_metric_error_names_the_metric(make_trainer):
    def accuracy(preds, targets): return (preds.argmax(2) == targets).float().mean()   # wrong dim
    t = make_trainer(n=8, bs=4, valid=8, metrics=[accuracy])
    with pytest.raises(IndexError) as info:
        t.evaluate()
    note = ' '.join(info.value.__notes__)
    assert "metric 'accuracy'" in note and 'accuracy(preds, targets)' in note and '(8, 1)' in note


def test_metric_error_during_fit(make_trainer):
    def broken(preds, targets): raise RuntimeError('broken metric')
    calls = Calls()
    t = make_trainer(n=8, bs=4, valid=8, metrics=[broken], hooks=[calls])
    with pytest.raises(RuntimeError, match='broken metric') as info:
        t.fit(1)
    assert any("metric 'broken'" in n for n in info.value.__notes__)
    assert calls.log == ['before_fit', 'after_fit'] and not t.fitting


def test_metrics_with_the_same_name(make_trainer):
    with pytest.raises(ValueError, match=r"Two metrics are named '<lambda>'.*give each its own"):
        make_trainer(metrics=[lambda p, y: 0.0, lambda p, y: 1.0])
    def valid_loss(p, y): return 0.0
    with pytest.raises(ValueError, match=r"can't be named 'valid_loss'"):
        make_trainer(metrics=[valid_loss])
    f, g = (lambda p, y: 0.0), (lambda p, y: 1.0)
    g.__name__ = 'other'
    t = make_trainer(n=8, bs=4, valid=8, metrics=[f, g])  # distinct names: both reported
    assert t.evaluate().keys() == {'valid_loss', '<lambda>', 'other'}


def test_lr_with_an_optimizer_instance(fresh_accelerate):
    dl = DataLoader(regression_ds(16), batch_size=8)
    def make(**kw):
        model = small_model()
        return Trainer(model, dl, loss_func=F.mse_loss, default_hooks=False,
                       opt_func=torch.optim.SGD(model.parameters(), lr=0.05), **kw)
    with pytest.warns(UserWarning, match=r"lr=0.1 ignored: the optimizer passed has its own, lr=0.05"):
        t = make(lr=0.1)
    assert t.lr == 0.05 and t.opt.param_groups[0]['lr'] == 0.05
    with warnings.catch_warnings():
        warnings.simplefilter('error')                    # no lr, or the same one: nothing to warn about
        assert make().lr == 0.05 and make(lr=0.05).lr == 0.05
        assert Trainer(small_model(), dl, loss_func=F.mse_loss, default_hooks=False).lr == 1e-3   # the default


def test_metric_without_targets(make_trainer):
    t = make_trainer(n=8, bs=4, metrics=[lambda p, y: 0.0])
    with pytest.raises(ValueError, match='needs targets'):
        t.evaluate(DataLoader(TensorDataset(torch.randn(8, 5)), batch_size=4))


# ---- constructor and fit arguments ----

@pytest.mark.parametrize('kw,exc,match', [
    (dict(mixed_precision='fp8'), ValueError, r"mixed_precision must be 'no', 'bf16' or 'fp16', got 'fp8'"),
    (dict(grad_accum=0), ValueError, r"grad_accum must be an int >= 1, got 0"),
    (dict(grad_accum=2.0), ValueError, r"grad_accum must be an int >= 1"),
    (dict(lr=-1), ValueError, r"lr must be a positive number, got -1"),
    (dict(lr='1e-3'), ValueError, r"lr must be a positive number"),
    (dict(nan_policy='ignore'), ValueError, r"nan_policy must be 'raise', 'raise_grads' or 'skip'"),
    (dict(metrics=['accuracy']), TypeError, r"metrics must be callables"),
], ids=lambda v: None if isinstance(v, (dict, type, str)) else str(v))
def test_bad_constructor_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        Trainer(small_model(), loss_func=F.mse_loss, **kw)


def test_model_not_a_module():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got function"):
        Trainer(lambda x: x, loss_func=F.mse_loss)


def test_bad_fit_arguments_and_lr(make_trainer):
    t = make_trainer(n=8, bs=4)
    for bad in (-1, 1.5, '2'):
        with pytest.raises(ValueError, match='epochs must be an int >= 0'):
            t.fit(bad)
    with pytest.raises(ValueError, match='lr must be a positive number'):
        t.lr = 0
    with pytest.raises(ValueError, match='lr must be a positive number'):
        t.fit(1, lr=-0.1)
    assert t.state.iteration == 0


def test_arguments_an_own_accelerator_decides_are_named(fresh_accelerate):
    from accelerate import Accelerator
    dl = DataLoader(regression_ds(16), batch_size=8)
    with pytest.warns(UserWarning, match=r"^grad_accum, cpu ignored: the accelerator passed decides them"):
        t = Trainer(small_model(), dl, loss_func=F.mse_loss, default_hooks=False, grad_accum=2, cpu=True,
                    accelerator=Accelerator(cpu=True))
    assert t.grad_accum == 1          # the accelerator's, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # nothing to warn about when only the accelerator is given
        Trainer(small_model(), dl, loss_func=F.mse_loss, default_hooks=False, accelerator=t.accelerator)


def test_log_with_reaches_the_accelerator(fresh_accelerate, tmp_path):
    pytest.importorskip('tensorboard')
    t = Trainer(small_model(), DataLoader(regression_ds(16), batch_size=8), loss_func=F.mse_loss, default_hooks=False,
                cpu=True, log_with='tensorboard', project_dir=str(tmp_path))
    t.accelerator.init_trackers('run')
    t.accelerator.log({'x': 1.0}, step=0)
    t.accelerator.end_training()
    assert list(tmp_path.rglob('events.out.tfevents.*'))   # the tracker wrote its file under project_dir
