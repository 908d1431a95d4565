"Gradient accumulation, LR scheduler stepping and gradient clipping: once per optimizer step."
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import flat, regression_ds, small_model
from trainer_nb.core import Hook, Trainer

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Record(Hook):
    "After each batch: was there an optimizer step, and the LR then."
    def __init__(self): self.stepped, self.lrs = [], []
    def after_batch(self):
        self.stepped.append(self.trainer.state.opt_stepped)
        self.lrs.append(self.trainer.opt.param_groups[0]['lr'])


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('opt_func', [torch.optim.SGD, torch.optim.AdamW], ids=['SGD', 'AdamW'])
def test_accumulation_equals_one_big_batch(make_trainer, opt_func):
    "k micro-batches of b end with the same weights as one batch of k*b, at the same LR."
    k, b, epochs = 3, 4, 2
    big = make_trainer(bs=k * b, opt_func=opt_func, lr=0.05)
    big.fit(epochs)
    acc = make_trainer(bs=b, opt_func=opt_func, lr=0.05, grad_accum=k)
    acc.fit(epochs)

    assert flat(small_model()).sub(flat(acc.model)).abs().max() > 1e-2   # it did train
    torch.testing.assert_close(flat(acc.model), flat(big.model), atol=1e-6, rtol=0)
    assert big.state.step == big.state.iteration == epochs * 48 // (k * b)
    assert acc.state.step == epochs * 48 // (k * b)          # k times fewer optimizer steps...
    assert acc.state.iteration == epochs * 48 // b           # ...than batches
    assert acc.state.samples == big.state.samples == epochs * 48


def test_no_accumulation_differs(make_trainer):
    "The comparison above can fail: stepping after every micro-batch ends elsewhere."
    big = make_trainer(bs=12, opt_func=torch.optim.SGD, lr=0.05); big.fit(2)
    small = make_trainer(bs=4, opt_func=torch.optim.SGD, lr=0.05); small.fit(2)
    assert (flat(big.model) - flat(small.model)).abs().max() > 1e-3


@pytest.mark.parametrize('n_batches,k', [(12, 3), (10, 3), (7, 1), (5, 2)])
def test_scheduler_steps_once_per_optimizer_step(make_trainer, n_batches, k):
    "The scheduler is built with the true number of optimizer steps and stepped exactly at each of them."
    built, calls = [], []
    def scheduler(opt, total_steps):
        built.append(total_steps)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: calls.append(i) or 1 / (1 + i))
    rec = Record()
    epochs, b = 2, 4
    t = make_trainer(n=n_batches * b, bs=b, grad_accum=k, scheduler=scheduler, hooks=[rec], opt_func=torch.optim.SGD, lr=0.1)
    t.fit(epochs)

    steps_per_epoch = math.ceil(n_batches / k)
    assert built == [epochs * steps_per_epoch]
    assert t.state.step == epochs * steps_per_epoch
    assert t.scheduler.last_epoch == t.state.step
    assert calls == list(range(t.state.step + 1))           # one call at construction, then one per step
    assert sum(rec.stepped) == t.state.step
    # the optimizer steps on the last micro-batch of each group, and at the end of each epoch
    per_epoch = [(i + 1) % k == 0 or i == n_batches - 1 for i in range(n_batches)]
    assert rec.stepped == per_epoch * epochs
    # the LR changes right after each optimizer step, never in between
    lrs = [0.1] + rec.lrs
    for i, stepped in enumerate(rec.stepped):
        assert (lrs[i + 1] != lrs[i]) == stepped, f"batch {i}"
    assert rec.lrs[-1] == pytest.approx(0.1 / (1 + t.state.step))


def test_scheduler_rebuilt_at_each_fit(make_trainer):
    built = []
    def scheduler(opt, total_steps):
        built.append((total_steps, opt.param_groups[0]['lr']))
        return torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=total_steps)
    t = make_trainer(n=32, bs=8, scheduler=scheduler, lr=0.2)
    t.fit(1)
    assert t.opt.param_groups[0]['lr'] == pytest.approx(0.02)
    t.fit(2, lr=0.1)
    assert built == [(4, 0.2), (8, 0.1)]     # each fit starts from its base LR, over its own number of steps
    assert t.opt.param_groups[0]['lr'] == pytest.approx(0.01)


def _hand_loop(clip_each_micro_batch=False, k=2, b=4, epochs=2, lr=0.1, max_norm=0.05):
    "A hand-written accumulation loop that clips once per optimizer step (or, wrongly, after each micro-batch)."
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    batches = list(DataLoader(regression_ds(), batch_size=b))
    for _ in range(epochs):
        for i, (x, y) in enumerate(batches):
            (F.mse_loss(model(x), y) / k).backward()
            if clip_each_micro_batch: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if (i + 1) % k == 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
                opt.step(); opt.zero_grad()
    return model, norms


@pytest.mark.usefixtures('on_the_cpu')
def test_clip_once_per_optimizer_step(make_trainer):
    "max_grad_norm clips the accumulated gradient once per optimizer step, like a hand-written loop."
    ref, norms = _hand_loop()
    assert min(norms) > 0.05                       # clipping is active at every step
    t = make_trainer(bs=4, grad_accum=2, max_grad_norm=0.05, opt_func=torch.optim.SGD, lr=0.1)
    t.fit(2)
    torch.testing.assert_close(flat(t.model), flat(ref), atol=1e-6, rtol=0)
    # and the check can fail: clipping each micro-batch, or not clipping, ends elsewhere
    wrong, _ = _hand_loop(clip_each_micro_batch=True)
    assert (flat(wrong) - flat(ref)).abs().max() > 1e-4
    unclipped = make_trainer(bs=4, grad_accum=2, opt_func=torch.optim.SGD, lr=0.1)
    unclipped.fit(2)
    assert (flat(unclipped.model) - flat(ref)).abs().max() > 1e-3


def test_clip_sees_whole_accumulated_gradient(make_trainer):
    "On the optimizer step, the gradient clipped is the sum over the group, and its norm ends at most max_grad_norm."
    class Norms(Hook):
        order = 1
        def __init__(self): self.before, self.sync = [], []
        def after_backward(self):
            g = torch.cat([p.grad.flatten() for p in self.trainer.model.parameters()])
            self.before.append(float(g.norm())); self.sync.append(self.trainer.accelerator.sync_gradients)
    h = Norms()
    t = make_trainer(bs=4, grad_accum=2, max_grad_norm=0.05, opt_func=torch.optim.SGD, lr=0.1, hooks=[h])
    # wrap the optimizer step to see the gradient it gets
    seen, step = [], t.opt.optimizer.step
    def spy(*a, **kw):
        seen.append(float(torch.cat([p.grad.flatten() for p in t.model.parameters()]).norm()))
        return step(*a, **kw)
    t.opt.optimizer.step = spy
    t.fit(1)
    assert h.sync == [False, True] * 6
    assert len(seen) == t.state.step == 6
    assert all(n == pytest.approx(0.05, rel=1e-4) for n in seen)                  # clipped to max_grad_norm
    assert all(h.before[i] > 0.05 for i in range(1, 12, 2))                       # from above it


def test_uneven_last_group_steps(make_trainer):
    "10 batches with grad_accum=3: the last, single-batch group still steps (4 steps per epoch, no gradient left over)."
    t = make_trainer(n=40, bs=4, grad_accum=3)
    t.fit(2)
    assert (t.state.step, t.state.iteration, t.state.samples) == (8, 20, 80)
    assert all(p.grad is None for p in t.model.parameters())


def test_second_trainer_keeps_first_accumulation(make_trainer):
    "In a notebook several trainers live side by side: each keeps its own grad_accum."
    first = make_trainer(n=24, bs=4, grad_accum=3)
    make_trainer(n=24, bs=4, grad_accum=1)
    first.fit(1)
    assert first.state.step == 2


def test_fit_after_interrupt_mid_group_counts_steps(make_trainer):
    class StopAt1(Hook):
        def after_batch(self):
            if self.trainer.state.iteration == 1: raise KeyboardInterrupt
    t = make_trainer(n=16, bs=4, grad_accum=2, hooks=[StopAt1()])
    with pytest.raises(KeyboardInterrupt): t.fit(1)
    t.remove_hooks(StopAt1)
    rec = Record(); t.add_hooks(rec)
    t.fit(1)
    assert rec.stepped == [False, True, False, True]


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('bad_batch', [2, 3], ids=['first-of-group', 'last-of-group'])
def test_nan_skipped_micro_batch_never_leaks_into_the_next_group(make_trainer, bad_batch):
    """grad_accum=2 over 6 batches, one NaN batch skipped. Skipping a group's first micro-batch leaves the other's
    gradient to step with; skipping its last (the one that would step) drops the group: no step, and its first
    micro-batch's gradient is not carried into the next group."""
    from torch.utils.data import TensorDataset
    x, y = regression_ds(24).tensors
    x = x.clone(); x[4 * bad_batch + 1] = float('nan')
    t = make_trainer(bs=4, grad_accum=2, opt_func=torch.optim.SGD, lr=0.1, nan_policy='skip')
    t.train_dl = DataLoader(TensorDataset(x, y), batch_size=4)
    with pytest.warns(UserWarning, match=rf"Skipped batch {bad_batch + 1} of epoch 1"):
        t.fit(1)

    ref = small_model(); opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = list(DataLoader(TensorDataset(x, y), batch_size=4))
    steps = 0
    for group in ((0, 1), (2, 3), (4, 5)):
        if bad_batch == group[1]: opt.zero_grad(); continue       # the group ends with no step
        for i in group:
            if i != bad_batch: (F.mse_loss(ref(batches[i][0]), batches[i][1]) / 2).backward()
        opt.step(); opt.zero_grad(); steps += 1
    torch.testing.assert_close(flat(t.model), flat(ref), atol=1e-6, rtol=0)
    assert t.state.step == steps == (2 if bad_batch == 3 else 3)
    assert all(p.grad is None for p in t.model.parameters())
