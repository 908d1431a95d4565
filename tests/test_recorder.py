"""Recorder: what it records per optimizer step and per epoch, its cost in memory, and its checkpoint state; and the
live plot that draws from it (its x axis, its metric panel, and a redraw cost that does not grow with the steps)."""
import gc, json, math, os, subprocess, sys, tracemalloc, weakref
import numpy as np, pytest, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import CancelBatch, CancelFit, Hook, NonFiniteError
from trainer_nb.core import Trainer
from trainer_nb.recorder import Binned, Recorder
from trainer_nb.liveplot import LivePlot
from conftest import REPO


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
    def before_step(self):
        g = self.trainer.opt.param_groups
        self.cur = [x['lr'] for x in g], g[0]['betas'][0] if 'betas' in g[0] else g[0].get('momentum')
    def after_step(self):
        self.lrs.append(self.cur[0])
        self.moms.append(self.cur[1])

class Jitter(Hook):
    "Changes every group's LR before each optimizer step (to a value that depends on the iteration) and after it."
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


@pytest.mark.parametrize('opt_func, mom', [
    (lambda p, lr: torch.optim.SGD(p, lr=lr), None),                   # plain SGD: no momentum, no column of zeros
    (lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), 0.9),
    (lambda p, lr: torch.optim.RMSprop(p, lr=lr), None),
    (lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.8, 0.99)), 0.8), # Adam's beta1
])
def test_mom_is_recorded_only_where_the_optimizer_has_momentum(opt_func, mom):
    t = make(n_batches=3, opt_func=opt_func)
    t.fit(1)
    rec = t.get_hook(Recorder)
    steps = rec.steps
    if mom is None:
        assert list(steps.columns) == ['step', 'iteration', 'loss', 'lr'] and rec.state_dict()['mom'] is None
        assert len(rec.plot_lr().axes) == 1                 # no momentum axis either
    else: assert steps.mom.tolist() == [mom] * 3


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
    # one numbering, the dashboard's: the epoch (from 1, on across fits) is the index, no 0-based one beside it
    assert list(h.columns) == ['train_loss', 'valid_loss', 'accuracy', 'time'] and h.index.tolist() == [1, 2, 3]
    assert h.index.name == 'epoch' and h.loc[3, 'train_loss'] == h.train_loss.iloc[-1]
    assert np.isclose(h.loc[3, 'train_loss'], np.mean(t.get_hook(Spy).losses), rtol=1e-6)
    assert h.loc[3, 'valid_loss'] == pytest.approx(t.evaluate()['valid_loss']) and h.accuracy.between(0, 1).all()
    no_valid = make(n_batches=4, valid=False)
    no_valid.fit(1)
    assert list(no_valid.history.columns) == ['train_loss', 'time'] and no_valid.history.index.tolist() == [1]


def test_history_time_is_a_duration_shown_as_the_dashboard_shows_it():
    from trainer_nb.progress import fmt_time
    rec = Recorder()
    rec.load_state_dict({'step': [], 'iteration': [], 'loss': [], 'lr': [], 'mom': None, 'epoch_step': [4, 8, 12],
                         'epochs': [{'epoch': e, 'train_loss': 0.5, 'time': s} for e, s in
                                    ((1, 3.469543), (2, 0.4), (3, 3725.2))]})
    h = rec.history
    assert h.time.dtype.kind == 'm' and h.time.dt.total_seconds().tolist() == pytest.approx([3.469543, 0.4, 3725.2])
    assert h.time.sum().total_seconds() == pytest.approx(3729.069543) and h.time.idxmax() == 3
    shown = [l.split()[-1] for l in repr(h).splitlines()[2:]]   # (a line of column names, one with the index's)
    assert shown == [fmt_time(s) for s in (3.469543, 0.4, 3725.2)] == ['00:03', '00:00', '1:02:05']   # the dashboard's
    html = h._repr_html_()
    assert '<td>00:03</td>' in html and '<td>1:02:05</td>' in html and '3.469543' not in html
    # printing changed nothing in the table
    assert h.time.dtype.kind == 'm' and h.time.iloc[0].total_seconds() == pytest.approx(3.469543)
    assert Recorder().history.empty and Recorder().history.time.dtype.kind == 'm'


def test_arrays_mid_fit_and_downsampled():
    seen = []
    class Peek(Hook):
        order = 60
        def after_batch(self):
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
    with pytest.raises(NonFiniteError, match='iteration 5') as info: t.fit(1)
    # before its backward pass on the CPU, after its step on a GPU (when it reached the host): the same error, where
    assert (info.value.epoch, info.value.batch, info.value.iteration) == (1, 6, 5)


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


MEMORY_SCRIPT = """\
import gc, json, sys, time, torch
sys.path.insert(0, {repo!r})
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder

class Still(torch.optim.Optimizer):
    "Adam's hyper-parameters (so that a momentum is recorded as well as the LR), and a step that changes nothing."
    def __init__(self, params):
        super().__init__(params, dict(lr=1e-3, betas=(0.9, 0.999)))
        self.step = lambda closure=None: None          # instance attributes: no profiling wrapper on every call
        self.zero_grad = lambda set_to_none=True: None

def status(field):
    "A field of /proc/self/status, in bytes."
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'): return int(line.split()[1]) * 1024

def make(n, leak):
    model = torch.nn.Linear(1, 1, bias=False)
    kept = []
    def train_step(batch, trainer):
        if leak: kept.append(float(len(kept)))   # what a recorder keeping a Python float per step would hold
        return {{'loss': model.weight.sum()}}
    return Trainer(model, [(torch.ones(1),)] * n, train_step=train_step, opt_func=Still(model.parameters()), cpu=True,
                   default_hooks=False, hooks=[Recorder()])

n, leak = {n}, {leak}
make(5000, False).fit(1)      # warm up: lazy initialisations and allocator pools are not the Recorder's
tr = make(n, leak)
gc.collect()
open('/proc/self/clear_refs', 'w').write('5')   # restart the peak (VmHWM) from the current RSS
base, t = status('VmRSS'), time.perf_counter()
tr.fit(1)
wall, peak = time.perf_counter() - t, status('VmHWM') - base
rec = tr.get_hook(Recorder)
held = rec.nbytes + tr.losses.nbytes
print(json.dumps(dict(steps=len(rec.steps), mom=bool(rec.steps.mom.notna().all()), peak=peak, held=held, wall=wall)))
"""

def measure_fit_memory(n, leak=False):
    "Peak growth of the resident memory of a process during a real fit of `n` tiny steps with a Recorder."
    code = MEMORY_SCRIPT.format(repo=str(REPO), n=n, leak=leak)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])

@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason="needs Linux's /proc/self/clear_refs")
def test_many_steps_take_little_memory():
    """A real fit of 300,000 optimizer steps, in its own process: the peak growth of its resident memory (everything:
    numpy buffers, torch tensors, Python objects, allocator slack) during the fit. (300,000 steps, not a million: what
    grows with the steps shows as well, in a third of the time.)"""
    m = measure_fit_memory(300_000)
    assert m['steps'] == 300_000 and m['mom']
    # what is held on purpose: the Recorder's buffers (36 bytes a step, plus spare room: 15.5 MB measured) and the
    # trainer's loss log
    assert m['held'] < 20e6, m
    assert m['peak'] < 25e6, f"{m['peak'] / 1e6:.1f} MB for 300,000 steps"
    # and nothing else grows with the steps. Beyond the buffers: while a full buffer grows, its old copy lives on for
    # a moment, plus allocator slack and the epoch's mean loss, read a block at a time (measured 1.6 MB here; 2-7 MB
    # over a million steps); one Python float kept per step adds 15 MB more (`measure_fit_memory(300_000, leak=True)`:
    # 16.4 MB beyond the buffers)
    assert m['peak'] - m['held'] < 8e6, f"{(m['peak'] - m['held']) / 1e6:.1f} MB beyond the buffers"


class StopAt(Hook):
    """Stops the fit in the after_step of batch number `it` (counted from 1: `state.iteration` counts a batch before
    its step); its order (0) puts it before the Recorder's after_step."""
    def __init__(self, it): self.it = it
    def after_step(self):
        if self.trainer.state.iteration == self.it: raise CancelFit()

class StopAfter(Hook):
    "Stops the fit in the after_batch of batch number `it`, once its step (if any) is recorded."
    def __init__(self, it): self.it = it
    def after_batch(self):
        if self.trainer.state.iteration == self.it: raise CancelFit()

class AllLosses(Hook):
    "Every batch's loss, with .item(), across fits."
    order = 50
    def __init__(self): self.losses = []
    def after_loss(self): self.losses.append(self.trainer.loss.item())


def test_a_stopped_fit_keeps_its_steps_and_the_next_fit_records_on():
    t = make(n_batches=7, grad_accum=2, hooks=[AllLosses()], sync_every=1000)
    t.add_hooks(StopAfter(9)); t.fit(2); t.remove_hooks(StopAfter)   # stops in epoch 2, after batch 9 (step 5)
    t.fit(1)
    steps = t.get_hook(Recorder).steps
    assert steps.step.tolist() == list(range(1, 10)) and steps.lr.notna().all()
    assert steps.iteration.tolist() == [2, 4, 6, 7, 9, 11, 13, 15, 16]
    bl = np.array(t.get_hook(AllLosses).losses)
    expected = [bl[i - 2:i].mean() if i not in (7, 16) else bl[i - 1] for i in steps.iteration]
    np.testing.assert_allclose(steps.loss, expected, rtol=1e-6)
    assert t.history.index.tolist() == [1, 2]   # the stopped epoch did not finish; the next fit ran it


def test_a_step_whose_after_step_was_cut_short_is_recorded():
    "By CancelFit (the batch, counted before its step, keeps its loss), or by CancelBatch (after_batch still runs)."
    t = make(n_batches=7, grad_accum=2, hooks=[AllLosses()], sync_every=1000)
    t.add_hooks(StopAt(9)); t.fit(2); t.remove_hooks(StopAt)   # stops in epoch 2, in the after_step of step 5
    steps, bl = t.get_hook(Recorder).steps, t.get_hook(AllLosses).losses
    assert steps.step.tolist() == [1, 2, 3, 4, 5] and steps.iteration.tolist() == [2, 4, 6, 7, 9]
    assert t.state.step == 5 and t.state.iteration == 9 and len(t.losses) == 9 and steps.lr.notna().all()
    assert steps.loss.iloc[-1] == pytest.approx(np.mean(bl[7:9]), rel=1e-6)   # batches 8 and 9, as when not cut
    class CutShort(Hook):
        def after_step(self): raise CancelBatch()   # the step is done; only the later after_step hooks are skipped
    t = make(n_batches=4, hooks=[CutShort(), AllLosses()])
    t.fit(1)
    steps = t.get_hook(Recorder).steps
    assert steps.step.tolist() == steps.iteration.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(steps.loss, t.get_hook(AllLosses).losses, rtol=1e-6)


def test_steps_whose_losses_never_reach_the_host_get_nan():
    class Drop(Hook):
        "Loses the losses still on the device when the fit stops (as a failed device would)."
        def after_cancel(self): self.trainer.losses.truncate(self.trainer.losses.n_host)
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
    assert s2.step.tolist() == list(range(1, 16)) and s2.loss.notna().all() and t2.history.index.tolist() == [1, 2, 3]


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


# ---- the live plot, drawing from the Recorder ----

def test_liveplot_x_axis_ends_at_the_last_step_the_scheduler_counts():
    "7 batches an epoch with grad_accum=2: 4 steps an epoch (the 7th batch steps alone), 12 in 3 epochs (not ceil(21/2) = 11)."
    spans = []
    class Look(Hook):
        order = 40   # after the plot's after_batch
        def after_batch(self):
            if plot.n_draws: spans.append(tuple(plot.view.widget.spec['x']))
    plot = LivePlot(mode='widget', every=0)
    t = make(n_batches=7, grad_accum=2, hooks=[plot, Look()],
             scheduler=lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=n))
    t.fit(3)
    assert t.scheduler.total_steps == 12 and t.get_hook(Recorder).steps.step.iloc[-1] == 12
    assert len(spans) == 21 and set(spans) == {(1, 12)}   # from the first frame on, the whole fit, and never moved


def test_liveplot_x_axis_of_a_fit_resumed_inside_an_epoch():
    "Stopped at step 10 of 3 epochs of 8 (in the second epoch), resumed: the axis spans steps 11 to 24, the fit's end."
    class StopAt(Hook):
        def after_batch(self):
            if self.trainer.state.iteration == 10 and not self.trainer.stopping: self.trainer.stop()
    plot = LivePlot(mode='widget', every=0)
    t = make(n_batches=8, hooks=[plot, StopAt()])
    with pytest.raises(KeyboardInterrupt): t.fit(3)   # FitStopped
    assert plot.view.widget.spec['x'] == [1, 24]
    t.resume()
    assert plot.view.widget.spec['x'] == [11, 24] and t.state.step == 24


def test_liveplot_metric_panel():
    def error(preds, targets): return 1 - accuracy(preds, targets)
    plain = LivePlot(mode='text', path=os.devnull, metrics=False)
    t = make(n_batches=4, metrics=[accuracy, error], hooks=[plain])
    t.fit(1)
    assert plain.frame()['metrics'] == [] and 'accuracy' not in plain.frame()['series']   # left out on request
    no_metrics = LivePlot(mode='text', path=os.devnull)
    make(n_batches=4, hooks=[no_metrics]).fit(1)
    assert no_metrics.frame()['metrics'] == []   # a trainer without metrics: no panel
    for metrics, shown in ((None, ['accuracy', 'error']), (True, ['accuracy', 'error']), (['error'], ['error']),
                           ([accuracy], ['accuracy'])):
        plot = LivePlot(mode='text', path=os.devnull, **({} if metrics is None else dict(metrics=metrics)))   # default: all
        t = make(n_batches=4, metrics=[accuracy, error], hooks=[plot])
        t.fit(3)
        f = plot.frame()
        assert f['metrics'] == shown
        for name in shown:
            assert list(f['series']['step:' + name]) == [4, 8, 12] and np.allclose(f['series'][name], t.history[name])
    with pytest.warns(UserWarning, match=r"\['acc'\] not among the trainer's metrics"):
        make(n_batches=2, metrics=[accuracy], hooks=[LivePlot(mode='text', path=os.devnull, metrics=['acc'])]).fit(1)


def bucket_means_of(x, size):
    "Means of the finite values of x[i:i + size], i = 0, size, 2 size... (NaN where there is none): the slow, obvious way."
    return np.array([np.mean(b[np.isfinite(b)]) if np.isfinite(b).any() else np.nan
                     for b in (x[i:i + size] for i in range(0, len(x), size))])

def test_binned_keeps_bucket_means_as_steps_arrive():
    rng = np.random.default_rng(0)
    n = 5000
    loss = rng.random(n); loss[rng.random(n) < 0.1] = np.nan           # steps whose loss never reached the host
    rec = Recorder()
    rec.load_state_dict({'step': list(range(1, n + 1)), 'iteration': list(range(1, n + 1)),
                         'loss': [None if v != v else v for v in loss.tolist()], 'lr': [rng.random(n).tolist()],
                         'mom': None, 'epochs': [], 'epoch_step': []})
    b = Binned(rec, max_points=80)
    a = b.arrays()
    assert b.size == 64 and len(a['step']) == 79 == math.ceil(n / 64)
    s = rec.steps
    for k in ('step', 'loss', 'lr'): np.testing.assert_allclose(a[k], bucket_means_of(s[k].to_numpy(float), 64))
    # a fit goes on from there: each answer covers every step so far, read incrementally
    seen = []
    class Check(Hook):
        order = 60
        def after_step(self):
            a, s = b.arrays(), rec.steps
            seen.append(len(s))
            assert len(a["step"]) <= 80
            for k in ('step', 'loss', 'lr'): np.testing.assert_allclose(a[k], bucket_means_of(s[k].to_numpy(float), b.size))
    t = make(n_batches=300, valid=False, hooks=[Check()])
    t.remove_hooks(Recorder); t.add_hooks(rec)
    t.state.step = t.state.iteration = n
    t.fit(1)
    assert seen[-1] == n + 300 and b.size == 128
    rec.reset()   # the records replaced: Binned starts over
    assert len(b.arrays()['step']) == 0 and b.size == 1


def test_liveplot_redraw_cost_does_not_grow_with_the_steps():
    """With a million steps recorded, a frame reads only the steps recorded since the last one, and sends the browser
    at most `max_points` points a line. Memory allocated during a step with a redraw tells whether a redraw passed over
    all the steps: one pass over a million float64 values allocates at least 8 MB (as `Recorder.arrays` does)."""
    n = 1_000_000
    rec = Recorder()
    rec.load_state_dict({'step': list(range(1, n + 1)), 'iteration': list(range(1, n + 1)),
                         'loss': np.linspace(2, 1, n).tolist(), 'lr': [[1e-3] * n], 'mom': None,
                         'epochs': [], 'epoch_step': []})
    peaks, points = [], []
    class Measure(Hook):
        "A redraw each step from the 10th on (after the plot's own, throttled, ones), each but the first traced."
        order = 40
        def after_batch(self):
            it = self.trainer.state.iteration - n
            if it < 10: return
            if it > 10: tracemalloc.start()
            plot.redraw()   # the first, if the plot made none yet, reads the million steps: once
            if it > 10: peaks.append(tracemalloc.get_traced_memory()[1]); tracemalloc.stop()
            points.append(dict(plot.view.widget.spec['series'])['loss'])
    plot = LivePlot(mode='widget')
    t = make(n_batches=40, valid=False, hooks=[plot, Measure()])
    t.remove_hooks(Recorder); t.add_hooks(rec)
    t.state.step = t.state.iteration = n
    t.fit(1)
    assert len(rec.steps) == n + 40 and len(peaks) == 30 and points[-1] == dict(plot.view.widget.spec['series'])['lr']
    assert all(250 <= p <= plot.max_points for p in points), (min(points), max(points))   # a line's points
    assert max(peaks) < 2e6, peaks
    tracemalloc.start()
    rec.arrays(max_points=500)   # the one-shot downsampling, for comparison: a pass over every step
    full = tracemalloc.get_traced_memory()[1]; tracemalloc.stop()
    assert full > 8e6, full


@pytest.mark.slow
def test_a_long_record_is_what_a_slow_hook_saw():
    "Over more steps than a block (1,024 noted steps committed mid-fit): two groups' LRs, Adam's beta1, each loss."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam([{'params': model[0].parameters()}, {'params': model[2].parameters(), 'lr': 3e-3}], lr=1e-3)
    t = Trainer(model, DataLoader(toy_data(1100 * 2), batch_size=2), loss_func=F.cross_entropy, opt_func=opt,
                cpu=True, default_hooks=False, hooks=[Recorder(), Spy(), Jitter()])
    t.fit(1)
    spy, steps = t.get_hook(Spy), t.get_hook(Recorder).steps
    assert steps.step.tolist() == list(range(1, 1101)) and steps.iteration.tolist() == list(range(1, 1101))
    assert steps.lr.tolist() == [l[0] for l in spy.lrs] and steps.lr_1.tolist() == [l[1] for l in spy.lrs]
    assert steps.mom.tolist() == spy.moms
    assert steps.loss.tolist() == np.float32(spy.losses).astype(np.float64).tolist()
