"""Stop and continue: the stop button (a real SIGINT, raised in this process) or `trainer.stop()` ends a fit after a
batch, and `trainer.resume()` continues it in memory to the very weights of an uninterrupted fit."""
import signal

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import regression_ds

from trainer_nb.base import Hook
from trainer_nb.core import FitStopped, Trainer
from trainer_nb.recorder import Recorder

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Dropout(torch.nn.Module):
    "A small MLP with dropout: its forward draws from torch's generator, which the resumed fit must continue."
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))
    def forward(self, x): return self.net(x)


class LRs(Hook):
    "Each optimizer step's LR and first momentum (a saw-tooth schedule would show here)."
    def __init__(self): self.seen = []
    def after_step(self):
        g = self.trainer.opt.param_groups[0]
        self.seen.append((self.trainer.state.step, g['lr'], g['betas'][0]))


class StopAt(Hook):
    "Asks for a stop at the given iterations (after their batch, by `how`: 'api' calls `stop()`, 'signal' a SIGINT)."
    def __init__(self, at, event='after_batch', how='api'):
        self.at, self.how = set(at), how
        setattr(self, event, self._maybe)
    def _maybe(self):
        t = self.trainer
        if t.state.iteration in self.at:
            self.at.discard(t.state.iteration)
            if self.how == 'api': t.stop()
            else:
                signal.raise_signal(signal.SIGINT)
                handled()
                assert t.stopping


def trainer(grad_accum=1, hooks=(), n=40):
    "A trainer on shuffled data (the global generator draws the order), with a one-cycle-able optimizer."
    torch.manual_seed(0)
    dl = DataLoader(regression_ds(n), batch_size=4, shuffle=True)
    valid = DataLoader(regression_ds(12, seed=1), batch_size=4)
    return Trainer(Dropout(), dl, valid, loss_func=F.mse_loss, default_hooks=False, grad_accum=grad_accum,
                   hooks=[LRs(), Recorder(), *hooks])


def weights(t): return [p.detach().clone() for p in t.model.parameters()]


def fit(t, how):
    if how == 'one_cycle': t.fit_one_cycle(3, lr_max=1e-2)
    elif how == 'max_steps': t.fit_cosine(lr=1e-2, max_steps=23, eval_every=7)
    else: t.fit(3, lr=1e-2)


def history(t): return t.history.drop(columns=['time']).to_dict('records')


@pytest.mark.parametrize('how, grad_accum, at', [
    ('one_cycle', 1, [13]),          # mid-epoch
    ('one_cycle', 2, [13]),          # mid-group: the stop waits for the group's end (batch 14)
    ('one_cycle', 1, [10, 25]),      # at an epoch's last batch, then again in the resumed fit
    ('plain', 1, [4]),
    ('max_steps', 1, [9, 16]),
])
def test_stop_then_resume_is_bitwise_equal(how, grad_accum, at):
    ref = trainer(grad_accum)
    fit(ref, how)
    t = trainer(grad_accum, [StopAt(at)])
    with pytest.raises(FitStopped, match=r"Stopped at epoch \d of \d, batch \d+ of 10 .*trainer\.resume\(\) con"):
        fit(t, how)
    stops = [t.state.iteration]
    assert t.cancelled.resumable and t.stopping
    if grad_accum > 1: assert t.state.iteration % grad_accum == 0   # at a group's end
    torch.randn(100)                      # what a person might do between the two cells: draw random numbers,
    t.evaluate()                          # evaluate...
    groups = lambda t: [(g['lr'], g['betas']) for g in t.opt.param_groups]
    assert groups(t) == groups(ref)   # the stopped fit's door put back the base LR and momentum, as at a fit's end
    while True:
        try:
            t.resume()
            break
        except FitStopped:
            stops.append(t.state.iteration)
    assert len(stops) == len(at)
    assert all(torch.equal(a, b) for a, b in zip(weights(t), weights(ref)))
    assert t.get_hook(LRs).seen == ref.get_hook(LRs).seen   # one schedule, step by step: no saw-tooth
    assert history(t) == history(ref)
    assert t.state.iteration == ref.state.iteration and t.state.step == ref.state.step
    assert t.losses.slice(0, len(t.losses)).tolist() == ref.losses.slice(0, len(ref.losses)).tolist()
    assert groups(t) == groups(ref)
    with pytest.raises(RuntimeError, match='Nothing to resume'):
        t.resume()


def test_real_sigint_stops_after_the_batch():
    "A real SIGINT: the batch it came in ends, the fit stops, the handler before fit is back; resume finishes."
    ref = trainer()
    fit(ref, 'one_cycle')
    before = signal.getsignal(signal.SIGINT)
    t = trainer(hooks=[StopAt([7], event='after_pred', how='signal')])   # inside the 8th batch, before its backward
    with pytest.raises(FitStopped) as info:
        fit(t, 'one_cycle')
    assert signal.getsignal(signal.SIGINT) is before
    assert info.value.resumable and t.state.iteration == 8 and t.state.step == 8   # that batch done, with its step
    assert str(info.value) == ("Stopped at epoch 1 of 3, batch 8 of 10 (step 8 of 30). "
                               "trainer.resume() continues this fit.")
    assert info.value._render_traceback_() == ['\x1b[0;31mFitStopped\x1b[0m: ' + str(info.value)]
    t.resume()
    assert all(torch.equal(a, b) for a, b in zip(weights(t), weights(ref)))
    assert signal.getsignal(signal.SIGINT) is before


def handled():
    "Nothing: a call of a Python function, where the interpreter runs the Python handlers of signals that arrived."

class PressTwice(Hook):
    "Two SIGINTs inside one batch (after its forward pass): the second one stops the fit there."
    def after_pred(self):
        if self.trainer.state.iteration == 5:
            signal.raise_signal(signal.SIGINT)
            handled()
            assert self.trainer.stopping
            signal.raise_signal(signal.SIGINT)
            handled()
            raise AssertionError("not reached: the second press raises")


def test_second_press_stops_at_once_and_refuses_resume():
    before = signal.getsignal(signal.SIGINT)
    t = trainer(hooks=[PressTwice()])
    w0 = weights(t)
    with pytest.raises(FitStopped, match=r"Interrupted inside batch 6 of epoch 1 \(the stop button pressed twice\)"
                       ) as info:
        fit(t, 'one_cycle')
    assert not info.value.resumable and info.value.__cause__ is None and info.value.__suppress_context__
    assert signal.getsignal(signal.SIGINT) is before
    assert t.state.iteration == 5 and len(t.losses) == 5    # the cut batch is not counted, its loss not kept
    assert all(p.grad is None for p in t.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(weights(t), w0))   # the 5 batches before it trained
    with pytest.raises(RuntimeError, match='interrupted inside a batch'):
        t.resume()
    t.remove_hooks(PressTwice)
    t.fit(1)    # a new fit trains as usual
    assert t.state.iteration == 15 and t.cancelled is None


def test_nothing_to_resume(make_trainer):
    t = make_trainer()
    with pytest.raises(RuntimeError, match=r"Nothing to resume\. trainer\.resume\(\) continues a fit that the stop"):
        t.resume()
    t.fit(1)
    with pytest.raises(RuntimeError, match='Nothing to resume'):
        t.resume()


def test_new_fit_forgets_the_stopped_one(make_trainer):
    t = make_trainer(hooks=[StopAt([2])])
    with pytest.raises(FitStopped):
        t.fit(2)
    t.fit(1)   # a new fit: the stopped one is gone
    with pytest.raises(RuntimeError, match='Nothing to resume'):
        t.resume()


@pytest.mark.filterwarnings('ignore:lr_find')
def test_lr_find_between_stop_and_resume_keeps_the_stopped_fit():
    "lr_find puts the trainer back as it was, the stopped fit included: resume still ends as an uninterrupted fit."
    ref = trainer()
    fit(ref, 'one_cycle')
    t = trainer(hooks=[StopAt([13])])
    with pytest.raises(FitStopped):
        fit(t, 'one_cycle')
    t.lr_find(num_it=5, show=False)
    t.resume()
    assert all(torch.equal(a, b) for a, b in zip(weights(t), weights(ref)))


def test_stop_in_limit_batches_resumes_with_the_same_batches(make_trainer):
    t = make_trainer(hooks=[StopAt([1])])
    with pytest.raises(FitStopped, match=r'Stopped at epoch 1 of 3, batch 1 of 2 \(step 1 of 6\)'):
        t.fit(3, limit_batches=2)
    t.resume()    # the same two batches an epoch, not the whole train_dl
    assert t.state.iteration == 6 and t.state.epoch == 3 and len(t.train_dl) == 6


def test_stop_inside_lr_find_says_nothing_to_resume(make_trainer):
    "lr_find undoes its sweep, so a stop there leaves nothing to resume, and says so (a fit stopped before stays)."
    t = make_trainer(hooks=[StopAt([2])])
    with pytest.raises(FitStopped):
        t.fit(2)
    calls = []
    class StopsInForward(torch.nn.Module):   # the sweep runs no hook of the trainer's: the model asks for the stop
        def __init__(self, net):
            super().__init__()
            self.net = net
        def forward(self, x):
            calls.append(1)
            if len(calls) == 3: t.stop()
            return self.net(x)
    with t.temporary(model=StopsInForward(t.model)):
        with pytest.raises(FitStopped, match='put back as it was before .*nothing to resume') as info:
            t.lr_find(num_it=20, show=False)
    assert not info.value.resumable and len(calls) == 3
    t.resume()   # the fit stopped before the sweep
    assert t.state.iteration == 12


class Fails(Hook):
    def after_batch(self):
        assert signal.getsignal(signal.SIGINT) is not self.before   # the fit's own handler, during the fit
        raise ValueError('boom')


def test_handler_put_back_when_fit_fails(make_trainer):
    fails = Fails()
    fails.before = signal.getsignal(signal.SIGINT)
    t = make_trainer(hooks=[fails])
    with pytest.raises(ValueError, match='boom'):
        t.fit(1)
    assert signal.getsignal(signal.SIGINT) is fails.before


def test_fit_in_another_thread_installs_no_handler_and_stop_works(make_trainer):
    "Signals reach the main thread only: a fit in another thread leaves the handler alone; `stop()` still stops it."
    import threading
    before, seen, out = signal.getsignal(signal.SIGINT), [], {}
    class Look(Hook):
        def after_batch(self): seen.append(signal.getsignal(signal.SIGINT))
    t = make_trainer(hooks=[Look(), StopAt([3])])
    def run():
        try: t.fit(2)
        except FitStopped as e: out['e'] = e
    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert out['e'].resumable and t.state.iteration == 3 and seen and all(h is before for h in seen)
    th = threading.Thread(target=t.resume)
    th.start()
    th.join()
    assert t.state.iteration == 12 and t.cancelled is None
