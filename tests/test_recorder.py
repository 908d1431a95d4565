"Recorder: what it records per optimizer step and per epoch, its cost in memory, and its checkpoint state."
import gc, json, math, tracemalloc, weakref
import numpy as np, pytest, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import CancelFit, Hook, Trainer
from trainer_nb.recorder import Recorder


def toy_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] - x[:, 2] > 0).long())

def accuracy(preds, targets): return (preds.argmax(-1) == targets).float().mean()

def make(n_batches=7, bs=16, valid=True, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    kw.setdefault('hooks', [])
    kw['hooks'] = [Recorder(), *kw['hooks']]
    return Trainer(model, DataLoader(toy_data(n_batches * bs), batch_size=bs),
                   DataLoader(toy_data(40, seed=1), batch_size=20) if valid else None,
                   loss_func=F.cross_entropy, cpu=True, default_hooks=False, **kw)

class Spy(Hook):
    "The slow, obvious record: each batch's loss with .item(), the LR the optimizer held when it stepped."
    order = 50
    def before_fit(self): self.losses, self.lrs, self.moms = [], [], []
    def after_loss(self): self.losses.append(self.trainer.loss.item())
    def after_backward(self):
        g = self.trainer.opt.param_groups
        self.cur = [x['lr'] for x in g], g[0]['betas'][0] if 'betas' in g[0] else g[0].get('momentum')
    def after_step(self):
        if self.trainer.state.opt_stepped: self.lrs.append(self.cur[0]); self.moms.append(self.cur[1])

class Jitter(Hook):
    "Changes every group's LR before each batch (to a value that depends on the iteration) and after it."
    def before_step(self):
        for i, g in enumerate(self.trainer.opt.param_groups): g['lr'] = 1e-3 * (1 + (self.trainer.state.iteration % 5)) * (i + 1)
    def after_step(self):   # runs before the Recorder's after_step: what the step used is what counts
        for g in self.trainer.opt.param_groups: g['lr'] = 123.


def test_lr_and_mom_are_what_the_optimizer_used():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD([{'params': model[0].parameters()}, {'params': model[2].parameters()}], lr=0.1, momentum=0.8)
    t = Trainer(model, DataLoader(toy_data(80), batch_size=16), loss_func=F.cross_entropy, opt_func=opt, cpu=True,
                default_hooks=False, hooks=[Recorder(), Spy(), Jitter()])
    t.fit(2)
    spy, steps = t.get_hook(Spy), t.get_hook(Recorder).steps
    assert list(steps.columns) == ['step', 'iteration', 'loss', 'lr', 'lr_1', 'mom']
    assert len(steps) == 10 and steps.step.tolist() == list(range(1, 11))
    assert steps.lr.tolist() == [l[0] for l in spy.lrs] and steps.lr_1.tolist() == [l[1] for l in spy.lrs]
    assert len(set(steps.lr)) == 5 and steps.mom.tolist() == [0.8] * 10


def test_step_loss_is_the_mean_of_its_micro_batches_under_grad_accum():
    t = make(n_batches=7, grad_accum=2, hooks=[Spy()])
    t.fit(3)
    steps, spy = t.get_hook(Recorder).steps, t.get_hook(Spy)
    assert steps.iteration.tolist() == [2, 4, 6, 7, 9, 11, 13, 14, 16, 18, 20, 21]
    bl = np.array(spy.losses)
    expected = [bl[i - 2:i].mean() if i % 7 else bl[i - 1] for i in steps.iteration]
    np.testing.assert_allclose(steps.loss, expected, rtol=1e-6)
    assert steps.lr.tolist() == [l[0] for l in spy.lrs] and steps.mom.tolist() == spy.moms == [0.9] * 12


def test_history_has_one_row_per_epoch_with_the_metrics():
    t = make(n_batches=4, metrics=[accuracy], hooks=[Spy()])
    t.fit(2); t.fit(1)
    h = t.history
    assert list(h.columns) == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time'] and h.epoch.tolist() == [0, 1, 2]
    assert np.isclose(h.train_loss[2], np.mean(t.get_hook(Spy).losses), rtol=1e-6)
    assert h.valid_loss[2] == pytest.approx(t.evaluate()['valid_loss']) and h.accuracy.between(0, 1).all()
    no_valid = make(n_batches=4, valid=False)
    no_valid.fit(1)
    assert list(no_valid.history.columns) == ['epoch', 'train_loss', 'time']


def test_arrays_mid_fit_and_downsampled():
    seen = []
    class Peek(Hook):
        order = 60
        def after_step(self):
            if self.trainer.state.iteration == 30: seen.append(self.trainer.get_hook(Recorder).arrays())
    t = make(n_batches=50, hooks=[Peek(), Spy()], sync_every=1000)   # losses stay on the device until asked for
    t.fit(2)
    mid = seen[0]
    assert mid['step'].tolist() == list(range(1, 31)) and np.isfinite(mid['loss']).all()
    np.testing.assert_allclose(mid['loss'], t.get_hook(Spy).losses[:30], rtol=1e-6)
    rec = t.get_hook(Recorder)
    a = rec.arrays(max_points=7)
    assert all(len(a[k]) == 7 for k in ('step', 'loss', 'lr'))   # 100 steps in buckets of 15
    np.testing.assert_allclose(a['loss'][0], np.mean(t.get_hook(Spy).losses[:15]), rtol=1e-6)
    assert a['step'][0] == 8 and a['valid_step'].tolist() == [50, 100] and len(a['valid_loss']) == 2
    assert rec.arrays(max_points=1000)['step'].tolist() == list(range(1, 101))


def test_arrays_mid_fit_still_reports_a_non_finite_loss():
    class Poison(Hook):
        def after_loss(self):
            if self.trainer.state.iteration == 5: self.trainer.loss = self.trainer.loss * float('nan')
    class Peek(Hook):
        order = 60
        def after_step(self): self.trainer.get_hook(Recorder).arrays()
    t = make(n_batches=20, hooks=[Poison(), Peek()])
    with pytest.raises(FloatingPointError, match='iteration 5'): t.fit(1)


def test_skipped_batches_do_not_count_in_a_step():
    class Poison(Hook):
        def after_loss(self):
            if self.trainer.state.iteration in (3, 4): self.trainer.loss = self.trainer.loss * float('nan')
    t = make(n_batches=10, hooks=[Poison(), Spy()], nan_policy='skip')
    with pytest.warns(UserWarning, match='non-finite'): t.fit(1)
    steps = t.get_hook(Recorder).steps
    assert steps.iteration.tolist() == [1, 2, 3, 6, 7, 8, 9, 10] and np.isfinite(steps.loss).all()
    bl = t.get_hook(Spy).losses
    np.testing.assert_allclose(steps.loss, [bl[i - 1] for i in steps.iteration], rtol=1e-6)


def test_no_graph_is_kept():
    refs = []
    class Grab(Hook):
        def after_loss(self): refs.append(weakref.ref(self.trainer.loss))
    t = make(n_batches=6, hooks=[Grab()])
    t.fit(1)
    rec = t.get_hook(Recorder)
    rec.steps, rec.history, rec.arrays(10)
    gc.collect()
    assert len(refs) == 6 and all(r() is None for r in refs)   # every loss tensor, and its graph, is gone
    def tensors(x, seen):
        if id(x) in seen: return 0
        seen.add(id(x))
        if isinstance(x, torch.Tensor): return 1
        if isinstance(x, dict): return sum(tensors(v, seen) for v in x.values())
        if isinstance(x, (list, tuple)): return sum(tensors(v, seen) for v in x)
        return 0
    assert tensors({k: v for k, v in vars(rec).items() if k not in ('trainer', '_pgs')}, set()) == 0


def test_a_million_steps_take_little_memory():
    t = make(n_batches=2, valid=False)
    rec, s, loss = t.get_hook(Recorder), t.state, torch.tensor(0.5)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rec.before_fit()
    for i in range(1_000_000):   # the recorder's own event methods, as the loop calls them
        t.losses.append(loss)
        s.iteration += 1; s.step += 1; s.opt_stepped = True
        rec.after_backward(); rec.after_step()
        if len(t.losses.pending) == 1000: t.losses.flush()
    rec.after_fit()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(rec.steps) == 1_000_000
    assert grown < 60e6, f"{grown / 1e6:.1f} MB"   # about 46 MB: 36 bytes a step, and room to grow
    assert (rec.arrays(500)['loss'] == 0.5).all() and len(rec.arrays(500)['step']) == 500


class StopAt(Hook):
    "Stops the fit in after_step of iteration `it`; its order (0) puts it before the Recorder's after_step."
    def __init__(self, it): self.it = it
    def after_step(self):
        if self.trainer.state.iteration == self.it: raise CancelFit()

class AllLosses(Hook):
    "Every batch's loss, with .item(), across fits."
    order = 50
    def __init__(self): self.losses = []
    def after_loss(self): self.losses.append(self.trainer.loss.item())


def test_a_stopped_fit_keeps_its_steps_and_the_next_fit_records_on():
    t = make(n_batches=7, grad_accum=2, hooks=[AllLosses()], sync_every=1000)
    t.add_hooks(StopAt(9)); t.fit(2); t.remove_hooks(StopAt)   # stops in epoch 2, in the after_step of step 5
    t.fit(1)
    steps = t.get_hook(Recorder).steps
    assert steps.step.tolist() == list(range(1, 10)) and steps.lr.notna().all()
    assert steps.iteration.tolist() == [2, 4, 6, 7, 9, 11, 13, 15, 16]   # step 5 recorded though its after_step was cut short
    bl = np.array(t.get_hook(AllLosses).losses)
    expected = [bl[i - 2:i].mean() if i not in (7, 16) else bl[i - 1] for i in steps.iteration]
    np.testing.assert_allclose(steps.loss, expected, rtol=1e-6)
    assert t.history.epoch.tolist() == [0, 1]   # the stopped epoch did not finish; the next fit ran it


def test_steps_whose_losses_never_reach_the_host_get_nan():
    class Drop(Hook):
        "Loses the losses still on the device when the fit stops (as a failed device would)."
        def after_cancel(self): self.trainer.losses.pending.clear()
    t = make(n_batches=7, hooks=[Drop(), AllLosses()], sync_every=1000)
    t.add_hooks(StopAt(10)); t.fit(2); t.remove_hooks(StopAt)
    t.fit(1)
    steps = t.get_hook(Recorder).steps
    assert steps.step.tolist() == list(range(1, 18)) and steps.lr.notna().all()
    assert steps.loss.isna().tolist() == [False] * 7 + [True] * 3 + [False] * 7   # steps 8-10 never reached the host
    np.testing.assert_allclose(steps.loss[10:], t.get_hook(AllLosses).losses[10:], rtol=1e-6)


def test_state_dict_is_json_and_round_trips():
    t = make(n_batches=5, metrics=[accuracy])
    t.fit(2)
    rec = t.get_hook(Recorder)
    state = json.loads(json.dumps(rec.state_dict(), allow_nan=False))
    r2 = Recorder(); r2.load_state_dict(state)
    assert r2.steps.equals(rec.steps) and r2.history.equals(rec.history)
    # a trainer resumed with it carries on recording after the loaded steps
    t2 = make(n_batches=5, metrics=[accuracy])
    t2.state.load_state_dict(t.state.state_dict())
    t2.get_hook(Recorder).load_state_dict(state)
    t2.fit(1)
    s2 = t2.get_hook(Recorder).steps
    assert s2.step.tolist() == list(range(1, 16)) and s2.loss.notna().all() and t2.history.epoch.tolist() == [0, 1, 2]


def test_plots_return_figures():
    t = make(n_batches=5)
    t.fit(2, lr=1e-2)
    rec = t.get_hook(Recorder)
    fig = rec.plot_loss(log=True)
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3 and lines[2].get_xdata().tolist() == [5, 10]   # raw, smoothed, valid per epoch
    assert fig.axes[0].get_yscale() == 'log'
    fig = rec.plot_lr()
    assert fig.axes[0].get_lines()[0].get_ydata().tolist() == [1e-2] * 10 and len(fig.axes) == 2   # lr, and beta1


def test_all_exports():
    import trainer_nb.all as tall
    ns = {}
    exec('from trainer_nb.all import *', ns)
    assert {'Trainer', 'Hook', 'Recorder', 'one_cycle', 'cosine', 'constant'} <= set(ns)
    assert ns['Trainer'].history.fget(make(valid=False)).empty
