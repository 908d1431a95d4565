"Schedules: the LR each optimizer step used (as the Recorder saw it) is torch's schedule, step by step."
import math
import numpy as np, pytest, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Hook, Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.schedule import constant, cosine, one_cycle


def toy_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())

def make(n_batches, grad_accum=1, opt_func=torch.optim.AdamW, lr=1e-2, **kw):
    torch.manual_seed(0)
    return Trainer(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                   DataLoader(toy_data(n_batches * 8), batch_size=8), loss_func=F.cross_entropy, lr=lr,
                   opt_func=opt_func, grad_accum=grad_accum, cpu=True, default_hooks=False, hooks=[Recorder()], **kw)

def expected(factory, total, lr, opt_func=torch.optim.AdamW):
    "LR and momentum of each of `total` steps, from a fresh torch scheduler on a one-parameter optimizer."
    opt = opt_func([torch.zeros(1, requires_grad=True)], lr=lr)
    sched, lrs, moms = factory(opt, total), [], []
    for _ in range(total):
        g = opt.param_groups[0]
        lrs.append(g['lr']); moms.append(g['betas'][0] if 'betas' in g else g['momentum'])
        opt.step(); sched.step()
    return lrs, moms


@pytest.mark.parametrize('n_batches,grad_accum', [(7, 2), (5, 1), (9, 3)])
def test_one_cycle_lrs_and_moms_step_by_step(n_batches, grad_accum):
    t = make(n_batches, grad_accum)
    t.fit_one_cycle(2, lr_max=3e-2)
    per_epoch = math.ceil(n_batches / grad_accum)
    steps = t.get_hook(Recorder).steps
    lrs, moms = expected(one_cycle(), 2 * per_epoch, 3e-2)
    assert steps.step.tolist() == list(range(1, 2 * per_epoch + 1))
    assert steps.lr.tolist() == lrs and steps.mom.tolist() == moms
    assert max(lrs) == pytest.approx(3e-2, rel=0.05) and lrs[-1] == pytest.approx(3e-2 / 1e5)
    # the fit's schedule is gone afterwards: the optimizer is as it was, a plain fit is constant
    assert t.scheduler_func is None and t.opt.param_groups[0]['betas'] == (0.9, 0.999)
    assert t.opt.param_groups[0]['lr'] == 3e-2
    t.fit(1)
    assert t.get_hook(Recorder).steps.lr.tolist()[2 * per_epoch:] == [3e-2] * per_epoch


def test_cosine_with_warmup_and_grad_accum():
    t = make(7, grad_accum=2)
    t.fit_cosine(3, lr=1e-2, warmup_steps=3, lr_min=1e-4)
    lrs, _ = expected(cosine(lr_min=1e-4, warmup_steps=3), 12, 1e-2)
    got = t.get_hook(Recorder).steps.lr.tolist()
    assert got == lrs and got[0] == pytest.approx(1e-2 / 25) and got[3] == max(got) == 1e-2
    assert all(a > b for a, b in zip(got[3:], got[4:])) and got[-1] > 1e-4


def test_cosine_warmup_pct_and_sgd_momentum_left_alone():
    t = make(10, opt_func=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.5))
    t.fit_cosine(2, lr=0.1)   # 20 steps, 5% warmup: 1 step
    lrs, moms = expected(cosine(), 20, 0.1, opt_func=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.5))
    steps = t.get_hook(Recorder).steps
    assert steps.lr.tolist() == lrs and lrs[0] == pytest.approx(0.1 / 25) and lrs[1] == 0.1
    assert steps.mom.tolist() == moms == [0.5] * 20


def test_constant_with_warmup_and_the_trainers_own_scheduler():
    t = make(6, scheduler=cosine(warmup_steps=0))
    t.fit_constant(1, lr=1e-2, warmup_steps=2)
    t.fit_constant(1)                 # no warmup: a plain fit at the trainer's lr, its cosine set aside
    t.fit(1)                          # the trainer's own schedule is back
    lr = t.get_hook(Recorder).steps.lr.tolist()
    assert lr[:6] == expected(constant(warmup_steps=2), 6, 1e-2)[0] and lr[2:12] == [1e-2] * 10
    assert lr[12:] == expected(cosine(warmup_steps=0), 6, 1e-2)[0] and lr[12] == 1e-2 and lr[-1] < 1e-3


def test_one_cycle_keeps_the_groups_ratio():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW([{'params': model[0].parameters(), 'lr': 1e-3}, {'params': model[2].parameters()}], lr=1e-2)
    t = Trainer(model, DataLoader(toy_data(48), batch_size=8), loss_func=F.cross_entropy, opt_func=opt, cpu=True,
                default_hooks=False, hooks=[Recorder()])
    t.fit_one_cycle(1, lr_max=1e-3)   # the first group's peak; the second keeps its 10x
    s = t.get_hook(Recorder).steps
    np.testing.assert_allclose(s.lr_1, 10 * s.lr, rtol=1e-12)
    assert s.lr.max() == pytest.approx(1e-3, rel=0.05) and t.opt.param_groups[1]['lr'] == pytest.approx(1e-2)


def test_the_schedule_is_put_back_after_an_error():
    class Boom(Hook):
        def after_batch(self):
            if self.trainer.state.iteration == 3: raise RuntimeError('boom')
    t = make(6, scheduler=None)
    t.add_hooks(Boom())
    with pytest.raises(RuntimeError, match='boom'): t.fit_one_cycle(1, lr_max=5e-2)
    assert t.scheduler_func is None and t.opt.param_groups[0]['betas'][0] == 0.9
    assert t.opt.param_groups[0]['lr'] == 5e-2
    lrs = t.get_hook(Recorder).steps.lr.tolist()
    assert lrs == expected(one_cycle(), 6, 5e-2)[0][:3]


def test_factories_print_their_settings():
    assert 'pct_start=0.3' in repr(one_cycle(1e-3, pct_start=0.3)) and 'warmup_steps=7' in repr(cosine(warmup_steps=7))
