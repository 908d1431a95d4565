"""Checkpoints: exact resume after SIGKILL (subprocesses), kills while saving, SIGTERM/SIGINT, hostile and broken
checkpoints, tied weights, rotation, the run directory's lock, early stopping, metrics.jsonl."""
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from conftest import REPO, flat, regression_ds, small_model

SCRIPT = str(REPO / 'tests' / 'ckpt_script.py')
pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def run(cfg, timeout=120):
    p = subprocess.run([sys.executable, SCRIPT, json.dumps(cfg)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return p


def report(p):
    line = [l for l in p.stdout.splitlines() if l.startswith('REPORT')]
    return json.loads(line[-1][len('REPORT '):]) if line else None


def assert_same(out_a, out_b):
    "Bitwise equal weights; equal counters, per-step records, epoch table and metrics.jsonl lines."
    wa, wb = load_file(out_a + '.safetensors'), load_file(out_b + '.safetensors')
    assert wa.keys() == wb.keys()
    for k in wa: assert torch.equal(wa[k], wb[k]), k
    ra, rb = json.load(open(out_a + '.json')), json.load(open(out_b + '.json'))
    assert ra['state'] == rb['state']
    assert pd.DataFrame(ra['steps']).equals(pd.DataFrame(rb['steps']))
    assert pd.DataFrame(ra['history']).equals(pd.DataFrame(rb['history']))
    ma, mb = pd.DataFrame(ra['metrics']), pd.DataFrame(rb['metrics'])
    assert ma.equals(mb)
    train_steps = list(mb[mb.kind == 'train'].step)
    assert train_steps == sorted(set(train_steps))   # no duplicated step in the log
    return ra, rb


_refs = {}
def reference(tmp_path_factory, **cfg):
    "An uninterrupted run with no Checkpoint hook (cached per configuration)."
    key = json.dumps(cfg, sort_keys=True)
    if key not in _refs:
        d = tmp_path_factory.mktemp('ref')
        p = run({**cfg, 'dir': str(d), 'out': str(d / 'out'), 'ckpt': False})
        assert p.returncode == 0, p.stderr
        _refs[key] = str(d / 'out')
    return _refs[key]


def ckpt_iteration(path) -> int:
    return json.loads((path / 'trainer_state.json').read_text())['state']['iteration']


@pytest.mark.parametrize('accum,sched,every,seed', [  # (make test-quick runs one_cycle: accumulation and a schedule)
    pytest.param(1, 'none', 1, 0, id='plain', marks=pytest.mark.slow),
    pytest.param(3, 'none', 2, 3, id='grad_accum', marks=pytest.mark.slow),
    pytest.param(2, 'onecycle', 3, 7, id='one_cycle'),
    pytest.param(1, 'fit_one_cycle', 2, 11, id='fit_one_cycle_resume', marks=pytest.mark.slow)])
@pytest.mark.usefixtures('on_the_cpu')
def test_sigkill_then_resume_is_bitwise_exact(tmp_path, tmp_path_factory, accum, sched, every, seed):
    from trainer_nb.checkpoint import list_checkpoints
    cfg = {'epochs': 3, 'accum': accum, 'sched': sched}
    # the reference uses fit_one_cycle; the interrupted run the same schedule through scheduler=one_cycle(),
    # or fit_one_cycle(..., resume='last') itself
    ref = reference(tmp_path_factory, **{**cfg, 'sched': 'fit_one_cycle' if sched == 'onecycle' else sched})
    kill_at = random.Random(seed).randint(13, 33)   # 36 batches in all: 12 per epoch, shuffled, with dropout
    d, out = tmp_path / 'run', str(tmp_path / 'out')
    p = run({**cfg, 'dir': str(d), 'out': out, 'kill_at': kill_at, 'every_steps': every})
    assert p.returncode == -signal.SIGKILL, p.stderr
    last = list_checkpoints(d)[-1]
    done = ckpt_iteration(last)
    assert 0 < done <= kill_at
    assert json.loads((last / 'trainer_state.json').read_text())['position'][1] > 0   # it resumes mid-epoch
    p = run({**cfg, 'dir': str(d), 'out': out, 'resume': 'last', 'every_steps': every})
    assert p.returncode == 0, p.stderr
    assert report(p)['batches_run'] == 36 - done   # it really continued from the checkpoint, not from scratch
    ra, rb = assert_same(ref, out)
    assert rb['state']['iteration'] == 36 and rb['state']['step'] == 3 * -(-12 // accum)


def saving(d, p):
    "Return as soon as a save of the run in `d` is under way (its `.tmp-step-` directory exists), or `p` has ended."
    while p.poll() is None:
        if d.is_dir() and any(x.name.startswith('.tmp-step-') for x in os.scandir(d)): return
        time.sleep(0.0005)


@pytest.mark.slow
@pytest.mark.usefixtures('on_the_cpu')
def test_kill_repeatedly_while_saving(tmp_path, tmp_path_factory):
    "A model large enough that saving takes most of the time, a save every step, SIGKILL at random moments."
    from trainer_nb.checkpoint import list_checkpoints
    cfg = {'epochs': 3, 'hidden': 1 << 17, 'every_steps': 1}
    ref = reference(tmp_path_factory, **cfg)
    d, out = tmp_path / 'run', str(tmp_path / 'out')
    rng, mid_save, kills = random.Random(5), 0, 0
    for _ in range(8):
        resume = 'last' if list_checkpoints(d) else None
        p = subprocess.Popen([sys.executable, SCRIPT, json.dumps({**cfg, 'dir': str(d), 'out': out, 'resume': resume,
                                                                 'ready_first': True})],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        line = p.stdout.readline()
        if line.startswith('REPORT') and json.loads(line[7:])['batches_run'] == 0:
            p.wait(); break                # resumed from the final checkpoint: nothing left to train
        if not line.startswith('READY'):   # the resume itself failed
            p.wait(); raise AssertionError(f"no READY: {line!r} {p.stderr.read()}")
        if mid_save or _ % 2 == 0: time.sleep(rng.uniform(0.05, 0.5))   # a random moment
        else: saving(d, p)   # (until one lands there) the moment a save is under way: its temporary directory exists
        p.send_signal(signal.SIGKILL)
        p.communicate()
        if p.returncode == -signal.SIGKILL:
            kills += 1
            mid_save += any(x.name.startswith('.tmp-step-') for x in d.iterdir())
        else: assert p.returncode == 0
    assert kills >= 3 and mid_save >= 1, (kills, mid_save)   # some kills did land in the middle of a save
    p = run({**cfg, 'dir': str(d), 'out': out, 'resume': 'last'})
    assert p.returncode == 0, p.stderr
    assert_same(ref, out)
    assert not any(x.name.startswith(('.tmp-', '.trash-')) for x in d.iterdir())


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('sig', ['SIGTERM', pytest.param('SIGINT', marks=pytest.mark.slow)])
def test_signal_saves_at_step_boundary_and_stops(tmp_path, tmp_path_factory, sig):
    from trainer_nb.checkpoint import list_checkpoints
    cfg = {'epochs': 3, 'accum': 2}
    ref = reference(tmp_path_factory, **cfg)
    d, out = tmp_path / 'run', str(tmp_path / 'out')
    p = subprocess.Popen([sys.executable, SCRIPT, json.dumps({**cfg, 'dir': str(d), 'out': out, 'slow': 0.02,
                                                             'ready_at': 5, 'every_steps': 100})],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout.readline().startswith('READY')
    p.send_signal(getattr(signal, sig))
    stdout, stderr = p.communicate(timeout=60)
    rep = json.loads([l for l in stdout.splitlines() if l.startswith('REPORT')][0][7:])
    exc = 'SystemExit' if sig == 'SIGTERM' else 'KeyboardInterrupt'
    assert rep['events'] == [['after_cancel', exc], ['after_fit', False]]
    if sig == 'SIGTERM': assert p.returncode == 143
    else: assert p.returncode != 0 and 'KeyboardInterrupt: SIGINT: saved' in stderr
    cks = list_checkpoints(d)
    assert [c.name for c in cks] == [rep['last']]   # the one save: the signal's, at a real optimizer step
    st = json.loads((cks[0] / 'trainer_state.json').read_text())
    assert st['state']['iteration'] % 2 == 0 and st['state']['iteration'] >= 6   # a whole accumulation group
    assert not (d / 'LOCK').exists()
    p = run({**cfg, 'dir': str(d), 'out': out, 'resume': 'last'})
    assert p.returncode == 0, p.stderr
    assert_same(ref, out)


# ---- in-process tests ----

def make(tmp_path, hooks=(), model=None, **kw):
    from trainer_nb.core import Trainer
    torch.manual_seed(0)
    kw.setdefault('loss_func', F.mse_loss)
    return Trainer(model or small_model(), DataLoader(regression_ds(48), batch_size=8, shuffle=True),
                   DataLoader(regression_ds(16, seed=1), batch_size=8), hooks=list(hooks), default_hooks=False, **kw)


def test_names_are_optimizer_steps_no_duplicates_under_accumulation(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    ck = Checkpoint(tmp_path, every_steps=1, keep_last=None)
    t = make(tmp_path, [ck], grad_accum=4)   # 6 batches per epoch: steps after batches 4 and 6
    t.fit(2)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f'step-{i:08d}' for i in (1, 2, 3, 4)]
    # step 2 ends epoch 0: the end-of-epoch save replaced the periodic one and records the next epoch's start
    assert json.loads((tmp_path / 'step-00000002' / 'trainer_state.json').read_text())['position'] == [1, 0]
    assert json.loads((tmp_path / 'step-00000001' / 'trainer_state.json').read_text())['position'] == [0, 4]


def test_every_seconds_keep_last_and_best(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.base import Hook
    vals = iter([3., 1., 2., 5.])
    def score(preds, targets): return next(vals)
    ck = Checkpoint(tmp_path, every_seconds=0, keep_last=2, monitor='score', mode='min')
    t = make(tmp_path, [ck], metrics=[score])
    t.fit(4)   # 6 steps per epoch, a save after each (every_seconds=0)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ['step-00000012', 'step-00000023', 'step-00000024']   # the best (epoch 1) and the last two
    assert ck.best.name == 'step-00000012' and json.loads((tmp_path / 'best.json').read_text())['value'] == 1.


def test_load_best_at_end(tmp_path):
    from trainer_nb.checkpoint import Checkpoint
    vals = iter([3., 1., 2.])
    def score(preds, targets): return next(vals)
    t = make(tmp_path, [Checkpoint(tmp_path, monitor='score', load_best_at_end=True)], metrics=[score])
    snaps = []
    from trainer_nb.base import Hook
    class Snap(Hook):
        order = 99
        def after_epoch(self): snaps.append(flat(self.trainer.model))
    t.add_hooks(Snap())
    t.fit(3)
    assert torch.equal(flat(t.model), snaps[1]) and not torch.equal(snaps[1], snaps[2])


HOSTILE = ['optimizer.bin', 'random_states_0.pkl', 'scheduler.bin',
           pytest.param('scaler.pt', marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason='fp16 grad scaler: CUDA only'))]


@pytest.mark.parametrize('victim', HOSTILE)
def test_hostile_pickle_does_not_run(tmp_path, victim):
    """A checkpoint file crafted to run code on load: the code does not run (manifest forged to match). Every file of a
    checkpoint that Accelerate reads with torch.load is among the victims (the scheduler's: one prepared by the user's
    Accelerator; the scaler's: fp16 on CUDA)."""
    from accelerate import Accelerator
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints, seal
    marker = tmp_path / 'pwned'
    class Evil:
        def __reduce__(self): return (os.system, (f'touch {marker}',))
    def trainer():
        acc = Accelerator(mixed_precision='fp16' if victim == 'scaler.pt' else 'no')
        t = make(tmp_path, [Checkpoint(tmp_path / 'run', every_steps=2)], accelerator=acc)
        if victim == 'scheduler.bin': acc.prepare(torch.optim.lr_scheduler.StepLR(t.opt.optimizer, 100))
        return t
    trainer().fit(1)
    last = list_checkpoints(tmp_path / 'run')[-1]
    pickles = {p.name for p in last.iterdir() if p.suffix not in ('.json', '.safetensors')}
    assert victim in pickles and pickles <= {'optimizer.bin', 'random_states_0.pkl', 'scheduler.bin', 'scaler.pt'}
    torch.save({'state': Evil()}, last / victim)
    os.remove(last / 'manifest.json'); seal(last, True)   # an attacker can rewrite the manifest too
    t2 = trainer()
    # refused before anything is loaded, naming the file, with no advice to load it with weights_only=False
    with pytest.raises(ValueError, match=f'{victim} is not a plain tensor file: refusing to load it') as e:
        t2.fit(1, resume='last')
    assert 'weights_only=False' not in str(e.value) and e.value.__cause__ is None and e.value.__suppress_context__
    assert not marker.exists()


def test_register_for_checkpointing_refused(tmp_path):
    "Accelerate reloads registered objects with weights_only=False: saving and resuming with one registered both refuse."
    from accelerate import Accelerator
    from trainer_nb.checkpoint import Checkpoint, save_checkpoint
    class Counter:
        n = 0
        def state_dict(self): return {'n': self.n}
        def load_state_dict(self, d): self.n = d['n']
    make(tmp_path, [Checkpoint(tmp_path / 'run')]).fit(1)
    acc = Accelerator()
    acc.register_for_checkpointing(Counter())
    t = make(tmp_path, [Checkpoint(tmp_path / 'run')], accelerator=acc)
    with pytest.raises(ValueError, match=r'register_for_checkpointing \(Counter\).*weights_only=False'):
        t.fit(1, resume='last')
    with pytest.raises(ValueError, match='register_for_checkpointing'): t.fit(1)
    with pytest.raises(ValueError, match='register_for_checkpointing'): save_checkpoint(t, tmp_path / 'by-hand')
    assert t.state.iteration == 0 and not (tmp_path / 'by-hand').exists() and not (tmp_path / 'run' / 'LOCK').exists()


def test_truncated_checkpoint_clear_error_previous_usable(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    t = make(tmp_path, [Checkpoint(tmp_path, every_steps=2, keep_last=3)])
    t.fit(1)
    cks = list_checkpoints(tmp_path)
    f = cks[-1] / 'model.safetensors'
    f.write_bytes(f.read_bytes()[:-10])
    t2 = make(tmp_path, [Checkpoint(tmp_path)])
    before = flat(t2.model)
    with pytest.raises(ValueError, match=r'model.safetensors has \d+ bytes.*truncated.*previous checkpoint .*step-00000004'):
        t2.fit(1, resume='last')
    assert torch.equal(flat(t2.model), before)   # nothing was loaded
    t2.fit(1, resume=cks[-2])
    assert t2.state.step == 6
    # a flipped byte of the same size: the checksum catches it
    f = cks[-2] / 'optimizer.bin'
    b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 0xFF; f.write_bytes(bytes(b))
    with pytest.raises(ValueError, match='SHA-256'): make(tmp_path).fit(1, resume=cks[-2])


def test_incomplete_newer_checkpoint_is_named_not_skipped_silently(tmp_path):
    "An incomplete checkpoint newer than the one resumed: a warning names it and what it lacks; the resume goes on."
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    make(tmp_path, [Checkpoint(tmp_path, every_steps=2, keep_last=None)]).fit(2)   # 6 steps an epoch
    cks = list_checkpoints(tmp_path)
    assert [c.name for c in cks[-2:]] == ['step-00000010', 'step-00000012']
    (cks[-1] / 'manifest.json').unlink()
    ref = make(tmp_path)
    ref.fit(2)
    t = make(tmp_path, [Checkpoint(tmp_path, every_steps=2, keep_last=None)])
    with pytest.warns(UserWarning, match=r"step-00000012 is newer than step-00000010 but can't be resumed from: it has "
                                         r"no manifest.json .*holding only .*model.safetensors.*Resuming from .*"
                                         r"step-00000010") as w:
        t.fit(2, resume='last')
    assert sum('newer than' in str(x.message) for x in w) == 1
    assert t.state.step == 12 and torch.equal(flat(t.model), flat(ref.model))   # it continued from step 10
    assert (cks[-1] / 'manifest.json').is_file()   # and saved step 12 again, complete


def test_no_complete_checkpoint_names_the_directory_and_what_each_lacks(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    run = tmp_path / 'run'
    make(tmp_path, [Checkpoint(run, every_steps=4, keep_last=2)]).fit(1)
    cks = list_checkpoints(run)
    for c in cks: (c / 'manifest.json').unlink()
    (cks[0] / 'model.safetensors').unlink()
    t = make(tmp_path, [Checkpoint(run)])
    with pytest.raises(FileNotFoundError) as e: t.fit(1, resume='last')
    msg = str(e.value)
    assert f"No complete checkpoint to resume from (resume='last') in {run}: " in msg, msg
    assert all(f"{c.name}: it has no manifest.json" in msg for c in cks), msg
    assert 'model.safetensors' not in msg.split(cks[0].name + ':')[1].split(';')[0]   # what the older one holds
    assert not (run / 'LOCK').exists()
    # a run directory given as a path: the same
    with pytest.raises(FileNotFoundError, match=f"resume='{run}'.*{cks[-1].name}: it has no manifest"):
        make(tmp_path).fit(1, resume=str(run))
    # a directory with no checkpoint at all, and a best.json naming an incomplete one
    empty = tmp_path / 'empty'
    with pytest.raises(FileNotFoundError, match=f"No checkpoint to resume from .* in {empty}: it holds none"):
        make(tmp_path, [Checkpoint(empty)]).fit(1, resume='last')
    (run / 'best.json').write_text(json.dumps({'name': cks[-1].name, 'monitor': 'valid_loss', 'value': 1.0}))
    with pytest.raises(FileNotFoundError, match=f"best.json names {cks[-1].name}, and it has no manifest.json"):
        make(tmp_path, [Checkpoint(run)]).fit(1, resume='best')


@pytest.mark.usefixtures('on_the_cpu')
def test_other_shape_lists_keys(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints, load_weights
    t = make(tmp_path, [Checkpoint(tmp_path)])
    t.fit(1)
    path = list_checkpoints(tmp_path)[-1]
    other = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2), torch.nn.Linear(2, 1))
    with pytest.raises(ValueError) as e: load_weights(other, path)
    msg = str(e.value)
    assert "missing keys" in msg and "'3.weight'" in msg and "2.weight: checkpoint (1, 8), model (2, 8)" in msg
    with pytest.raises(ValueError, match='fit the model'): make(tmp_path, model=other).fit(1, resume=path)
    fewer = torch.nn.Sequential(torch.nn.Linear(5, 8))
    with pytest.raises(ValueError, match=r"unexpected keys.*'2.bias'"): load_weights(fewer, path)
    res = load_weights(fewer, path, strict=False)
    assert torch.equal(fewer[0].weight, t.unwrapped_model[0].weight) and '2.weight' in res.unexpected_keys


# a run holding the lock of a directory, as Checkpoint holds it: an exclusive flock on LOCK, which names the process
HOLD_LOCK = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
if sys.argv[2] == 'write': os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname()}).encode())
print('READY', flush=True)
time.sleep(60)
"""


def hold_lock(d, write=True):
    p = subprocess.Popen([sys.executable, '-c', HOLD_LOCK, str(d / 'LOCK'), 'write' if write else 'no'],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith('READY')
    return p


def test_lock_file(tmp_path):
    from trainer_nb.checkpoint import Checkpoint
    live = hold_lock(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=f'in use by process {live.pid} on '): make(tmp_path, [Checkpoint(tmp_path)]).fit(1)
    finally: live.kill(); live.wait()
    assert json.loads((tmp_path / 'LOCK').read_text())['pid'] == live.pid   # its lock file stays, nobody holds it
    with pytest.warns(UserWarning, match=f'left by process {live.pid}, which is gone'):
        make(tmp_path, [Checkpoint(tmp_path)]).fit(1)
    assert not (tmp_path / 'LOCK').exists()
    # a live run that has taken the lock but not yet written who it is: its empty lock file is not taken for stale
    live = hold_lock(tmp_path, write=False)
    try:
        with pytest.raises(RuntimeError, match='in use by another process'): make(tmp_path, [Checkpoint(tmp_path)]).fit(1)
    finally: live.kill(); live.wait()
    assert (tmp_path / 'LOCK').read_text() == ''


def test_refused_resume_changes_nothing(tmp_path):
    "A second run resuming in a directory whose live run holds the lock is refused before it reads or changes anything."
    from trainer_nb.checkpoint import Checkpoint
    from trainer_nb.monitor import MetricsLog
    make(tmp_path, [MetricsLog(tmp_path, every_steps=2), Checkpoint(tmp_path, every_steps=4)]).fit(2)
    with open(tmp_path / 'metrics.jsonl', 'a') as f: f.write('{"kind": "train", "step": 14}\n')   # the live run goes on
    files = {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()}
    live = hold_lock(tmp_path)
    try:
        t = make(tmp_path, [MetricsLog(tmp_path, every_steps=2), Checkpoint(tmp_path, every_steps=4)])
        before = flat(t.model)
        with pytest.raises(RuntimeError, match=f'in use by process {live.pid}'): t.fit(2, resume='last')
        assert torch.equal(flat(t.model), before) and t.state.iteration == 0
        files[tmp_path / 'LOCK'] = (tmp_path / 'LOCK').read_bytes()
        assert {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()} == files   # metrics.jsonl included
    finally: live.kill(); live.wait()


# processes that wait for a signal file, then all try to fit in the same directory at once
RACE = """
import sys, time, warnings
from pathlib import Path
sys.path.insert(0, 'tests')
import torch.nn.functional as F
from torch.utils.data import DataLoader
from conftest import regression_ds, small_model
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
class Hold(Hook):   # the winner holds the lock until the test has seen every other run end
    def before_epoch(self):
        print('HOLDING', flush=True)
        while not release.exists(): time.sleep(0.01)
d, go, release = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
t = Trainer(small_model(), DataLoader(regression_ds(16), batch_size=8), loss_func=F.mse_loss,
            hooks=[Checkpoint(d, monitor=None), Hold()], default_hooks=False)
print('WAITING', flush=True)
while not go.exists(): time.sleep(0.001)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    try:
        t.fit(1)
        print('RAN', sum('Taking over' in str(x.message) for x in w), flush=True)
    except RuntimeError as e: print('REFUSED', e, flush=True)
"""


@pytest.mark.slow
def test_stale_lock_one_winner_when_runs_start_at_once(tmp_path):
    "Runs started at once on a stale lock: one takes it over, each other one is refused naming that one, at any timing."
    import socket
    d, go, release = tmp_path / 'run', tmp_path / 'go', tmp_path / 'release'
    d.mkdir()
    dead = subprocess.Popen(['true']); dead.wait()
    (d / 'LOCK').write_text(json.dumps({'pid': dead.pid, 'host': socket.gethostname()}))
    ps = [subprocess.Popen([sys.executable, '-c', RACE, str(d), str(go), str(release)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(3)]
    try:
        for p in ps: assert p.stdout.readline().startswith('WAITING')
        go.touch()
        # each run either holds the lock (and says so) or is refused and ends: wait for one of the two per run
        first = {p.pid: p.stdout.readline().strip() for p in ps}
        holding = [pid for pid, line in first.items() if line == 'HOLDING']
        assert len(holding) == 1, first
        release.touch()
        outs = [first[p.pid] + '\n' + p.communicate(timeout=120)[0].strip() for p in ps]
    finally:
        for p in ps: p.kill()
    ran = [o for o in outs if 'RAN' in o]
    assert len(ran) == 1 and ran[0].endswith('RAN 1'), outs   # the winner took the stale lock over, with the warning
    refused = [o for o in outs if o.startswith('REFUSED')]
    assert len(refused) == 2 and all(f'in use by process {holding[0]} on ' in o for o in refused), outs
    assert not (d / 'LOCK').exists()


def test_early_stopping(tmp_path):
    from trainer_nb.monitor import EarlyStopping
    from trainer_nb.base import CancelFit
    from trainer_nb.recorder import Recorder
    vals = iter([1., 2., 2.05, 1.9, 1.8, 3., 3.])
    def acc(preds, targets): return next(vals)
    es = EarlyStopping('acc', mode='max', patience=2, min_delta=0.1)
    t = make(tmp_path, [Recorder(), es], metrics=[acc])
    t.fit(7)
    assert isinstance(t.cancelled, CancelFit) and 'best 2 at epoch 2' in str(t.cancelled)
    assert t.state.epoch == 3 and len(t.history) == 4 and es.state_dict() == {'best': 2., 'best_epoch': 1, 'wait': 2}


def test_early_stopping_saves_the_last_epoch_resume_trains_nothing(tmp_path):
    "EarlyStopping's CancelFit comes before Checkpoint's after_epoch: the epoch it stops at is saved all the same."
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.monitor import EarlyStopping, MetricsLog
    from trainer_nb.base import CancelFit, Hook
    snaps = {}
    class Snap(Hook):
        order = 99
        def after_epoch(self): snaps[self.trainer.state.epoch] = flat(self.trainer.model)
    def trainer(vals):
        def acc(preds, targets): return next(vals)
        hooks = [MetricsLog(tmp_path, every_steps=2), EarlyStopping('acc', mode='max', patience=2),
                 Checkpoint(tmp_path, every_steps=4, keep_last=2, monitor='acc', mode='max', load_best_at_end=True), Snap()]
        return make(tmp_path, hooks, metrics=[acc])
    t = trainer(iter([1., 2., 1.5, 1.4, 9., 9., 9.]))
    t.fit(7)   # stops at the end of epoch 3 (6 steps per epoch); the best is epoch 1's
    assert isinstance(t.cancelled, CancelFit) and t.state.epoch == 3 and t.state.step == 24
    ck = t.get_hook(Checkpoint)
    assert [p.name for p in list_checkpoints(tmp_path)] == ['step-00000012', 'step-00000020', 'step-00000024']
    st = json.loads((ck.last / 'trainer_state.json').read_text())
    assert ck.last.name == 'step-00000024' and st['position'] == [4, 0] and st['stopped'].startswith('Early stopping')
    assert ck.best.name == 'step-00000012' and json.loads((tmp_path / 'best.json').read_text())['value'] == 2.
    assert torch.equal(flat(t.model), snaps[1]) and not torch.equal(snaps[1], snaps[2])   # the best loaded at the end
    log = (tmp_path / 'metrics.jsonl').read_bytes()
    # a resume from the last checkpoint trains nothing: the fit stays stopped, for the same reason
    t2 = trainer(iter([]))
    t2.fit(7, resume='last')
    assert isinstance(t2.cancelled, CancelFit) and 'Early stopping' in str(t2.cancelled) and 'nothing left' in str(t2.cancelled)
    assert t2.state.state_dict() == t.state.state_dict() and len(t2.losses) == 24
    assert torch.equal(flat(t2.model), snaps[1]) and (tmp_path / 'metrics.jsonl').read_bytes() == log
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == 'step-00000024'


def tied_trainer(tmp_path, hooks=(), seed=0):
    "A model whose output layer shares the embedding's weight, on token data."
    from trainer_nb.core import Trainer
    from torch.utils.data import TensorDataset
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)
            self.head.weight = self.emb.weight
        def forward(self, x): return self.head(torch.tanh(self.emb(x).mean(1)))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 10, (48, 3), generator=g)
    torch.manual_seed(seed)
    model = Tied()
    torch.manual_seed(0)
    return Trainer(model, DataLoader(TensorDataset(x, x.sum(1) % 10), batch_size=8, shuffle=True),
                   loss_func=F.cross_entropy, hooks=list(hooks), default_hooks=False)


def test_tied_weights_save_and_resume(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints, load_weights
    ref = tied_trainer(tmp_path)
    ref.fit(2)
    tied_trainer(tmp_path, [Checkpoint(tmp_path, every_steps=4, keep_last=None, monitor=None)]).fit(2)
    mid = list_checkpoints(tmp_path)[0]   # step 4 of 12
    assert len(load_file(mid / 'model.safetensors')) == 2   # the shared weight once, and the head's bias
    t = tied_trainer(tmp_path, [Checkpoint(tmp_path, monitor=None)], seed=1)
    t.fit(2, resume=mid)
    assert t.state.step == 12 and t.model.head.weight is t.model.emb.weight
    for a, b in zip(ref.model.state_dict().values(), t.model.state_dict().values()): assert torch.equal(a, b)
    fresh = tied_trainer(tmp_path, seed=2).model
    res = load_weights(fresh, list_checkpoints(tmp_path)[-1])   # strict: nothing missing
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert torch.equal(fresh.head.weight, ref.model.head.weight) and fresh.head.weight is fresh.emb.weight


def test_no_duplicate_save_at_epoch_end(tmp_path):
    from trainer_nb.checkpoint import Checkpoint
    def position(p): return json.loads((p / 'trainer_state.json').read_text())['position']
    ck = Checkpoint(tmp_path / 'a', every_steps=3, keep_last=None)
    make(tmp_path, [ck]).fit(2)   # 6 steps per epoch: the periodic save of steps 6 and 12 is the end-of-epoch save
    assert [p.name for p in ck.saved] == ['step-00000003', 'step-00000006', 'step-00000009', 'step-00000012']
    assert [position(p) for p in ck.saved] == [[0, 3], [1, 0], [1, 3], [2, 0]]
    # no end-of-epoch saves, a save every step: the best, found at an epoch's end, is the step saved already
    ck = Checkpoint(tmp_path / 'b', every_seconds=0, at_epoch_end=False, keep_last=None)
    make(tmp_path, [ck]).fit(2)
    assert [p.name for p in ck.saved] == [f'step-{i:08d}' for i in range(1, 13)]
    assert ck.best.name in ('step-00000006', 'step-00000012')


def test_a_complete_temporary_checkpoint_is_put_in_place(tmp_path):
    "A save killed after sealing, before its rename, left only `.tmp-step-…`: the next fit puts it in place and resumes it."
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints, save_checkpoint
    t = make(tmp_path, [Checkpoint(tmp_path, keep_last=1, monitor=None)])
    t.fit(2)
    last = list_checkpoints(tmp_path)[-1]
    assert [p.name for p in list_checkpoints(tmp_path)] == ['step-00000012']
    os.rename(last, tmp_path / '.tmp-step-00000012')
    shutil.copytree(tmp_path / '.tmp-step-00000012', tmp_path / '.tmp-step-00000013')
    os.remove(tmp_path / '.tmp-step-00000013' / 'manifest.json')            # not sealed: deleted
    shutil.copytree(tmp_path / '.tmp-step-00000012', tmp_path / '.tmp-step-00000014')
    with open(tmp_path / '.tmp-step-00000014' / 'optimizer.bin', 'ab') as f: f.write(b'x')   # does not match: deleted
    t2 = make(tmp_path, [Checkpoint(tmp_path, keep_last=1, monitor=None)])
    t2.fit(2, resume='last')
    assert t2.state.step == 12 and len(t2.losses) == 12 and torch.equal(flat(t2.model), flat(t.model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json', 'step-00000012']
    # saving a step that is there already replaces it, with no leftovers
    save_checkpoint(t2, last, position=(5, 0))
    assert json.loads((last / 'trainer_state.json').read_text())['position'] == [5, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json', 'step-00000012']


@pytest.mark.filterwarnings("ignore:Resuming with a changed config")
def test_logged_values_in_the_tensor_files_and_resumed_exactly(tmp_path):
    "What `trainer.log` recorded goes in each process's tensor file, not the JSON, and a mid-epoch resume continues it."
    from trainer_nb.base import CancelFit, Hook
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.recorder import Recorder
    class Log(Hook):
        def after_loss(self): self.trainer.log('half_loss', self.trainer.loss / 2)
    class Stop(Hook):
        order = 100
        def after_batch(self):
            if self.trainer.state.iteration == 9: raise CancelFit()
    ref = make(tmp_path, [Log(), Recorder()])
    ref.fit(2)
    make(tmp_path, [Log(), Recorder(), Checkpoint(tmp_path / 'run', every_steps=4), Stop()]).fit(2)
    last = list_checkpoints(tmp_path / 'run')[-1]
    st = json.loads((last / 'trainer_state.json').read_text())
    assert last.name == 'step-00000008' and 'logged' not in st and 'losses' not in st
    saved = load_file(last / 'losses_0.safetensors')
    assert torch.equal(saved['logged/half_loss/values'], ref.logged['half_loss'].values[:8])
    t = make(tmp_path, [Log(), Recorder(), Checkpoint(tmp_path / 'run', every_steps=4)])
    t.fit(2, resume='last')
    assert torch.equal(t.logged['half_loss'].values, ref.logged['half_loss'].values)
    assert list(t.history.half_loss) == list(ref.history.half_loss)   # the epochs' means, bitwise

def test_monitor_absent_warns_once(tmp_path):
    from trainer_nb.checkpoint import Checkpoint
    t = make(tmp_path, [Checkpoint(tmp_path, monitor='acc', mode='max', load_best_at_end=True)])
    with pytest.warns(UserWarning) as rec: t.fit(3)
    msgs = [str(w.message) for w in rec if 'monitors' in str(w.message)]
    assert len(msgs) == 1 and "'acc'" in msgs[0] and "['epoch', 'train_loss', 'valid_loss', 'time']" in msgs[0]
    assert 'load_best_at_end loads nothing' in msgs[0]
    assert t.get_hook(Checkpoint).best is None and not (tmp_path / 'best.json').exists()


def test_metrics_log_and_reader(tmp_path):
    from trainer_nb.monitor import MetricsLog, read_metrics
    t = make(tmp_path, [MetricsLog(tmp_path, every_steps=4)])
    t.fit(2)
    with open(tmp_path / 'metrics.jsonl', 'a') as f: f.write('{"kind": "train", "st')   # a line cut by a crash
    df = read_metrics(tmp_path)
    assert list(df.kind) == ['train', 'epoch', 'train', 'train', 'epoch']
    assert list(df.step) == [4, 6, 8, 12, 12]
    # the logged loss is the mean of the batch losses since the previous line
    vals = t.losses.values
    assert df.loss[0] == pytest.approx(vals[:4].double().mean().item())
    assert df.loss[2] == pytest.approx(vals[4:8].double().mean().item())
    assert df[df.kind == 'epoch'].train_loss.tolist() == pytest.approx([vals[:6].mean().item(), vals[6:].mean().item()])


# ---- run directory config, experiment trackers ----

def augment(x): return x   # a config value JSON can't hold: written as its repr


def test_config_json_and_differences_on_resume(tmp_path, capsys):
    from trainer_nb.base import TrainerWarning
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.schedule import one_cycle
    def mae(preds, targets): return (preds - targets).abs().mean()
    def trainer(lr, data):
        ck = Checkpoint(tmp_path, every_steps=2, keep_last=None, config={'data': data, 'seed': 0, 'augment': augment})
        return make(tmp_path, [ck], lr=lr, metrics=[mae], grad_accum=2, scheduler=one_cycle())
    trainer(1e-2, 'v1').fit(2)
    cfg = json.loads((tmp_path / 'config.json').read_text())
    assert (cfg['data'], cfg['seed'], cfg['augment']) == ('v1', 0, '<function augment>')
    tr = cfg['trainer']
    assert tr['model'] == 'Sequential' and tr['parameters'] == 5 * 8 + 8 + 8 + 1
    assert tr['optimizer']['class'] == 'AdamW' and tr['optimizer']['lr'] == 0.01 and tr['optimizer']['weight_decay'] == 0.01
    assert tr['lr'] == 0.01 and tr['epochs'] == 2 and tr['grad_accum'] == 2 and tr['mixed_precision'] == 'no'
    assert tr['max_grad_norm'] is None and tr['scheduler'].startswith('functools.partial(<function _one_cycle>, ')
    assert tr['loss_func'] == 'mse_loss' and tr['metrics'] == ['mae'] and tr['hooks'] == ['Checkpoint']
    assert tr['batch_size'] == 8 and tr['train_samples'] == 48 and tr['num_processes'] == 1
    assert capsys.readouterr().out == ''
    mid = list_checkpoints(tmp_path)[0]   # step 2 of 6: mid-epoch 0 (3 steps per epoch)
    assert json.loads((mid / 'trainer_state.json').read_text())['position'] == [0, 4]
    # resumed with another LR and another data set: one warning lists the differences (nothing printed besides), and
    # config.json holds the new config
    t2 = trainer(2e-2, 'v2')
    with pytest.warns(TrainerWarning) as caught:
        t2.fit(2, resume=mid)
    assert [str(w.message).splitlines() for w in caught] == [[
        f"Resuming with a changed config (step-00000002: 2 differences; {tmp_path / 'config.json'} now holds the new one):",
        '  data: "v1" -> "v2"', '  trainer.optimizer.lr: 0.01 -> 0.02']]
    assert capsys.readouterr().out == ''
    cfg2 = json.loads((tmp_path / 'config.json').read_text())
    assert cfg2['data'] == 'v2' and cfg2['trainer']['optimizer']['lr'] == 0.02
    assert cfg2['trainer']['lr'] == 0.01   # the LR this fit trains at: the checkpoint's
    assert t2.state.step == 6 and not list(tmp_path.glob('.config*'))
    # the same config again (functions and the scheduler factory give the same text): nothing printed, no warning
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        trainer(2e-2, 'v2').fit(2, resume=mid)
    assert capsys.readouterr().out == '' and json.loads((tmp_path / 'config.json').read_text()) == cfg2
    with pytest.raises(ValueError, match="'trainer' is reserved"): Checkpoint(tmp_path, config={'trainer': 1})


def test_accelerator_with_automatic_checkpoint_naming_refused(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from trainer_nb.checkpoint import Checkpoint
    acc = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match='automatic_checkpoint_naming'):
        make(tmp_path, [Checkpoint(tmp_path / 'run')], accelerator=acc).fit(1)


def test_metrics_log_to_tensorboard(tmp_path):
    "Accelerate's TensorBoard tracker, for real: the event files hold the records of metrics.jsonl, at the same steps."
    pytest.importorskip('tensorboard')
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trainer_nb.monitor import MetricsLog, read_metrics
    def mae(preds, targets): return (preds - targets).abs().mean()
    acc = Accelerator(log_with='tensorboard', project_dir=str(tmp_path / 'tb'))
    acc.init_trackers('run1')
    t = make(tmp_path, [MetricsLog(tmp_path, every_steps=4)], metrics=[mae], accelerator=acc)
    t.fit(3)
    acc.end_training()
    ea = EventAccumulator(str(tmp_path / 'tb' / 'run1'), size_guidance={'scalars': 0})
    ea.Reload()
    df = read_metrics(tmp_path)
    train, epoch = df[df.kind == 'train'], df[df.kind == 'epoch']
    assert list(train.step) == [4, 8, 12, 16] and list(epoch.step) == [6, 12, 18]
    assert sorted(ea.Tags()['scalars']) == ['epoch/mae', 'epoch/train_loss', 'epoch/valid_loss', 'train/loss', 'train/lr']
    for tag, rows, col in [('train/loss', train, 'loss'), ('train/lr', train, 'lr'), ('epoch/train_loss', epoch, 'train_loss'),
                           ('epoch/valid_loss', epoch, 'valid_loss'), ('epoch/mae', epoch, 'mae')]:
        ev = ea.Scalars(tag)
        assert [e.step for e in ev] == list(rows.step), tag
        assert [e.value for e in ev] == pytest.approx(list(rows[col]), rel=1e-6), tag   # float32 in event files


def test_metrics_log_trackers_not_started_warns(tmp_path):
    pytest.importorskip('tensorboard')
    from accelerate import Accelerator
    from trainer_nb.monitor import MetricsLog
    acc = Accelerator(log_with='tensorboard', project_dir=str(tmp_path / 'tb'))
    with pytest.warns(UserWarning, match=r"log_with=\['tensorboard'\] but no tracker started"):
        make(tmp_path, [MetricsLog(tmp_path)], accelerator=acc).fit(1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        make(tmp_path, [MetricsLog(tmp_path, trackers=False)], accelerator=acc).fit(1)
