"""Fits beside the notebook (`background=True`): the same numbers as in the foreground, a stop, a pause, an LR change
(recorded, checkpointed, exact after SIGKILL), errors and refusals. Waits on the trainer's events, never on time."""
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from conftest import REPO, regression_ds
from test_stop import Dropout, LRs, weights

from trainer_nb.base import Hook
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.monitor import MetricsLog, read_metrics
from trainer_nb.core import FitStopped, Trainer
from trainer_nb.recorder import Recorder

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def trainer(grad_accum=1, hooks=(), n=80):
    torch.manual_seed(0)
    dl = DataLoader(regression_ds(n), batch_size=4, shuffle=True)
    valid = DataLoader(regression_ds(12, seed=1), batch_size=4)
    return Trainer(Dropout(), dl, valid, loss_func=F.mse_loss, default_hooks=False, grad_accum=grad_accum,
                   hooks=[LRs(), Recorder(), *hooks])


def same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(weights(a), weights(b)))
    assert a.losses.slice(0, len(a.losses)).tolist() == b.losses.slice(0, len(b.losses)).tolist()
    assert a.history.drop(columns=['time']).to_dict('records') == b.history.drop(columns=['time']).to_dict('records')
    assert a.get_hook(LRs).seen == b.get_hook(LRs).seen


@pytest.mark.parametrize('how', ['one_cycle', 'accum', 'checkpoint'])
def test_background_fit_is_bitwise_the_foreground_fit(how, tmp_path):
    kw = dict(grad_accum=2) if how == 'accum' else {}
    extra = lambda d: [Checkpoint(tmp_path / d, monitor=None)] if how == 'checkpoint' else []
    ref = trainer(**kw, hooks=extra('ref'))
    ref.fit_one_cycle(3, 1e-2)
    t = trainer(**kw, hooks=extra('bg'))
    assert t.fit_one_cycle(3, 1e-2, background=True) is None and t.running
    assert t.wait() is None and not t.running
    same(t, ref)


class Gate(Hook):
    "Holds the fit at iteration `at` until the test lets it go: a fixed point to ask things at."
    def __init__(self, at): self.at, self.reached, self.go = at, threading.Event(), threading.Event()
    def after_batch(self):
        if self.trainer.state.iteration == self.at:
            self.reached.set()
            self.go.wait()


def test_stop_from_another_thread_then_resume_in_the_background():
    ref = trainer()
    ref.fit_one_cycle(3, 1e-2)
    t = trainer(hooks=[gate := Gate(7)])
    t.fit_one_cycle(3, 1e-2, background=True)
    gate.reached.wait()
    t.stop()
    gate.go.set()
    with pytest.raises(FitStopped, match=r"batch 7 of 20 .*trainer\.resume\(\) continues"):
        t.wait()
    assert t.state.iteration == 7 and not t.running
    t.resume(background=True)
    t.wait()
    same(t, ref)


def test_a_pause_changes_nothing_whatever_the_user_does_in_it():
    ref = trainer()
    ref.fit_one_cycle(3, 1e-2)
    t = trainer(hooks=[gate := Gate(5)])
    t.fit_one_cycle(3, 1e-2, background=True)
    gate.reached.wait()
    with pytest.raises(RuntimeError, match=r"Can't evaluate: fit_one_cycle is running in the background.*paused"):
        t.evaluate()
    gate.go.set()
    with t.paused():
        assert t.held is not None and t.state.iteration >= 5
        at = t.state.iteration
        t.evaluate()                       # eval mode, its own loader
        torch.randn(100)                   # the global generator
        next(iter(t.train_dl))             # the training loader's order
        t.model.eval()
    assert t.held is None
    t.wait()
    assert t.state.iteration > at
    same(t, ref)
    assert t.paused_seconds > 0


def test_refusals_say_what_to_do():
    t = trainer(hooks=[gate := Gate(3)])
    t.fit(2, lr=1e-2, background=True)
    gate.reached.wait()
    for call, what in [(lambda: t.fit(1), 'start a fit'), (lambda: t.fit_one_cycle(1, background=True),
                       'start fit_one_cycle'), (lambda: t.add_hooks(Recorder()), 'add hooks'),
                       (lambda: t.predict(t.valid_dl), 'predict')]:
        with pytest.raises(RuntimeError, match=rf"Can't {what}: fit is running in the background.*trainer\.wait\(\)"):
            call()
    with pytest.raises(ValueError, match='lr must be a positive number'):
        t.set(lr=-1)
    gate.go.set()
    t.wait()
    t.fit(1, lr=1e-2)   # free again


class Boom(Hook):
    def after_batch(self):
        if self.trainer.state.iteration == 4: raise ZeroDivisionError('boom')


def test_wait_raises_the_fits_own_error_with_its_note(capfd):
    t = trainer(hooks=[Boom()])
    t.fit(2, lr=1e-2, background=True)
    with pytest.raises(ZeroDivisionError, match='boom') as info:
        t.wait()
    note = ' '.join(getattr(info.value, '__notes__', [])) + str(info.value)
    assert 'Boom' in note and 'after_batch' in note
    assert 'ZeroDivisionError' in capfd.readouterr().err   # shown where the fit runs, waited on or not


class SetAt(Hook):
    "Calls `trainer.set(lr=to)` at iteration `at` (from the fit's thread: taken at the boundary, as any request)."
    def __init__(self, at, to): self.at, self.to = at, to
    def after_batch(self):
        if self.trainer.state.iteration == self.at: self.trainer.set(lr=self.to)


def test_set_lr_rescales_the_schedule_from_the_next_step():
    ref = trainer()
    ref.fit_one_cycle(2, 1e-2)
    t = trainer(hooks=[SetAt(9, 2e-3)])
    t.fit_one_cycle(2, 1e-2, background=True)
    t.wait()
    (c,) = t.changes
    assert (c['step'], c['name'], c['new']) == (9, 'lr', 2e-3)
    lr, lr_ref = [s[1] for s in t.get_hook(LRs).seen], [s[1] for s in ref.get_hook(LRs).seen]
    assert lr[:9] == lr_ref[:9] and lr[9] == pytest.approx(2e-3 * lr_ref[9] / lr_ref[8], rel=1e-9)
    ratios = [a / b for a, b in zip(lr[9:], lr_ref[9:])]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9) and ratios[0] == pytest.approx(2e-3 / c['old'])


def test_two_trainers_in_the_background_at_once():
    def mk(seed):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return Trainer(m, DataLoader(regression_ds(64, seed=seed), batch_size=4, shuffle=True, generator=g),
                       loss_func=F.mse_loss, default_hooks=False)
    refs = [mk(s) for s in (1, 2)]
    for r in refs: r.fit(3, lr=1e-2)
    ts = [mk(s) for s in (1, 2)]
    for t in ts: t.fit(3, lr=1e-2, background=True)
    for t, r in zip(ts, refs):
        t.wait()
        assert all(torch.equal(a, b) for a, b in zip(t.model.parameters(), r.model.parameters()))


class Lockstep(Hook):
    "The first `rounds` batches of each fit in lockstep with the other's (a barrier after each): both mid-group at once."
    def __init__(self, barrier, rounds): self.barrier, self.rounds, self.n = barrier, rounds, 0
    def after_batch(self):
        if self.n < self.rounds:
            self.n += 1
            self.barrier.wait(timeout=120)


def accumulating(seed, grad_accum, hooks=()):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return Trainer(m, DataLoader(regression_ds(60, seed=seed), batch_size=4, shuffle=True, generator=g),
                   loss_func=F.mse_loss, default_hooks=False, grad_accum=grad_accum, hooks=[Recorder(), *hooks])


@pytest.mark.parametrize('second', ['background', 'foreground'])
def test_two_accumulating_fits_at_once_each_as_alone(second):
    """Two trainers accumulating over groups of 2 and of 3 batches (15 a epoch: a last, shorter group), their batches
    in lockstep: each keeps its own group (where it stands, its divisor), and ends bitwise as its fit alone."""
    refs = [accumulating(s, k) for s, k in ((1, 2), (2, 3))]
    for r in refs: r.fit(2, lr=1e-2)
    barrier = threading.Barrier(2)
    ts = [accumulating(s, k, [Lockstep(barrier, 25)]) for s, k in ((1, 2), (2, 3))]
    ts[0].fit(2, lr=1e-2, background=True)
    if second == 'background':
        ts[1].fit(2, lr=1e-2, background=True)
        ts[1].wait()
    else: ts[1].fit(2, lr=1e-2)
    ts[0].wait()
    for t, r in zip(ts, refs):
        assert t.state.step == r.state.step == 2 * -(-15 // t.grad_accum)
        assert all(torch.equal(a, b) for a, b in zip(t.model.parameters(), r.model.parameters()))
        assert t.losses.slice(0, len(t.losses)).tolist() == r.losses.slice(0, len(r.losses)).tolist()
        assert all(p.grad is None for p in t.model.parameters())
    assert not any(h.barrier.broken for t in ts for h in t.hooks if isinstance(h, Lockstep))


def run(cfg):
    p = subprocess.run([sys.executable, str(REPO / 'tests' / 'bg_script.py'), json.dumps(cfg)], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    return p


@pytest.mark.usefixtures('on_the_cpu')
def test_an_lr_change_survives_sigkill_bitwise(tmp_path):
    "Changed at iteration 15 (mid-epoch 2), killed at 20: the resume holds the change, and ends bitwise as without kill."
    base = {'change_at': 15, 'to': 3e-3, 'background': True}
    ref = run({**base, 'dir': str(tmp_path / 'ref'), 'out': str(tmp_path / 'ref')})
    assert ref.returncode == 0, ref.stderr
    d, out = str(tmp_path / 'run'), str(tmp_path / 'run')
    p = run({**base, 'dir': d, 'out': out, 'kill_at': 20})
    assert p.returncode == -signal.SIGKILL, p.stderr
    p = run({'dir': d, 'out': out, 'resume': 'last', 'background': True})
    assert p.returncode == 0, p.stderr
    a, b = load_file(out + '.st'), load_file(str(tmp_path / 'ref') + '.st')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    changes = json.load(open(out + '.json'))['changes']
    assert changes == json.load(open(str(tmp_path / 'ref') + '.json'))['changes'] and changes[0]['step'] == 15
    df = read_metrics(tmp_path / 'run')
    logged = df[df['kind'] == 'change']
    assert list(zip(logged['step'], logged['new'])) == [(15, 3e-3)]   # written once, before the kill


def test_lr_find_in_the_background_then_a_fit_waits_for_it(capsys):
    ref = trainer()
    ref_res = ref.lr_find(show=False, num_it=30)
    ref.fit_one_cycle(1, 1e-2)
    t = trainer()
    t.lr_find(show=False, num_it=30, background=True)
    with t.paused():   # held inside the sweep: a fit asked now has to wait for the finder
        assert t.running and t.background.what == 'lr_find'
        fitting = threading.Thread(target=t.fit_one_cycle, args=(1, 1e-2))   # (a door that changes the trainer first)
        fitting.start()
        said, deadline = '', time.monotonic() + 120   # (the fit's thread says it waits, then waits for the finder)
        while 'Waiting for the LR finder' not in said and time.monotonic() < deadline:
            said += capsys.readouterr().out
            threading.Event().wait(0.01)
        assert 'Waiting for the LR finder running in the background to end first' in said, said
    fitting.join()       # the finder ended (the trainer put back as it was), then the fit ran
    res = t.wait()       # the finder's result
    assert res.lrs == ref_res.lrs and res.losses == ref_res.losses
    assert all(torch.equal(a, b) for a, b in zip(weights(t), weights(ref)))


def test_in_a_script_the_same_api_with_text_progress(tmp_path):
    "A script (no notebook): `background=True` runs the fit in a thread, its progress as text, `wait()` its outcome."
    code = """
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
torch.manual_seed(0)
x = torch.randn(64, 4); y = x.sum(1, keepdim=True)
t = Trainer(torch.nn.Linear(4, 1), DataLoader(TensorDataset(x, y), batch_size=8), loss_func=F.mse_loss)
t.fit(2, lr=0.1, background=True)
print('RETURNED', t.running)
t.wait()
print('DONE', t.state.step, t.running)
t.attach()
"""
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**__import__('os').environ, 'PYTHONPATH': str(REPO)})
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert 'RETURNED True' in p.stdout and 'DONE 16 False' in p.stdout
    assert 'epoch' in out and 'train_loss' in out   # the text progress's table, from the fit's thread
    assert 'fit, done: 2 of 2 epochs done, step 16 (its progress is text' in p.stdout


def test_the_fits_thread_uses_the_notebooks_thread_count():
    "torch's thread count holds per thread: the fit's thread takes the starting cell's (another would change sums)."
    before = torch.get_num_threads()
    seen = []
    class Threads(Hook):
        def before_fit(self): seen.append(torch.get_num_threads())
    try:
        torch.set_num_threads(1)
        t = trainer(hooks=[Threads()])
        t.fit(1, lr=1e-2, background=True)
        t.wait()
        assert seen == [1] and t.background.threads == 1
    finally: torch.set_num_threads(before)


def test_a_pause_counts_in_no_clock():
    """Timing's, Profiler's and Progress's clocks skip a pause (`after_pause`): held a second at step 5 of a fit whose
    loader never waits that long, none of them shows the second as data wait or wall time."""
    import io, time
    from trainer_nb.hooks import Profiler, Timing
    from trainer_nb.progress import Progress
    timing, prof, prog = Timing(), Profiler(), Progress(mode='text', file=io.StringIO())
    t = trainer(hooks=[gate := Gate(5), timing, prof, prog], n=40)
    t0 = time.perf_counter()
    t.fit(1, background=True)
    gate.reached.wait()
    gate.go.set()
    with t.paused():
        time.sleep(1.0)   # (the pause's length: what the clocks must leave out)
    t.wait()
    outer, r = time.perf_counter() - t0, t.timing
    assert t.paused_seconds >= 1.0
    assert r['wall'] <= outer - t.paused_seconds and r['data_wait'] < 0.5, (r, outer)
    assert prof.records[0]['data_wait'] < 0.9, prof.records   # (not skipped: the second, against 10 fast batches)
    assert prog.snapshot()['elapsed'] <= outer - t.paused_seconds


# ---- one pool of threads: the kernel's idle team of torch threads let go while a fit trains beside it ----

POOL_SETUP = """\
import os, sys, threading, time
sys.path.insert(0, {repo!r})
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook
from trainer_nb.background import release_thread_pool
from trainer_nb.core import Trainer
torch.set_num_threads(2)
def n_threads(): return len(os.listdir('/proc/self/task'))
def until(cond, seconds=60):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline: time.sleep(0.01)
    return cond()
class Gate(Hook):
    "At iteration 2, after a parallel operation in the fit's thread (its team made), hold until `go`."
    def __init__(self): self.reached, self.go = threading.Event(), threading.Event()
    def after_batch(self):
        if self.trainer.state.iteration == 2:
            torch.ones(2000, 2000).sum()
            self.reached.set()
            self.go.wait()
x = torch.randn(64, 8)
gate = Gate()
t = Trainer(torch.nn.Linear(8, 8), DataLoader(TensorDataset(x, x), batch_size=16), loss_func=F.mse_loss,
            default_hooks=False, hooks=[gate])
"""


def pool_script(body: str) -> str:
    return POOL_SETUP.format(repo=str(REPO)) + body


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='counts the threads in /proc')
def test_starting_a_background_fit_lets_the_starters_torch_threads_go():
    """The thread that starts a background fit (the kernel's) lets its idle team of torch threads go, so that the fit's
    team is the only one (libgomp then keeps spinning between parallel regions: the foreground's speed). Counted as the
    process's threads while the fit holds: the fit's thread and its one extra team thread in, the starter's out."""
    p = subprocess.run([sys.executable, '-c', pool_script("""
if not release_thread_pool(): print('NO GOMP'); sys.exit(0)
torch.ones(2000, 2000).sum()   # the main thread's team of 2: one more thread
before = n_threads()
t.fit(1, lr=1e-2, background=True)
assert gate.reached.wait(60)
print('LET GO', until(lambda: n_threads() == before + 1), before, n_threads())
gate.go.set()
t.wait()
""")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    if 'NO GOMP' in p.stdout: pytest.skip("torch does not run on libgomp here")
    assert 'LET GO True' in p.stdout, p.stdout


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='counts the threads in /proc')
def test_a_cell_that_runs_torch_beside_a_background_fit_lets_its_threads_go_after(tmp_path, monkeypatch):
    """In a real kernel: a cell that runs torch work while a fit trains in the background wakes the kernel's team of
    threads; when the cell ends it is let go again (IPython's post_run_cell), and the fit keeps the cores."""
    from test_browser import run_nbclient
    nb = run_nbclient(tmp_path, monkeypatch, [
        pool_script("gomp = release_thread_pool()\nt.fit(1, lr=1e-2, background=True)\nassert gate.reached.wait(60)"),
        "torch.ones(2000, 2000).sum()\nduring = n_threads()",
        "print('GOMP', gomp, 'LET GO', until(lambda: n_threads() == during - 1), during, n_threads())\n"
        "gate.go.set()\nt.wait()\nprint('DONE', t.state.iteration)"])
    text = ''.join(o.get('text', '') for c in nb.cells for o in c.get('outputs', []))
    if 'GOMP False' in text: pytest.skip("torch does not run on libgomp here")
    assert 'GOMP True LET GO True' in text and 'DONE 4' in text, text
