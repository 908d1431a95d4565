"The event loop: hook order, events, cancellation, interrupts, errors raised in hooks, describe_hooks."
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from conftest import REPO, flat
from trainer_nb.control import Pause
from trainer_nb.core import (EVENTS, CancelEpoch, CancelFit, CancelBatch, Hook, MainProcessHook, PrintMetrics,
                             Trainer)

pytestmark = pytest.mark.usefixtures('fresh_accelerate')

BATCH_EVENTS = ['before_batch', 'after_pred', 'after_loss', 'after_backward', 'before_step', 'after_step', 'after_batch']


class Recorder(Hook):
    "Records every event it sees, with the batch counter."
    def __init__(self, order=0): self.order, self.log = order, []
for _e in EVENTS:
    setattr(Recorder, _e, (lambda e: lambda self: self.log.append(e))(_e))


class RaiseAt(Hook):
    "Raises `exc` at `event` when `when(state)` holds."
    def __init__(self, event, exc, when=lambda s: True, order=0):
        self.event, self.exc, self.when, self.order, self.raised = event, exc, when, order, 0
    def _maybe(self):
        if self.when(self.trainer.state):
            self.raised += 1
            raise self.exc() if isinstance(self.exc, type) else self.exc
for _e in EVENTS:
    setattr(RaiseAt, _e, (lambda e: lambda self: self._maybe() if self.event == e else None)(_e))


# ---- order ----

def test_hooks_run_in_order_ties_in_insertion_order(make_trainer):
    calls = []
    def mk(name, order):
        return type(name, (Hook,), {'order': order, 'before_fit': lambda self: calls.append(self.name)})()
    t = make_trainer(hooks=[mk('A', 5), mk('B', 0), mk('C', 0)])
    t.add_hooks(mk('D', -1), mk('E', 0))
    t.fit(1)
    assert calls == ['D', 'B', 'C', 'E', 'A']
    assert [h.name for h in t.hooks] == ['D', 'B', 'C', 'E', 'A']
    assert t.describe_hooks().loc['before_fit'].iloc[0] == 'D (-1), B (0), C (0), E (0), A (5)'


def test_every_listed_event_is_called(make_trainer):
    "Each event describe_hooks lists really fires: the whole sequence of a fit with validation, then a cancelled one."
    rec = Recorder()
    t = make_trainer(n=12, bs=4, valid=8, hooks=[rec])
    assert list(t.describe_hooks().index) == list(EVENTS)
    t.fit(2)
    epoch = ['before_epoch', *BATCH_EVENTS * 3, 'before_valid', 'after_valid', 'after_epoch']
    assert rec.log == ['before_fit', *epoch * 2, 'after_fit']
    fired = set(rec.log)
    rec.log.clear()
    t.add_hooks(RaiseAt('after_batch', CancelFit))
    t.fit(1)
    assert rec.log == ['before_fit', 'before_epoch', *BATCH_EVENTS, 'after_cancel', 'after_fit']
    fired |= set(rec.log)
    rec.log.clear()
    t.remove_hooks(RaiseAt)
    t.add_hooks(Ask())   # a change and a pause asked at the first batch: heard at the step boundary after it
    t.fit(1)
    assert rec.log == ['before_fit', 'before_epoch', *BATCH_EVENTS, 'after_change', 'after_pause', *BATCH_EVENTS * 2,
                       'before_valid', 'after_valid', 'after_epoch', 'after_fit']
    assert fired | set(rec.log) == set(t.describe_hooks().index) == set(EVENTS)


@pytest.mark.parametrize('event', ['after_change', 'after_pause'])
@pytest.mark.parametrize('exc', [CancelBatch, CancelEpoch, CancelFit])
def test_cancel_when_hearing_a_request(make_trainer, event, exc):
    "Between two batches only CancelFit has a meaning: it stops the fit there; the other two are errors saying so."
    rec = Recorder(order=1)
    t = make_trainer(n=12, bs=4, valid=8, hooks=[Ask(), RaiseAt(event, exc), rec])
    if exc is CancelFit: t.fit(1)
    else:
        with pytest.raises(RuntimeError, match=rf"^{exc.__name__} raised by hook RaiseAt at event '{event}', where it "
                                               "has no meaning: it comes between two batches"):
            t.fit(1)
    heard = [] if event == 'after_change' else ['after_change']   # (the raising event's later hooks skipped)
    assert rec.log == ['before_fit', 'before_epoch', *BATCH_EVENTS, *heard, 'after_cancel', 'after_fit']
    assert t.state.iteration == 1 and len(t.changes) == 1


class Ask(Hook):
    "At the first batch of a fit, asks it (as another thread would) for a new LR and a pause already let go."
    order = 50
    def after_batch(self):
        if self.trainer.state.batch == 0:
            self.trainer.set(lr=self.trainer.lr / 2)
            p = Pause()
            p.release.set()
            self.trainer._ask(p)


def test_train_step_path_fires_batch_events(make_trainer):
    rec = Recorder()
    import torch.nn.functional as F
    t = make_trainer(n=8, bs=4, loss_func=None, hooks=[rec],
                     train_step=lambda b, tr: {'loss': F.mse_loss(tr.model(b[0]), b[1])})
    t.fit(1)
    assert rec.log == ['before_fit', 'before_epoch', *BATCH_EVENTS * 2, 'after_epoch', 'after_fit']


# ---- cancellation ----

def test_cancel_fit_returns_normally(make_trainer):
    rec = Recorder(order=1)
    stop = RaiseAt('after_batch', CancelFit, when=lambda s: s.iteration == 2)
    t = make_trainer(n=40, bs=4, valid=8, hooks=[stop, rec])
    t.fit(3)                                             # no exception
    assert isinstance(t.cancelled, CancelFit)
    assert t.state.iteration == 2 and t.state.epoch == 0
    assert rec.log[-2:] == ['after_cancel', 'after_fit']
    assert 'before_valid' not in rec.log and 'after_epoch' not in rec.log
    assert not t.fitting
    t.remove_hooks(stop)
    t.fit(1)                                             # and trains again
    assert t.cancelled is None and t.state.epoch == 1 and t.state.iteration == 12


@pytest.mark.parametrize('event', ['before_batch', 'after_loss', 'after_backward'])
def test_cancel_step_skips_optimizer_step(make_trainer, event):
    "CancelBatch on batch 1: that batch leaves the weights as they were; the others change them."
    class Weights(Hook):
        order = 10
        def __init__(self): self.after, self.stepped = [], []
        def after_batch(self):
            self.after.append(flat(self.trainer.model)); self.stepped.append(self.trainer.state.opt_stepped)
    w = Weights()
    t = make_trainer(n=16, bs=4, hooks=[RaiseAt(event, CancelBatch, when=lambda s: s.batch == 1), w],
                     opt_func=torch.optim.SGD, lr=0.1)
    before = [flat(t.model)]
    t.fit(1)
    same = [bool(torch.equal(b, a)) for b, a in zip(before + w.after, w.after)]
    assert same == [False, True, False, False]
    assert w.stepped == [True, False, True, True]
    assert t.state.step == 3 and t.state.iteration == 4 and t.state.samples == 16
    assert all(p.grad is None for p in t.model.parameters())


@pytest.mark.usefixtures('on_the_cpu')
def test_cancel_step_discards_its_gradients(make_trainer):
    "The next batch after a cancelled backward steps with its own gradient only."
    import torch.nn.functional as F
    from conftest import regression_ds, small_model
    t = make_trainer(n=8, bs=4, hooks=[RaiseAt('after_backward', CancelBatch, when=lambda s: s.batch == 0)],
                     opt_func=torch.optim.SGD, lr=0.1)
    t.fit(1)
    ref = small_model(); opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = regression_ds(8)[4:8]
    F.mse_loss(ref(x), y).backward(); opt.step()
    torch.testing.assert_close(flat(t.model), flat(ref), atol=1e-7, rtol=0)


def test_cancel_epoch_still_validates(make_trainer):
    rec = Recorder(order=1)
    t = make_trainer(n=20, bs=4, valid=8, hooks=[RaiseAt('before_batch', CancelEpoch, when=lambda s: s.batch == 2), rec])
    t.fit(2)
    epoch = ['before_epoch', *BATCH_EVENTS * 2, 'before_valid', 'after_valid', 'after_epoch']
    assert rec.log == ['before_fit', *epoch * 2, 'after_fit']
    assert t.state.epoch == 2 and t.state.iteration == 4
    assert t.cancelled is None
    assert set(t.epoch_results) >= {'epoch', 'train_loss', 'valid_loss', 'time'} and t.epoch_results['epoch'] == 2


# ---- cancel exceptions at every event: the table in nbs/00_core.ipynb ----

V = ['before_valid', 'after_valid']
FULL_EPOCH = ['before_epoch', *BATCH_EVENTS * 3, *V, 'after_epoch']
RUN = ['before_fit', *FULL_EPOCH * 2, 'after_fit']        # 2 epochs of 3 batches, with validation


def _raise_point(event):
    "Index in RUN where the hook raises: the event's first time in epoch 0 (for batch events, in batch 1)."
    if event in BATCH_EVENTS: return 2 + len(BATCH_EVENTS) + BATCH_EVENTS.index(event)
    return {'before_fit': 0, 'before_epoch': 1, 'before_valid': 2 + 3 * len(BATCH_EVENTS)}.get(
        event, 2 + 3 * len(BATCH_EVENTS) + (1 if event == 'after_valid' else 2))


def _expected(event, exc):
    "(log of the Recorder that runs after the raising hook, batches trained, outcome) as the table documents them."
    prefix = RUN[:_raise_point(event)]
    # batches counted before the raise (a batch counts before its step: at before_step, after_step, after_batch)
    done = prefix.count('after_batch') + (event in ('before_step', 'after_step', 'after_batch'))
    allowed = {CancelBatch: BATCH_EVENTS, CancelFit: [e for e in EVENTS if e not in ('after_cancel', 'after_fit')],
               CancelEpoch: [e for e in EVENTS if e not in ('before_fit', 'after_cancel', 'after_fit')]}[exc]
    if event not in allowed: return prefix + ['after_cancel', 'after_fit'], done, 'error'
    if exc is CancelFit: return prefix + ['after_cancel', 'after_fit'], done, 'stopped'
    if exc is CancelBatch:   # the rest of batch 1 is dropped (after_batch still runs), the fit goes on
        rest = (['after_batch'] if event != 'after_batch' else []) + BATCH_EVENTS + V + ['after_epoch']
        return prefix + rest + FULL_EPOCH + ['after_fit'], 6, None
    rest = {'before_valid': ['after_epoch'], 'after_valid': ['after_epoch'], 'after_epoch': []}.get(
        event, V + ['after_epoch'])        # before_epoch and batch events: the epoch's training ends
    return prefix + rest + FULL_EPOCH + ['after_fit'], done + 3, None


@pytest.mark.parametrize('exc', [CancelBatch, CancelEpoch, CancelFit])
@pytest.mark.parametrize('event', [e for e in EVENTS if e not in ('after_cancel', 'after_fit', 'after_change',
                                                           'after_pause')])   # (those two: below)
def test_cancel_at_every_event(make_trainer, event, exc):
    "Each (event, exception) pair does what the table says; none escapes fit bare; the trainer stays usable."
    rec = Recorder(order=1)
    raiser = RaiseAt(event, exc, when=lambda s: s.epoch == 0 and (event not in BATCH_EVENTS or s.batch == 1))
    t = make_trainer(n=12, bs=4, valid=8, hooks=[raiser, rec])
    log, batches, outcome = _expected(event, exc)
    if outcome == 'error':
        with pytest.raises(RuntimeError, match=rf"^{exc.__name__} raised by hook RaiseAt at event '{event}', "
                                               "where it has no meaning") as info:
            t.fit(2)
        assert isinstance(info.value.__cause__, exc) and isinstance(t.cancelled, RuntimeError)
        assert f"raised by hook RaiseAt at event {event!r}" in info.value.__notes__
    else:
        t.fit(2)
        assert isinstance(t.cancelled, CancelFit) if outcome == 'stopped' else t.cancelled is None
    assert raiser.raised == 1
    assert rec.log == log
    s = t.state
    assert (s.iteration, s.samples, len(t.losses)) == (batches, 4 * batches, batches)
    assert all(p.grad is None for p in t.model.parameters()) and not t.fitting
    t.remove_hooks(raiser)
    t.fit(1)                                             # and it trains on
    assert t.state.iteration == batches + 3 and t.cancelled is None


@pytest.mark.parametrize('exc', [CancelBatch, CancelEpoch, CancelFit])
@pytest.mark.parametrize('event', ['after_cancel', 'after_fit'])
def test_cancel_in_cleanup_events_is_an_error(make_trainer, event, exc):
    "The fit is already stopping: any cancel exception there is an error, and the other hooks of the event still run."
    rec = Recorder(order=1)
    stop = RaiseAt('after_batch', CancelFit, order=-1)     # so that after_cancel runs
    t = make_trainer(n=8, bs=4, hooks=[stop, RaiseAt(event, exc), rec])
    with pytest.raises(RuntimeError, match=rf"^{exc.__name__} raised by hook RaiseAt at event '{event}'.*"
                                           "the fit is already stopping"):
        t.fit(1)
    assert rec.log == ['before_fit', 'before_epoch', *BATCH_EVENTS[:-1], 'after_cancel', 'after_fit']
    assert not t.fitting


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('k,event', [(1, 'after_backward'), (2, 'before_batch'), (2, 'after_backward')])
def test_cancel_epoch_drops_unfinished_gradients(make_trainer, k, event):
    "CancelEpoch in batch 1 of epoch 0: its gradients (and its unfinished group's) never reach a later step."
    import torch.nn.functional as F
    from conftest import regression_ds, small_model
    t = make_trainer(n=16, bs=4, grad_accum=k, opt_func=torch.optim.SGD, lr=0.1,
                     hooks=[RaiseAt(event, CancelEpoch, when=lambda s: s.epoch == 0 and s.batch == 1)])
    t.fit(2)
    ref = small_model(); opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [regression_ds(16)[i:i + 4] for i in range(0, 16, 4)]
    groups = [[batches[0]]] if k == 1 else []            # epoch 0: batch 0 alone steps, or its group is dropped
    groups += [batches[i:i + k] for i in range(0, 4, k)]  # epoch 1 in full, groups aligned from its start
    for group in groups:
        for x, y in group: (F.mse_loss(ref(x), y) / k).backward()
        opt.step(); opt.zero_grad()
    torch.testing.assert_close(flat(t.model), flat(ref), atol=1e-6, rtol=0)
    assert t.state.step == len(groups)


# ---- cleanup events run every hook ----

@pytest.mark.parametrize('event', ['after_cancel', 'after_fit'])
def test_cleanup_event_runs_every_hook_then_raises_the_first_error(make_trainer, event):
    rec = Recorder(order=1)
    first, later = RaiseAt(event, ValueError('first'), order=0), RaiseAt(event, TypeError('later'), order=2)
    stop = RaiseAt('after_batch', CancelFit, order=-1)
    t = make_trainer(n=8, bs=4, hooks=[stop, first, rec, later])
    with pytest.raises(ValueError) as info:
        t.fit(1)
    assert str(info.value) == 'first'
    notes = info.value.__notes__
    assert f"raised by hook RaiseAt at event {event!r}" in notes
    assert any(f"hook RaiseAt at event {event!r} then raised TypeError: later" in n for n in notes), notes
    assert later.raised == 1                              # the hook after the failing ones ran too
    assert rec.log[-2:] == ['after_cancel', 'after_fit'] and not t.fitting
    t.remove_hooks(stop, first, later)
    t.fit(1)


# ---- interrupts ----

@pytest.mark.usefixtures('on_the_cpu')
def test_keyboard_interrupt_in_hook(make_trainer):
    rec = Recorder(order=1)
    t = make_trainer(n=40, bs=4, valid=8, hooks=[RaiseAt('after_batch', KeyboardInterrupt, when=lambda s: s.iteration == 3), rec])
    with pytest.raises(KeyboardInterrupt) as info:
        t.fit(2)
    assert any('RaiseAt' in n and 'after_batch' in n for n in info.value.__notes__)
    assert rec.log[-2:] == ['after_cancel', 'after_fit']
    assert isinstance(t.cancelled, KeyboardInterrupt)
    assert not t.fitting and t.loss is None and t.preds is None
    assert all(p.grad is None for p in t.model.parameters())
    assert torch.isfinite(t.model(torch.randn(2, 5))).all()
    t.hooks = [h for h in t.hooks if not isinstance(h, RaiseAt)]
    rec.log.clear()
    t.fit(1)
    assert rec.log[0] == 'before_fit' and rec.log[-1] == 'after_fit' and 'after_cancel' not in rec.log
    assert t.state.iteration == 3 + 10 and t.cancelled is None
    assert 'valid_loss' in t.epoch_results


@pytest.mark.usefixtures('on_the_cpu')
def test_sigint_during_fit(tmp_path):
    """A real Ctrl-C (SIGINT) in a training process: the fit stops after the batch (`FitStopped`, a KeyboardInterrupt),
    cleanup runs, and fit runs again."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    p = subprocess.Popen([sys.executable, str(REPO / 'tests' / 'sigint_script.py')], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == 'READY', (line, p.stderr.read() if p.poll() is not None else '')
        time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None: p.kill(); p.wait()
    assert p.returncode == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r['interrupted'] is True and r['resumable'] is True   # the first Ctrl-C stops after the batch
    assert r['events'] == [['after_cancel', 'FitStopped'], ['after_fit', False]]
    assert r['fitting'] is False and r['grads_cleared'] and r['pending_losses'] == 0 and r['model_works']
    assert 3 <= r['iteration'] < 1000 and r['epoch'] == 0
    assert r['losses_at_stop'] == r['iteration']   # every batch counted ran to its end
    assert r['message'] == (f"Stopped at epoch 1 of 1, batch {r['iteration']} of 1000 (step {r['iteration']} of 1000). "
                            "trainer.resume() continues this fit.")
    assert r['handler_back']   # the handler before fit is back
    assert r['second_fit_batches'] == 16 and r['second_fit_epochs'] == 2
    assert r['second_fit_events'] == [['after_fit', False]]
    assert r['weights_finite']


# ---- errors raised in hooks ----

@pytest.mark.parametrize('event', ['before_fit', 'before_epoch', 'after_pred', 'after_backward', 'before_valid',
                                   'after_valid', 'after_epoch'])
def test_hook_error_names_hook_and_event(make_trainer, event):
    rec = Recorder(order=1)
    t = make_trainer(n=8, bs=4, valid=4, hooks=[RaiseAt(event, ZeroDivisionError('boom')), rec])
    with pytest.raises(ZeroDivisionError, match='boom') as info:
        t.fit(1)
    assert f"raised by hook RaiseAt at event {event!r}" in info.value.__notes__
    assert rec.log[-2:] == ['after_cancel', 'after_fit']     # cleanup ran anyway
    assert not t.fitting


def test_error_in_after_fit_propagates(make_trainer):
    t = make_trainer(n=8, bs=4, hooks=[RaiseAt('after_fit', ValueError('late'))])
    with pytest.raises(ValueError, match='late') as info:
        t.fit(1)
    assert "raised by hook RaiseAt at event 'after_fit'" in info.value.__notes__
    assert not t.fitting
    t.hooks.clear(); t.fit(1)


def test_error_from_instance_attribute_handler(make_trainer):
    h = Hook()
    h.after_batch = lambda: 1 / 0
    t = make_trainer(n=8, bs=4, hooks=[h])
    with pytest.raises(ZeroDivisionError) as info:
        t.fit(1)
    assert any("'after_batch'" in n for n in info.value.__notes__)


# ---- describe_hooks ----

def test_describe_hooks_table(make_trainer):
    class Early(Hook):
        order = -5
        def before_fit(self): pass
        def after_batch(self): pass
    class Late(MainProcessHook):
        order = 50
        def after_batch(self): pass
        def after_epoch(self): pass
    t = make_trainer(hooks=[Late(), Early(), PrintMetrics()])
    df = t.describe_hooks()
    assert list(df.index) == list(EVENTS)
    col = df.columns[0]
    assert df.loc['before_fit', col] == 'Early (-5)'
    assert df.loc['after_batch', col] == 'Early (-5), Late (50)'
    assert df.loc['after_epoch', col] == 'Late (50), PrintMetrics (90)'
    assert df.loc['before_valid', col] == '-'
    assert 'main process only' not in df.to_string()          # single process: everything runs


def test_misspelled_event_flagged_and_warned(make_trainer):
    class Typo(Hook):
        def after_bacth(self): pass
        def before_zzzzzz(self): pass
    t = make_trainer(hooks=[Typo()])
    df = t.describe_hooks()
    assert df.loc['after_bacth (not an event!)'].iloc[0] == 'Typo (0)'
    assert df.loc['before_zzzzzz (not an event!)'].iloc[0] == 'Typo (0)'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        t.fit(1)
    msgs = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("'after_bacth'" in m and "never run" in m and "did you mean 'after_batch'?" in m for m in msgs), msgs
    assert any("'before_zzzzzz'" in m and "never run" in m for m in msgs), msgs


def test_default_hooks_are_recorder_progress_liveplot_runrecorder(make_trainer):
    from trainer_nb.recorder import Recorder
    from trainer_nb.progress import Progress
    from trainer_nb.liveplot import LivePlot
    from trainer_nb.runs import RunRecorder
    t = make_trainer(default_hooks=True)
    assert [type(h) for h in t.hooks] == [Recorder, Progress, LivePlot, RunRecorder]
    assert [type(h) for h in make_trainer(default_hooks=False).hooks] == []


def test_main_process_hook_runs_in_single_process(make_trainer):
    class Count(MainProcessHook):
        def __init__(self): self.n = 0
        def after_batch(self): self.n += 1
    c = Count()
    t = make_trainer(n=24, bs=8, hooks=[c])
    assert t.is_main_process
    t.fit(2)
    assert c.n == 6


def test_print_metrics_one_line_per_epoch(make_trainer, capsys):
    t = make_trainer(n=16, bs=8, valid=8, hooks=[PrintMetrics()], metrics=[lambda p, y: (p - y).abs().mean()])
    assert [type(h) for h in t.hooks] == [PrintMetrics]
    t.fit(3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        assert line.startswith(f"epoch {i + 1}  train_loss ") and ' valid_loss ' in line and ' <lambda> ' in line


# ---- hooks management ----

def test_add_get_remove_hooks(make_trainer):
    class A(Hook): pass
    class B(Hook): pass
    t = make_trainer(hooks=[A, B()])                       # classes are instantiated
    a = t.get_hook(A)
    assert isinstance(a, A) and a.trainer is t
    with pytest.raises(LookupError): t.add_hooks(A()).get_hook(A)
    t.remove_hooks(A)
    with pytest.raises(LookupError): t.get_hook(A)
    with pytest.raises(ValueError): t.remove_hooks(A)
    with pytest.raises(TypeError, match='Hook'): t.add_hooks(object())
    class AddDuring(Hook):
        def before_fit(self): self.trainer.add_hooks(A())
    t.add_hooks(AddDuring())
    with pytest.raises(RuntimeError, match="while fit is running"): t.fit(1)


# ---- counters and the loss log ----

def test_counters_and_loss_log(make_trainer):
    class Losses(Hook):
        def __init__(self): self.seen = []
        def after_loss(self): self.seen.append(self.trainer.loss.item())
    h = Losses()
    t = make_trainer(n=50, bs=8, hooks=[h], sync_every=3)      # 7 batches, the last of 2 samples
    t.fit(2)
    s = t.state
    assert (s.epoch, s.epochs, s.n_batches, s.iteration, s.step, s.samples) == (2, 2, 7, 14, 14, 100)
    vals = t.losses.values
    assert len(t.losses) == len(vals) == 14 and not vals.requires_grad and vals.device.type == 'cpu'
    torch.testing.assert_close(vals, torch.tensor(h.seen))
    assert t.epoch_results['train_loss'] == pytest.approx(sum(h.seen[7:]) / 7, rel=1e-5)


@pytest.mark.parametrize('event', ['before_batch', 'after_pred', 'after_loss', 'after_backward'])
def test_loss_log_keeps_a_place_for_cancelled_batches(make_trainer, event):
    "trainer.losses stays indexed by iteration: a batch cancelled before its loss holds a NaN, and no error follows."
    t = make_trainer(n=40, bs=4, hooks=[RaiseAt(event, CancelBatch, when=lambda s: s.iteration == 2)])
    t.fit(1)
    vals = t.losses.values
    assert len(vals) == t.state.iteration == 10
    assert torch.isnan(vals[2]).item() is (event != 'after_backward')
    assert torch.isfinite(vals[[0, 1, *range(3, 10)]]).all()
    finite = vals[torch.isfinite(vals)]
    assert t.epoch_results['train_loss'] == pytest.approx(finite.mean().item(), rel=1e-6)


@pytest.mark.parametrize('exc', [CancelFit, KeyboardInterrupt])
def test_loss_log_kept_when_fit_stops(make_trainer, exc):
    t = make_trainer(n=40, bs=4, hooks=[RaiseAt('after_batch', exc, when=lambda s: s.iteration == 3)])
    try: t.fit(1)
    except KeyboardInterrupt: pass
    assert len(t.losses.values) == t.state.iteration == 3
