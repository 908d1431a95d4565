"""The default optimizer (AdamW, weight_decay=0.01) decays weight matrices, not biases and normalisation weights: each
parameter group the user sees (split, lrs, freeze) has a no-decay twin, and a step is plain AdamW's with those groups,
bit for bit; an optimizer instance of the user's is left as it is; `summary()` says which."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import regression_ds
from trainer_nb.base import Hook

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def by_trainer(m, **kw):
    from trainer_nb.core import Trainer
    t = Trainer(m, DataLoader(regression_ds(48), batch_size=8), loss_func=F.mse_loss, cpu=True, default_hooks=False,
                **kw)
    t.opt.param_groups[0]['weight_decay'] = 0.5 if 'opt_func' not in kw else t.opt.param_groups[0]['weight_decay']
    t.fit(2)
    return t


def by_hand(groups, lr=1e-3):
    m = model()
    params = [[p for p in m.parameters() if (p.ndim > 1) == matrices] for matrices in (True, False)]
    opt = torch.optim.AdamW([{'params': params[0], 'weight_decay': 0.5},
                             {'params': params[1], 'weight_decay': 0.5 if groups == 'all' else 0.}], lr=lr)
    for _ in range(2):
        for x, y in DataLoader(regression_ds(48), batch_size=8):
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    return m


def test_default_optimizer_spares_biases_and_norm_weights():
    t = by_trainer(model())
    groups = t.opt.param_groups   # the group the user sees, then its no-decay twin; no hook at each step
    assert [g['weight_decay'] for g in groups] == [0.5, 0.] and len(t.lrs) == 1
    assert not t.opt.optimizer._optimizer_step_pre_hooks
    want = by_hand('matrices')
    assert all(torch.equal(p, q) for p, q in zip(t.model.parameters(), want.parameters()))   # bit for bit
    decays_all = by_hand('all')
    assert max((p - q).abs().max() for p, q in zip(t.model.parameters(), decays_all.parameters())) > 1e-4
    assert "weight decay: 0.5 on 96 parameters; none on 49 (biases, normalisation weights)" in repr(t.summary())


def test_an_optimizer_of_the_users_is_left_alone():
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.5)
    t = by_trainer(m, opt_func=opt)
    want = by_hand('all')
    for p, q in zip(t.model.parameters(), want.parameters()): torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert "weight decay: 0.5 on 145 parameters\n" in repr(t.summary()) + '\n'


class SetAt(Hook):
    "At the step after `at` steps: `trainer.set(**kw)` (taken at that step boundary, as from another thread)."
    def __init__(self, at, **kw): self.at, self.kw = at, kw
    def after_step(self):
        if self.trainer.state.step == self.at: self.trainer.set(**self.kw)


def body_head():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize('how', ['one group', 'split', 'split, one cycle'])
def test_no_decay_groups_are_plain_adamw_with_explicit_groups_bitwise(how):
    """The trainer's AdamW against torch's given HF's groups by hand (decay: matrices; no decay: 1-d), for 12 steps: one
    group, or `split` with discriminative LRs (`slice`), with a one-cycle schedule; an LR and a weight decay changed
    mid-fit (`set`) reach the right groups."""
    from trainer_nb.core import Trainer
    dl = DataLoader(regression_ds(48), batch_size=8)
    hooks = [SetAt(4, weight_decay=0.2), SetAt(7, lr=5e-4)]
    t = Trainer(body_head(), dl, loss_func=F.mse_loss, cpu=True, default_hooks=False, hooks=hooks)
    if how != 'one group': t.split(['0', '1', '3'], '5')
    lr = 1e-3 if how == 'one group' else slice(1e-4, 1e-3)
    (t.fit_one_cycle if 'cycle' in how else t.fit)(2, lr)

    m = body_head()
    parts = [list(m[:4].parameters()), list(m[5].parameters())] if how != 'one group' else [list(m.parameters())]
    lrs = [1e-3] if how == 'one group' else [1e-4, 1e-3]
    groups = [{'params': [p for p in ps if p.ndim > 1], 'lr': r} for ps, r in zip(parts, lrs)]
    groups += [{'params': [p for p in ps if p.ndim <= 1], 'lr': r, 'weight_decay': 0.} for ps, r in zip(parts, lrs)]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = None
    if 'cycle' in how:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g['lr'] for g in opt.param_groups], total_steps=12,
                                                    pct_start=0.25, div_factor=25., final_div_factor=1e5 / 25.,
                                                    cycle_momentum=True, max_momentum=0.95, base_momentum=0.85)
    step = 0
    for _ in range(2):
        for x, y in dl:
            F.mse_loss(m(x), y).backward()
            opt.step()
            if sched is not None: sched.step()
            opt.zero_grad()
            step += 1
            if step == 4:
                for g in opt.param_groups: g['weight_decay'] = 0.2 if g['weight_decay'] else 0.
            if step == 7:   # as `set(lr=)` does: the fastest group's rate the one asked, every other scaled with it
                now = max(g['lr'] for g in opt.param_groups)
                c = 5e-4 / now
                for g in opt.param_groups:
                    fastest = g['lr'] == now
                    for k in ('lr', 'initial_lr', 'max_lr', 'min_lr'):
                        if isinstance(g.get(k), float): g[k] *= c
                    if fastest: g['lr'] = 5e-4
                if sched is not None:
                    sched.base_lrs = [v * c for v in sched.base_lrs]
                    sched._last_lr = [v * c for v in sched._last_lr]
    assert t.state.step == step == 12
    assert [g['weight_decay'] for g in t.opt.param_groups] == [g['weight_decay'] for g in opt.param_groups]
    if sched is None: assert [g['lr'] for g in t.opt.param_groups] == [g['lr'] for g in opt.param_groups]
    else: assert t.lrs == [1e-4 * c, 1e-3 * c]   # (`fit_one_cycle` puts its base rates back, scaled by `set`)
    assert all(torch.equal(p, q) for p, q in zip(t.model.parameters(), m.parameters()))


def test_split_freeze_and_lrs_count_the_users_groups():
    "After `split`, a group's index (`freeze(0)`, `lr=[...]`) takes its twin with it; `lrs` has one rate per group."
    from trainer_nb.core import Trainer
    t = Trainer(body_head(), DataLoader(regression_ds(48), batch_size=8), loss_func=F.mse_loss, cpu=True,
                default_hooks=False)
    t.split(['0', '1', '3'], '5')
    assert len(t.opt.param_groups) == 4 and [g['weight_decay'] for g in t.opt.param_groups] == [0.01, 0.01, 0., 0.]
    t.lr = [1e-4, 1e-3]
    assert t.lrs == [1e-4, 1e-3] and [g['lr'] for g in t.opt.param_groups] == [1e-4, 1e-3, 1e-4, 1e-3]
    t.freeze()
    assert [n for n, p in t.model.named_parameters() if p.requires_grad] == ['5.weight', '5.bias']
    t.unfreeze()
    for g in t.opt.param_groups[:2]: g['weight_decay'] = 0.   # every group at 0: `set` leaves the twins at 0 still
    t.set(weight_decay=0.1)
    assert [g['weight_decay'] for g in t.opt.param_groups] == [0.1, 0.1, 0., 0.]
