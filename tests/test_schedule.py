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
    assert t.lr == 1e-2 and t.lrs == [1e-3, 1e-2]   # the fastest group's
    t.fit_one_cycle(1, lr_max=1e-3)   # the fastest group's peak; the other keeps its tenth
    s = t.get_hook(Recorder).steps
    np.testing.assert_allclose(s.lr_1, 10 * s.lr, rtol=1e-12)
    assert s.lr_1.max() == pytest.approx(1e-3, rel=0.05) and t.opt.param_groups[1]['lr'] == pytest.approx(1e-3)
    assert t.lrs == pytest.approx([1e-4, 1e-3])


def layer_decay_groups(model, layer_of, layer_decay, weight_decay=0.05):
    """Parameter groups as timm's `param_groups_layer_decay` makes them for `create_optimizer_v2(layer_decay=...)`:
    one per (layer, decay or not), `lr_scale = layer_decay ** (last layer - layer)`, no weight decay for 1-d tensors."""
    layers = {n: layer_of(n) for n, _ in model.named_parameters()}
    last = max(layers.values())
    groups = {}
    for n, p in model.named_parameters():
        decay = 'no_decay' if p.ndim <= 1 else 'decay'
        g = groups.setdefault(f'layer_{layers[n]}_{decay}', {'lr_scale': layer_decay ** (last - layers[n]),
                                                             'weight_decay': 0. if decay == 'no_decay' else weight_decay,
                                                             'params': []})
        g['params'].append(p)
    return list(groups.values())


def test_lr_scale_of_timm_layer_decay_is_each_groups_ratio_to_the_fastest():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 2))
    groups = layer_decay_groups(model, lambda n: int(n.split('.')[0]) // 2, layer_decay=0.35)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.05)   # what create_optimizer_v2 then does
    scales = [g['lr_scale'] for g in opt.param_groups]
    assert len(scales) == 8 and max(scales) == 1 and min(scales) == pytest.approx(0.35 ** 3)
    t = Trainer(model, DataLoader(toy_data(48), batch_size=8), loss_func=F.cross_entropy, opt_func=opt, cpu=True,
                default_hooks=False, hooks=[Recorder()])
    assert t.lr == pytest.approx(1e-3) and t.lrs == pytest.approx([1e-3 * s for s in scales])
    t.fit(1, lr=5e-4)                 # the head (scale 1) at the LR asked for, every other group at its scale
    s = t.get_hook(Recorder).steps
    cols = ['lr'] + [f'lr_{i}' for i in range(1, 8)]
    for c, sc in zip(cols, scales): np.testing.assert_allclose(s[c], 5e-4 * sc, rtol=1e-12)
    t.fit_one_cycle(1, lr_max=2e-3)   # and along a schedule
    s = t.get_hook(Recorder).steps.iloc[6:]
    for c, sc in zip(cols, scales): np.testing.assert_allclose(s[c], sc * s.lr_6, rtol=1e-12)   # lr_6: the head
    assert s.lr_6.max() <= 2e-3 and t.lrs == pytest.approx([2e-3 * sc for sc in scales])


@pytest.mark.parametrize('steps', range(1, 11))
def test_every_fit_method_for_any_number_of_steps(steps):
    "One to ten optimizer steps, by the loader's length or by max_steps: every method runs, its LRs within the peak."
    runs = [('fit', {}), ('fit_one_cycle', {}), ('fit_cosine', {'warmup_steps': 2}), ('fit_constant', {'warmup_pct': .5})]
    for method, kw in runs:
        for t, args in ((make(steps), (1,)), (make(10), ())):
            getattr(t, method)(*args, **({'max_steps': steps} if not args else {}), **kw)
            lrs = t.get_hook(Recorder).steps.lr
            assert t.state.step == steps and len(lrs) == steps, (method, steps)
            assert lrs.between(0, 1e-2 * (1 + 1e-12)).all() and lrs.iloc[-1] > 0, (method, steps)
    t = make(steps).split('0', '2')
    t.fine_tune(1, base_lr=1e-2)
    assert t.state.step == 2 * steps


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
