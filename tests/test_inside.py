"""Looking inside a fit: where a non-finite value started (the module named, the trainer left as the batch found it)."""
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import regression_ds
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
from trainer_nb.inside import NonFiniteError, find_non_finite

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Log(nn.Module):
    def forward(self, x): return torch.log(x)

class Sqrt(nn.Module):
    "The square root of the positive part: finite, but its gradient where the input is <= 0 is inf * 0, NaN."
    def forward(self, x): return torch.sqrt(x * (x > 0))

class Abs(nn.Module):
    def forward(self, x): return x.abs()

class Net(nn.Module):
    def __init__(self, body, head):
        super().__init__()
        self.body, self.head = body, head
    def forward(self, x): return self.head(self.body(x))


def log_net(seed=0):
    "log|x| in `body.1`: -inf where an input is exactly 0; dropout and batch norm after it."
    torch.manual_seed(seed)
    return Net(nn.Sequential(Abs(), Log(), nn.Linear(5, 8)),
               nn.Sequential(nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1)))

def sqrt_net(seed=0):
    "A square root in `body.1`."
    torch.manual_seed(seed)
    return Net(nn.Sequential(nn.Linear(5, 8), Sqrt()), nn.Linear(8, 1))

def zero_row_ds(row=13):
    x, y = regression_ds(24).tensors
    x = x.clone(); x[row] = 0.
    return TensorDataset(x, y)


class Keep(Hook):
    "At `before_batch` of iteration `at`: copies of the weights, the optimizer's state and the counters."
    def __init__(self, at): self.at, self.kept = at, None
    def before_batch(self):
        t = self.trainer
        if t.state.iteration == self.at:
            self.kept = ([p.detach().clone() for p in t.model.parameters()],
                         {k: {n: v.clone() for n, v in st.items()} for k, st in t.opt.optimizer.state.items()},
                         (t.state.epoch, t.state.batch, t.state.iteration, t.state.step))


@pytest.mark.usefixtures('on_the_cpu')
def test_forward_names_the_module_and_leaves_the_batch_as_it_found_it():
    keep = Keep(at=3)
    t = Trainer(log_net(), DataLoader(zero_row_ds(13), batch_size=4), loss_func=F.mse_loss, hooks=[keep],
                default_hooks=False)
    with pytest.raises(NonFiniteError) as info: t.fit(2)
    e = info.value
    assert isinstance(e, FloatingPointError) and e.module == 'body.1' and e.origin.kind == 'output'
    assert (e.epoch, e.batch, e.iteration, e.step, e.lr) == (1, 4, 3, 3, 0.001)
    msg = str(e)
    assert msg.startswith("Non-finite loss (") and "in epoch 1, batch 4 (iteration 3, step 3, LR 0.001)" in msg
    assert "the output of `body.1` (Log)" in msg
    weights, opt_state, counters = keep.kept
    assert all(torch.equal(a, p) for a, p in zip(weights, t.model.parameters()))
    assert all(torch.equal(v, t.opt.optimizer.state[k][n]) for k, st in opt_state.items() for n, v in st.items())
    assert (t.state.epoch, t.state.batch, t.state.iteration, t.state.step) == counters


class _NaNGrad(torch.autograd.Function):
    "The identity forward; backward: the gradient times NaN when `armed`."
    @staticmethod
    def forward(ctx, h, armed):
        ctx.armed = armed
        return h.clone()
    @staticmethod
    def backward(ctx, g): return (g * math.nan if ctx.armed else g), None

class Poison(nn.Module):
    "Finite forward, a NaN gradient in backward when the batch holds a marked row (first input 99)."
    armed = False
    def forward(self, h): return _NaNGrad.apply(h, self.armed)

class Marked(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        torch.manual_seed(0)   # (wide: `body` without a bias, so that its weight alone holds the NaN)
        self.body, self.poison, self.head = nn.Linear(5, width, bias=width == 8), Poison(), nn.Linear(width, 1)
    def forward(self, x):
        self.poison.armed = bool((x[:, 0] == 99.).any())
        return self.head(self.poison(torch.tanh(self.body(x))))

def marked_ds(row=9):
    "24 samples, batches of 4: the row marked is in the third batch (iteration 2)."
    x, y = regression_ds(24).tensors
    x = x.clone(); x[row, 0] = 99.
    return TensorDataset(x, y)


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('kw', [{}, {'max_grad_norm': 1.0}, {'grad_accum': 2}, {'hooks': 'keep'}, {'width': 16384}],
                         ids=['default', 'max_grad_norm', 'grad_accum', 'general_path', 'large_gradient'])
def test_a_gradient_made_non_finite_is_caught_at_its_own_batch(kw):
    """A finite loss whose backward pass makes NaN (in `poison`) at batch 3: caught there by default, before the
    optimizer step (by the clipped norm with `max_grad_norm`; at its own micro-batch when accumulating; by the sum that
    reads a large gradient, `body`'s weight of 81,920 elements, with `width`), the module named, the weights and the optimizer's
    state bitwise as before that batch."""
    kw = dict(kw, hooks=[Keep(at=2)]) if kw.get('hooks') else kw   # (a before_batch hook: the general path)
    width = kw.pop('width', 8)
    t = Trainer(Marked(width), DataLoader(marked_ds(), batch_size=4), loss_func=F.mse_loss, opt_func=torch.optim.AdamW,
                default_hooks=False, **kw)
    w = []   # the weights and the optimizer's state as each training forward pass begins

    def copy(m, args):
        state = t.opt.optimizer.state.items()
        if m.training: w.append(([p.detach().clone() for p in m.parameters()],
                                 {k: {n: v.clone() for n, v in st.items()} for k, st in state}))
    t.model.register_forward_pre_hook(copy)
    with pytest.raises(NonFiniteError) as info: t.fit(1)
    e = info.value
    step = 1 if kw.get('grad_accum') else 2
    assert (e.epoch, e.batch, e.iteration, e.step) == (1, 3, 2, step), str(e)
    assert e.module == 'poison' and e.origin.kind == 'gradient', str(e)
    assert str(e).startswith("Non-finite gradients in epoch 1, batch 3 (iteration 2")
    assert "made by the backward pass of `poison` (Poison)" in str(e)
    weights, opt_state = w[2]   # as they were when batch 3 began
    assert all(torch.equal(a, p) for a, p in zip(weights, t.model.parameters()))
    assert opt_state and all(torch.equal(v, t.opt.optimizer.state[k][n]) for k, st in opt_state.items()
                             for n, v in st.items())
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


@pytest.mark.usefixtures('on_the_cpu')
def test_non_finite_weights_name_their_modules():
    "Weights already non-finite (made so outside the checks): the first loss finds them, and the error says which."
    model = sqrt_net()
    with torch.no_grad(): model.body[0].weight[0, 0] = math.nan
    t = Trainer(model, DataLoader(regression_ds(24), batch_size=4), loss_func=F.mse_loss, default_hooks=False)
    with pytest.raises(NonFiniteError, match=r"^Non-finite loss \(nan\) in epoch 1, batch 1 \(iteration 0, step 0") as info:
        t.fit(1)
    assert info.value.origin.kind == 'weights' and info.value.module == 'body.0'
    assert "The weights of `body.0` are not finite already" in str(info.value)


@pytest.mark.usefixtures('on_the_cpu')
def test_backward_names_the_module_whose_gradient_went_non_finite():
    t = Trainer(sqrt_net(), DataLoader(regression_ds(24), batch_size=4), loss_func=F.mse_loss, default_hooks=False,
                nan_policy='raise_grads')
    w0 = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"^Non-finite gradients in epoch 1, batch 1 \(iteration 0, step 0") as info:
        t.fit(1)
    assert info.value.module == 'body.1' and info.value.origin.kind == 'gradient'
    assert "backward pass of `body.1` (Sqrt)" in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(w0, t.model.parameters()))   # no step taken


def test_the_search_changes_nothing():
    "Parameters, buffers (batch norm's statistics), gradients and every random generator bitwise as before."
    model = log_net().train()
    x, y = zero_row_ds(1).tensors[0][:8], torch.randn(8, 1)
    F.mse_loss(model(x.abs() + 1), y).backward()   # gradients to keep, batch norm statistics moved
    random.seed(5); np.random.seed(5); torch.manual_seed(5)
    before = ([t.clone() for t in model.state_dict().values()], [p.grad.clone() for p in model.parameters()],
              random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    for grads in (False, True):
        origin = find_non_finite(model, lambda: F.mse_loss(model(x), y), gradients=grads)
        assert origin.module == 'body.1' or grads   # (backward: the loss itself is not finite)
        assert all(torch.equal(a, b) for a, b in zip(before[0], model.state_dict().values()))
        assert all(torch.equal(a, p.grad) for a, p in zip(before[1], model.parameters()))
        assert random.getstate() == before[2] and (np.random.get_state()[1] == before[3]).all()
        assert torch.equal(torch.get_rng_state(), before[4])


def test_finite_batches_pay_no_search(monkeypatch):
    import trainer_nb.core as core
    monkeypatch.setattr(core, 'find_non_finite', lambda *a, **k: pytest.fail("searched a finite batch"))
    t = Trainer(sqrt_net(), DataLoader(regression_ds(24), batch_size=4), loss_func=F.mse_loss, default_hooks=False)
    t.model.body[1] = nn.ReLU()
    t.fit(2)
    assert t.state.step == 12


# ---- LayerStats ----

from trainer_nb.inside import LayerStats, STATS   # noqa: E402


class ByHand(Hook):
    "The statistics of `mods` computed with forward hooks of its own, at every step."
    order = 100
    def __init__(self, mods, eps=1e-6): self.mods, self.eps, self.rows, self.acts = mods, eps, {}, {}
    def before_fit(self):
        for i, m in enumerate(self.mods): m.register_forward_hook(lambda m, a, out, i=i: self.acts.__setitem__(i, out))
    def before_step(self):
        self.old = [[p.detach().clone() for p in m.parameters()] for m in self.mods]
        self.grads = [[p.grad.clone() for p in m.parameters()] for m in self.mods]
    def after_step(self):
        rows = []
        for i, m in enumerate(self.mods):
            a, ps = self.acts[i].detach(), list(m.parameters())
            g = torch.cat([x.flatten() for x in self.grads[i]]).norm().item() if ps else float('nan')
            d = (torch.cat([(p.detach() - o).flatten() for p, o in zip(ps, self.old[i])]).norm()
                 / torch.cat([o.flatten() for o in self.old[i]]).norm()).item() if ps else float('nan')
            rows.append([a.mean().item(), a.std().item(), (a.abs() <= self.eps).float().mean().item(), g, d])
        self.rows[self.trainer.state.step] = rows


def relu_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))


def test_layer_stats_equal_those_computed_by_hand():
    model = relu_net()
    stats, hand = LayerStats(every=3, modules=(nn.Linear, nn.ReLU), report=False), ByHand(
        [m for m in model if isinstance(m, (nn.Linear, nn.ReLU))])
    t = Trainer(model, DataLoader(regression_ds(48), batch_size=4), loss_func=F.mse_loss, hooks=[stats, hand],
                opt_func=torch.optim.SGD, lr=0.05, default_hooks=False)
    t.fit(2)   # 24 steps: sampled at 3, 6, ..., 24
    df = stats.to_frame()
    assert sorted(set(df.step)) == list(range(3, 25, 3)) and list(df.columns) == ['step', 'layer', *STATS]
    assert stats.names == ['0', '1', '2', '3', '4'] and stats.types[:2] == ['Linear', 'ReLU']
    for step, g in df.groupby('step'):
        assert np.allclose(g[list(STATS)].to_numpy(), np.array(hand.rows[step]), rtol=1e-5, atol=1e-7, equal_nan=True)
    assert df[df.layer == '1'].grad_norm.isna().all()   # a ReLU has no parameters
    assert stats.plot().axes   # draws


def test_layer_stats_default_modules_and_memory_flat_over_10000_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(4, 2)
    batches = [(x, x[:, :1])] * 10_000
    stats = LayerStats(every=1, keep=64, report=False)
    sizes = []
    class Watch(Hook):
        order = 100
        def after_step(self):
            if self.trainer.state.step % 1000 == 0: sizes.append((stats.samples.len, stats.nbytes))
    t = Trainer(model, batches, loss_func=F.mse_loss, hooks=[stats, Watch()], opt_func=torch.optim.SGD, lr=0.01,
                default_hooks=False)
    t.fit(1)
    assert stats.names == ['0', '2']   # the leaves with parameters
    assert all(n <= 64 for n, _ in sizes) and len({b for _, b in sizes}) == 1   # the same bytes all along
    steps = stats.to_frame().step.unique()
    assert len(steps) <= 64 and steps[0] <= 256 and steps[-1] >= 10_000 - 256   # spread over the whole fit
    assert np.all(np.diff(steps) > 0)


def test_layer_stats_reports_a_dead_layer(capsys):
    model = relu_net()
    with torch.no_grad(): model[2].bias.fill_(-100.)   # the second ReLU's inputs all negative: off for good
    t = Trainer(model, DataLoader(regression_ds(16), batch_size=4), loss_func=F.mse_loss, default_hooks=False,
                hooks=[LayerStats(every=1, modules=(nn.Linear, nn.ReLU))], opt_func=torch.optim.SGD, lr=1e-3)
    t.fit(1)
    out = capsys.readouterr().out
    assert out.startswith("LayerStats, epoch 1: 3 (100% of its output zero)") and out.count('\n') == 1


def test_layer_stats_refuses_a_compiled_model():
    t = Trainer(relu_net(), DataLoader(regression_ds(16), batch_size=4), loss_func=F.mse_loss, default_hooks=False,
                hooks=[LayerStats()], compile=True)
    with pytest.raises(ValueError, match="can't watch a compiled model"): t.fit(1)


def test_layer_stats_refuses_to_watch_nothing():
    "A LayerStats with no module to watch says so before the fit's first batch (it raised inside torch.stack before)."
    from trainer_nb.inside import LayerStats
    t = Trainer(nn.Linear(4, 1), [(torch.randn(8, 4), torch.randn(8, 1))] * 4, loss_func=F.mse_loss, cpu=True,
                hooks=[LayerStats(every=2, modules=[])], default_hooks=False)
    with pytest.raises(ValueError, match="LayerStats has no module to watch"): t.fit(1)
    assert t.state.iteration == 0
