"Fine-tuning: parameter groups, freezing, discriminative LRs through the schedules and the LR finder, fine_tune."
import numpy as np, pytest, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.schedule import cosine, one_cycle

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Net(nn.Module):
    "A pretrained-like model: a body of two layers and a head."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)
    def forward(self, x): return self.head(self.body(x))


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def make(**kw):
    return Trainer(Net(), data(), loss_func=F.cross_entropy, cpu=True, default_hooks=False, hooks=[Recorder()], **kw)


def snapshot(module): return {k: v.clone() for k, v in module.state_dict().items()}


def test_frozen_body_bitwise_unchanged_head_trains():
    t = make(opt_func=torch.optim.AdamW)   # weight decay would move a parameter the optimizer did not skip
    t.split('body', 'head').freeze()
    body, head = snapshot(t.model.body), snapshot(t.model.head)
    t.fit_one_cycle(2, lr_max=slice(1e-2))
    assert all(torch.equal(v, t.model.body.state_dict()[k]) for k, v in body.items())
    assert not torch.equal(head['weight'], t.model.head.weight)
    t.unfreeze()
    t.fit(1)
    assert not torch.equal(body['0.weight'], t.model.body[0].weight)


@pytest.mark.parametrize('fit', ['one_cycle', 'cosine', 'constant'])
def test_group_lrs_follow_the_schedule_in_their_ratio(fit):
    t = make().split('body.0', 'body.2', 'head')
    lr = slice(1e-4, 1e-2)   # three groups: 1e-4, 1e-3, 1e-2
    if fit == 'one_cycle': t.fit_one_cycle(2, lr_max=lr)
    elif fit == 'cosine': t.fit_cosine(2, lr=lr)
    else: t.fit_constant(2, lr=lr, warmup_steps=3)
    assert np.allclose(t.lrs, [1e-4, 1e-3, 1e-2])
    s = t.get_hook(Recorder).steps
    assert len(s) == 16 and np.allclose(s.lr_1 / s.lr, 10) and np.allclose(s.lr_2 / s.lr, 100)
    if fit != 'constant': assert s.lr_2.max() == pytest.approx(1e-2) and s.lr_2.iloc[-1] < 1e-3


def test_one_cycle_lrs_per_group_are_torchs():
    "Each group's LR at each step is what torch's OneCycleLR gives that group alone."
    t = make().split('body', 'head')
    t.fit_one_cycle(1, lr_max=[1e-3, 2e-2])
    s = t.get_hook(Recorder).steps
    for col, lr in (('lr', 1e-3), ('lr_1', 2e-2)):
        opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)
        sched, want = one_cycle()(opt, 8), []
        for _ in range(8):
            want.append(opt.param_groups[0]['lr'])
            opt.step()
            sched.step()
        assert s[col].tolist() == pytest.approx(want, rel=1e-12)


def test_lr_forms():
    t = make().split('body.0', 'body.2', 'head')
    t.lr = slice(1e-2)
    assert t.lrs == pytest.approx([1e-3, 1e-3, 1e-2])
    t.lr = [1e-5, 1e-4, 1e-3]
    assert [g['lr'] for g in t.opt.param_groups] == pytest.approx([1e-5, 1e-4, 1e-3] * 2)   # (no-decay twins, after)
    t.lr = 1e-2                    # a number is the fastest group's LR, the others keeping their ratios
    assert t.lrs == pytest.approx([1e-4, 1e-3, 1e-2]) and t.lr == pytest.approx(1e-2)
    for bad, msg in ((slice(0, 1e-2), 'positive'), ([1e-3, 1e-2], '2 values for 3'), (slice(1, 2, 3), 'no step')):
        with pytest.raises(ValueError, match=msg): t.lr = bad
    assert t.lrs == pytest.approx([1e-4, 1e-3, 1e-2])   # a refused value changes nothing
    one = make()
    for before, lr in ((0.0271, 0.026), (3.3e-3, 1e-2), (0.1, 7e-3)):   # set exactly: not 0.025999999999999995
        one.lr = before
        one.lr = lr
        assert one.lr == lr and one.opt.param_groups[0]['lr'] == lr


@pytest.mark.filterwarnings('ignore:lr_find')   # a short sweep: no reliable suggestion
def test_lr_finder_sweeps_every_group_at_its_ratio_and_restores():
    seen = []
    def loss(preds, y):
        seen.append([g['lr'] for g in t.opt.param_groups])
        return F.cross_entropy(preds, y)
    t = Trainer(Net(), data(256), loss_func=loss, cpu=True, default_hooks=False)
    t.split('body', 'head').lr = slice(1e-3)
    before = [dict(g) for g in t.opt.param_groups]
    t.lr_find(num_it=20, show=False)
    assert len(seen) >= 10 and all(np.isclose(s[1] / s[0], 10) and s[2:] == s[:2] for s in seen)   # twins follow
    assert max(s[0] for s in seen) > 100 * seen[0][0]          # it swept (then the check's trials, at the same ratio)
    assert np.allclose(t.lrs, [1e-4, 1e-3])
    assert [g['lr'] for g in t.opt.param_groups] == [g['lr'] for g in before]


def test_freeze_by_prefix_and_group_index():
    t = make().split('body', 'head')
    t.freeze('body.2')
    assert [p.requires_grad for p in t.model.parameters()] == [True, True, False, False, True, True]
    t.unfreeze().freeze(-1)
    assert [p.requires_grad for p in t.model.parameters()] == [True] * 4 + [False] * 2
    t.unfreeze(1)
    assert all(p.requires_grad for p in t.model.parameters())
    with pytest.raises(IndexError, match='No parameter group 2'): t.freeze(2)
    with pytest.raises(ValueError, match="No parameters under module 'neck'"): t.freeze('neck')
    with pytest.raises(ValueError, match='split the model first'): make().freeze()


def test_split_errors_and_the_rest_group():
    t = make()
    with pytest.raises(ValueError, match="in no group.*head.weight"): t.split('body')
    with pytest.raises(ValueError, match="No parameters in group"): t.split('', 'neck')
    t.split('', t.model.head)     # '' takes what is not elsewhere; a module names its own group
    assert [len(g['params']) for g in t.opt.param_groups] == [2, 1, 2, 1]   # matrices, then each group's 1-d ones
    assert t.opt.param_groups[1]['params'][0] is t.model.head.weight
    assert t.opt.param_groups[1]['weight_decay'] == t.opt.param_groups[0]['weight_decay'] == 0.01


def test_fine_tune_frozen_then_discriminative():
    t = make()
    t.split('body', 'head')
    body = snapshot(t.model.body)
    seen = []
    class Peek(Recorder):
        def after_epoch(self):
            super().after_epoch()
            seen.append([p.requires_grad for p in self.trainer.model.parameters()])
    t.remove_hooks(Recorder).add_hooks(Peek())
    t.fine_tune(2, base_lr=1e-2, freeze_epochs=1)
    assert seen == [[False] * 4 + [True] * 2, [True] * 6, [True] * 6]
    s = t.get_hook(Recorder).steps
    assert np.allclose(s.lr_1[:8] / s.lr[:8], 10) and np.allclose(s.lr_1[8:] / s.lr[8:], 100)
    assert 9e-3 < s.lr_1[:8].max() <= 1e-2 and s.lr_1[8:].max() == pytest.approx(5e-3, rel=1e-2)   # near the peaks
    assert not torch.equal(body['0.weight'], t.model.body[0].weight)
    assert all(p.requires_grad for p in t.model.parameters())
