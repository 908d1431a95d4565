"""The Profiler hook: its numbers per epoch in the results and history, attribution of time to data loading, its
state through JSON, and that it leaves training unchanged."""
import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from conftest import flat, regression_ds, small_model
from trainer_nb.base import Hook

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Slow(Dataset):
    "A data set whose every 8th item takes 30 ms to load (one per batch of 8)."
    def __init__(self): self.ds = regression_ds()
    def __len__(self): return len(self.ds)
    def __getitem__(self, i):
        if i % 8 == 0: time.sleep(0.03)
        return self.ds[i]


def test_profiler_numbers_in_history_and_data_wait_attributed():
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Profiler
    from trainer_nb.recorder import Recorder
    prof = Profiler()
    t = Trainer(small_model(), DataLoader(Slow(), batch_size=8), loss_func=F.mse_loss, hooks=[Recorder(), prof],
                default_hooks=False)
    t.fit(2)
    h = t.history
    assert {'samples_per_s', 'batch_ms', 'data_wait', 'peak_mem_mb'} <= set(h.columns) and len(prof.records) == 2
    for r in prof.records:
        # 6 batches, each waiting 30 ms for its data, against steps of a 5-8-1 MLP: the wait is most of the time
        assert 0.5 < r['data_wait'] < 1 and r['batch_ms'] > 0 and r['samples_per_s'] > 0
        assert r['peak_mem_mb'] > 10   # the process's peak resident size on the CPU
    # samples/s is the epoch's 48 samples over its training time, which the data wait bounds from below
    assert all(r['samples_per_s'] < 48 / (6 * 0.03) for r in prof.records)
    p2 = Profiler()
    p2.load_state_dict(json.loads(json.dumps(prof.state_dict())))
    assert p2.records == prof.records



def test_step_ms_is_batch_ms_under_its_old_name():
    """`step_ms` was the mean time of a batch: named `batch_ms` now; a record still reads the old key for a year (with a
    DeprecationWarning), and records saved under it (a checkpoint's) load as `batch_ms`."""
    import warnings
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Profiler
    prof = Profiler()
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss, hooks=[prof],
                default_hooks=False, grad_accum=2)
    t.fit(1)
    r = prof.records[0]
    assert 'step_ms' not in t.epoch_results and r['batch_ms'] > 0
    with pytest.warns(DeprecationWarning, match="'step_ms' is now 'batch_ms'"):
        assert r['step_ms'] == r['batch_ms']
    with pytest.raises(KeyError):
        r['no_such_key']
    old = Profiler()
    old.load_state_dict(json.loads(json.dumps({'records': [{'samples_per_s': 1., 'step_ms': 2., 'data_wait': 0.,
                                                            'peak_mem_mb': 3.}]})))
    assert old.records == [{'samples_per_s': 1., 'batch_ms': 2., 'data_wait': 0., 'peak_mem_mb': 3.}]
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # the new name warns about nothing
        assert old.records[0]['batch_ms'] == 2.

def test_profiler_changes_nothing_in_training():
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Profiler
    a = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss, hooks=[Profiler()],
                default_hooks=False)
    b = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss, default_hooks=False)
    a.fit(2)
    b.fit(2)
    assert torch.equal(flat(a.model), flat(b.model))


def test_data_wait_hint_when_the_loader_sleeps_and_not_otherwise(capsys):
    "A loader that sleeps 30 ms a batch (the workload here) makes the loop wait: one line says so, once per fit."
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Profiler
    t = Trainer(small_model(), DataLoader(Slow(), batch_size=8), loss_func=F.mse_loss, hooks=[Profiler()],
                default_hooks=False)
    t.fit(2)
    out = capsys.readouterr().out
    assert out.count("Profiler: the loop waited for the data loader") == 1 and "num_workers=" in out
    batches = list(DataLoader(regression_ds(4000), batch_size=8))   # collated beforehand: nothing to wait for
    t = Trainer(small_model(), batches, loss_func=F.mse_loss, hooks=[Profiler()], default_hooks=False)
    t.fit(2)
    assert "Profiler" not in capsys.readouterr().out


class Nap(Hook):
    "A hook whose after_batch sleeps 10 ms (its workload)."
    def after_batch(self): time.sleep(0.01)


def test_timing_splits_the_fit_and_names_the_data_wait(capsys):
    "A loader sleeping 30 ms a batch and a hook sleeping 10 ms: each lands where it belongs; the parts add to the wall."
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Timing
    t = Trainer(small_model(), DataLoader(Slow(), batch_size=8), DataLoader(Slow(), batch_size=8),
                loss_func=F.mse_loss, hooks=[Timing(), Nap()], default_hooks=False)
    t.fit(1)   # 6 batches
    r = t.timing
    assert r['data_wait'] >= 6 * 0.03 and r['hooks']['Nap'] >= 6 * 0.01 and r['validation'] >= 6 * 0.03
    assert set(r['hooks']) == {'Nap'} and min(r['train_step'], r['other']) >= 0
    parts = r['data_wait'] + r['train_step'] + r['validation'] + sum(r['hooks'].values()) + r['other']
    assert abs(parts - r['wall']) < 1e-9
    assert capsys.readouterr().out.count("Timing: the loop waited for the data loader") == 1
    batches = list(DataLoader(regression_ds(4000), batch_size=8))
    t = Trainer(small_model(), batches, loss_func=F.mse_loss, hooks=[Timing()], default_hooks=False)
    t.fit(2)
    assert "Timing" not in capsys.readouterr().out and t.timing['data_wait'] >= 0


def test_no_timing_no_clocked_hooks():
    "Without a Timing hook the trainer binds the hooks' own methods (nothing wraps them)."
    from trainer_nb.core import Trainer
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss, hooks=[Nap()],
                default_hooks=False)
    t.fit(1)
    (name, f), = t._calls['after_batch']
    assert name == 'Nap' and f.__self__ is t.hooks[0]
    with pytest.raises(LookupError, match="No hooks of type Timing"): t.timing


def timed_fit(loader_sleeps: bool, mode: str):
    """A 2-epoch fit with a `Timing` hook and a `Progress` in `mode`: its loader sleeps 30 ms a batch (6 batches an
    epoch), or 50 batches an epoch in a list (enough that a pause of a few ms between two batches, such as a garbage
    collection in a large process, does not make a quarter of the fit's time)."""
    import io
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Timing
    from trainer_nb.progress import Progress
    prog = Progress(mode=mode, file=io.StringIO(), every=0)
    data = DataLoader(Slow(), batch_size=8) if loader_sleeps else list(DataLoader(regression_ds(400), batch_size=8))
    t = Trainer(small_model(), data, loss_func=F.mse_loss, hooks=[Timing(), prog],
                default_hooks=False)
    seen = []
    class Look(Hook):   # what the dashboard shows at each batch's end, after Progress drew it
        order = 30
        def after_batch(self): seen.append(prog.view.widget.value if mode == 'widget' else None)
    t.add_hooks(Look())
    t.fit(2)
    return t, prog, seen


HINT = "Timing: the loop waited for the data loader"


def status_line(page: str) -> str:
    "The dashboard's status line of the time's split (and the data-wait line under it), as the page reads it."
    import re
    m = re.search(r"<(div|p) class='tnb-time'>(.*?)</\1>", page)
    return re.sub(r'<br>', '\n', re.sub(r'<(?!br>)[^>]+>', '', m.group(2))) if m else ''


PARTS = ('data wait', 'step', 'validation', 'hooks', 'drawing', 'other')


def hint_follows_share(line: str) -> bool:
    """Does the line carry the data-wait hint exactly when its data wait is over a quarter of the time (`Timing`'s
    `hint_above`)? (A share printed as 25% may be either side of it.)"""
    d = shares(line).get('data wait', 0)
    return d == 25 or (HINT in line) == (d > 25)


def shares(line: str) -> dict:
    """The parts of a split's line (`time: data wait 31% · step 52% · ...`, its first line) as `{part: percent}`,
    checked: known parts, in their order, adding up to the wall time (a part under 0.5% is left out of the line, and
    each is rounded). Which small parts show depends on the machine's speed: a busy one draws slower."""
    first = line.split('\n')[0]
    assert first.startswith('time: '), line
    got = [p.rsplit(' ', 1) for p in first[len('time: '):].split(' · ')]
    assert all(k in PARTS and v.endswith('%') for k, v in got), line
    assert [k for k, _ in got] == [k for k in PARTS if k in dict(got)], line
    res = {k: int(v[:-1]) for k, v in got}
    assert 94 <= sum(res.values()) <= 104, line
    return res


@pytest.mark.parametrize('sleeps', [True, False])
def test_the_dashboard_says_where_the_time_goes(sleeps, capsys):
    """With a `Timing` hook the dashboard's status line splits the fit's time (live, at each redraw, and in the record
    left behind); the data-wait line shows when the loader sleeps (most of the time) and not otherwise; the fit's end
    prints it no more (the dashboard said it)."""
    t, prog, seen = timed_fit(sleeps, 'widget')
    lines = [status_line(v) for v in seen]
    assert all(shares(ln) for ln in lines), seen[-1]
    assert 'step' in shares(lines[-1]) or sleeps, lines[-1]   # (with a sleeping loader, about 1% of the time)
    assert all(map(hint_follows_share, lines)), [ln for ln in lines if not hint_follows_share(ln)]
    assert (HINT in lines[-1]) == sleeps and (shares(lines[-1]).get('data wait', 0) > 25) == sleeps, lines[-1]
    final = status_line(prog.final_html)
    assert 'drawing' in shares(final) and (HINT in final) == sleeps, final   # the dashboard's own time, apart
    assert HINT not in capsys.readouterr().out


@pytest.mark.parametrize('sleeps', [True, False])
def test_the_text_progress_says_where_the_time_goes(sleeps, capsys):
    "In a terminal: the split after each epoch's results; the data-wait line once, only when the loader sleeps."
    t, prog, _ = timed_fit(sleeps, 'text')
    lines = prog.file.getvalue().splitlines()
    assert [ln.startswith('time: data wait ') for ln in lines[1:]].count(True) == 2, lines
    assert 'step' in shares(lines[2]) or sleeps, lines
    splits = [ln for ln in lines if ln.startswith('time: ')]
    assert (shares(splits[-1]).get('data wait', 0) > 25) == sleeps, lines   # the whole fit's split
    assert sum(HINT in ln for ln in lines) == (1 if sleeps else 0), lines   # (once, after the first split over it)
    assert HINT not in capsys.readouterr().out   # (not printed again at the fit's end)
