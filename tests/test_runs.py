"""Run records, `runs()` and `compare()` on real run directories: written by `trainer-nb train`, by fits in this
process and in subprocesses (killed with SIGKILL and resumed; one waiting mid-fit), a truncated `metrics.jsonl`, and
200 runs."""
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import warnings

import pytest
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import REPO, VENV_BIN, regression_ds, small_model
from trainer_nb.base import Hook
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.monitor import MetricsLog, read_metrics
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.runs import RECORD, RunRecorder, compare, kernel_runs, read_run, runs

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', PYTHONPATH=str(REPO))
SCRIPT = str(REPO / 'tests' / 'runs_script.py')


def trainer(hooks=(), lr=0.05, rr=None, **kw):
    ds = regression_ds(48)
    return Trainer(small_model(), DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=16), loss_func=F.mse_loss,
                   lr=lr, cpu=True, hooks=[Recorder(), rr or RunRecorder(), *hooks], default_hooks=False, **kw)


def script(cfg, **kw):
    return subprocess.Popen([sys.executable, SCRIPT, json.dumps(cfg)], env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def png_size(path):
    "`(width, height)` of a PNG, from its header."
    return struct.unpack('>II', path.read_bytes()[16:24])


def test_a_fit_with_a_checkpoint_leaves_its_record_and_eval_every_reaches_metrics_jsonl(tmp_path):
    t = trainer([MetricsLog(tmp_path, every_steps=2), Checkpoint(tmp_path, config={'width': 8})])
    t.fit(2, eval_every=4)                                     # 6 batches an epoch: validations at steps 4 and 8
    rec = json.loads((tmp_path / RECORD).read_text())
    assert rec['status'] == 'done' and rec['steps'] == 12 and rec['epochs_done'] == 2 and rec['end'] >= rec['start']
    assert [e['epoch'] for e in rec['epochs']] == [1, 2] and [e['step'] for e in rec['epochs']] == [6, 12]
    assert [e['step'] for e in rec['evals']] == [4, 8] and all('valid_loss' in e for e in rec['evals'])
    assert rec['series']['step'] == list(range(1, 13)) and len(rec['series']['loss']) == 12
    assert rec['config']['width'] == 8 and rec['config']['trainer']['lr'] == 0.05
    m = read_metrics(tmp_path)
    assert list(m[m.kind == 'valid'].step) == [4, 8]          # the validations inside epochs, in metrics.jsonl too
    assert rec == t.get_hook(RunRecorder).record and kernel_runs()[-1] is t.get_hook(RunRecorder).record


def test_the_per_step_points_are_bounded(tmp_path):
    t = trainer(rr=RunRecorder(tmp_path, max_points=5))
    t.fit(4)                                                   # 24 steps
    rec = json.loads((tmp_path / RECORD).read_text())
    assert len(rec['series']['step']) == 5 and rec['series']['step'][0] == 3.0   # means of 5 steps: 1..5 -> 3
    size = (tmp_path / RECORD).stat().st_size
    t.fit(40)                                                  # 240 more steps (a new fit: a new record)
    rec2 = json.loads((tmp_path / RECORD).read_text())
    assert rec2['first_step'] == 24 and len(rec2['series']['step']) == 5 and rec2['id'] != rec['id']
    assert len(rec2['epochs']) == 40 and (tmp_path / RECORD).stat().st_size < size + 40 * 250
    print('record sizes:', size, (tmp_path / RECORD).stat().st_size, 'bytes')


def test_stop_and_resume_in_memory_is_one_record():
    class StopAt(Hook):
        def after_step(self):
            if self.trainer.state.step == 8: self.trainer.stop()
    t = trainer([StopAt()])
    n = len(kernel_runs())
    with pytest.raises(KeyboardInterrupt):
        t.fit(3)
    rec = t.get_hook(RunRecorder).record
    assert rec['status'] == 'stopped' and rec['steps'] == 8 and len(kernel_runs()) == n + 1
    t.resume()
    assert t.get_hook(RunRecorder).record is rec and len(kernel_runs()) == n + 1
    assert rec['status'] == 'done' and rec['steps'] == 18 and [e['epoch'] for e in rec['epochs']] == [1, 2, 3]
    assert [e['kind'] for e in rec['events']] == ['stopped', 'resume'] and len(rec['segments']) == 2


def test_killed_mid_fit_then_resumed_is_one_record(tmp_path):
    d = tmp_path / 'run'
    p = script({'dir': str(d), 'epochs': 3, 'kill_at': 20})    # 12 batches an epoch; checkpoints every 3 steps
    p.communicate(timeout=120)
    assert p.returncode == -9
    first = read_run(d)
    assert first['status'] == 'killed' and first['epochs_done'] == 1   # left at 'running' by a process that is gone
    df = runs(tmp_path, kernel=False)
    assert list(df.status) == ['killed'] and df.loc[0, 'epochs'] == 1
    p = script({'dir': str(d), 'epochs': 3, 'resume': 'last'})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and 'DONE' in out, err
    rec = read_run(d)
    assert rec['id'] == first['id'] and rec['status'] == 'done' and rec['steps'] == 36
    assert [e['epoch'] for e in rec['epochs']] == [1, 2, 3] and [e['kind'] for e in rec['events']] == ['resume']
    assert rec['events'][0]['step'] == 18                    # the checkpoint before iteration 20
    assert rec['series']['step'] == list(range(1, 37))       # each step once
    df = runs(tmp_path, kernel=False)
    assert len(df) == 1 and df.loc[0, 'status'] == 'done' and df.loc[0, 'steps'] == 36


def test_a_run_being_written_is_running_and_a_damaged_run_is_listed(tmp_path):
    p = script({'dir': str(tmp_path / 'live'), 'epochs': 2, 'wait_at': 14}, stdin=subprocess.PIPE)
    try:
        assert p.stdout.readline().startswith('WAITING')
        (tmp_path / 'old').mkdir()                             # a run without a record, its log cut by a crash
        lines = [{'kind': 'train', 'step': 2, 'loss': 1.5, 'lr': 0.1, 'time': 0.1, 'samples': 16},
                 {'kind': 'epoch', 'step': 4, 'train_loss': 1.2, 'valid_loss': 1.0},
                 {'kind': 'epoch', 'step': 8, 'train_loss': 0.9, 'valid_loss': 0.7}]
        text = ''.join(json.dumps(x) + '\n' for x in lines)
        (tmp_path / 'old' / 'metrics.jsonl').write_text(text + text[:30])
        (tmp_path / 'bad').mkdir()
        (tmp_path / 'bad' / RECORD).write_text('{"name": "bad", "sta')
        (tmp_path / 'data').mkdir()                            # not a run
        with pytest.warns(UserWarning, match='1 damaged line of metrics.jsonl skipped') as w:
            df = runs(tmp_path, kernel=False)
        st = dict(zip(df.name, df.status))
        assert st == {'live': 'running', 'old': 'unknown', 'bad': 'damaged'}
        assert df.set_index('name').loc['live', 'epochs'] == 1
        assert df.set_index('name').loc['old', 'best valid_loss'] == 0.7
        notes = df.attrs['notes']
        assert any('data: not a run directory' in n for n in notes) and any('bad' in n for n in notes)
        assert 'not a run directory' in str(w[0].message)
    finally:
        p.communicate('\n', timeout=120)
    assert p.returncode == 0 and read_run(tmp_path / 'live')['status'] == 'done'


def test_train_command_runs_and_compare(tmp_path):
    shutil.copy(REPO / 'tests' / 'cli_parts.py', tmp_path / 'cli_parts.py')
    (tmp_path / 'reg.yaml').write_text(
        "imports: [cli_parts]\ndata: {type: regression_data, bs: 8}\nmodel: regression_model\nloss: mse_loss\n"
        "metrics: [mae]\nfit: {epochs: 2, lr: 0.05}\nrun_dir: runs/{name}-{time}\n")
    exe = str(VENV_BIN / 'trainer-nb')
    for name, lr in (('slow', 0.01), ('fast', 0.05)):
        r = subprocess.run([exe, 'train', 'reg.yaml', f'run_dir=runs/{name}', f'fit.lr={lr}'], cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr
    df = runs(tmp_path / 'runs', kernel=False)
    assert list(df.name) == ['fast', 'slow'] and list(df.status) == ['done', 'done'] and list(df.epochs) == [2, 2]
    assert list(df['fit.lr']) == [0.05, 0.01] and {'mae', 'best mae', 'valid_loss'} <= set(df.columns)
    r = subprocess.run([exe, 'runs', 'runs'], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].split()[:4] == ['name', 'start', 'duration', 'status'] and out[1].split()[0] == 'fast'
    assert 'done' in out[1] and 'fit.lr' in out[0]
    r = subprocess.run([exe, 'compare', 'runs/slow', 'runs/fast', '-o', 'cmp.png', '--x', 'epoch'], cwd=tmp_path,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png_size(tmp_path / 'cmp.png') == (1720, 660)                        # 860 CSS px at twice the pixels
    c = compare(tmp_path / 'runs' / 'slow', df.iloc[0], metric='mae', x='time')
    assert [ax.get_title() for ax in c.fig.axes] == ['train loss (smoothed)', 'mae']
    assert sorted(l.get_label() for l in c.fig.axes[1].lines) == ['lr=0.01', 'lr=0.05']
    assert c.save(tmp_path / 'narrow.png', column=True) and png_size(tmp_path / 'narrow.png')[0] == 600
    data, meta = c._repr_mimebundle_()
    assert data['text/html'].count('data:image/png;base64,') == 2 and '<picture' in data['text/html']


def test_200_runs(tmp_path, capsys):
    t = trainer(rr=RunRecorder(tmp_path / 'proto'))
    t.fit(2)
    rec = json.loads((tmp_path / 'proto' / RECORD).read_text())
    shutil.rmtree(tmp_path / 'proto')
    rec['series'] = {k: [float(i)] * 500 for i, k in enumerate(('step', 'loss', 'lr'))}   # full-size records
    for i in range(200):
        (tmp_path / f'r{i:03d}').mkdir()
        r = dict(rec, name=f'r{i:03d}', start=1e9 + i, config={**rec['config'], 'lr': 10 ** -(i % 4)})
        (tmp_path / f'r{i:03d}' / RECORD).write_text(json.dumps(r))
    t0 = time.perf_counter()
    df = runs(tmp_path, kernel=False)
    took = time.perf_counter() - t0
    assert len(df) == 200 and df.name.iloc[0] == 'r199' and df.name.iloc[-1] == 'r000'   # newest first
    assert list(df.columns[-2:]) == ['lr', 'path'] and set(df.lr) == {1, 0.1, 0.01, 0.001}
    assert 'days' not in repr(df) and 'days' not in df._repr_html_()             # durations printed as m:ss
    back = pickle.loads(pickle.dumps(df))
    assert type(back) is type(df) and back.equals(df) and back.attrs == df.attrs == {'notes': []}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        c = compare(df)                                        # the best 6 drawn, the others named
    took_cmp = time.perf_counter() - t0
    assert len(c.fig.axes[0].lines) == 6 and 'the best 6 of 200 runs drawn' in c.fig.get_suptitle()
    with capsys.disabled():
        print(f"\nruns() of 200 runs: {took:.2f} s; compare() of 200: {took_cmp:.2f} s; record: "
              f"{len(json.dumps(rec))} bytes")


def test_the_figure_stays_in_a_saved_notebook(tmp_path):
    "The figure as a notebook output, saved, and rendered by nbconvert without a kernel: the wide and narrow PNGs."
    import nbformat
    from nbconvert import HTMLExporter
    trs = [trainer(lr=lr) for lr in (0.01, 0.1)]
    for t in trs: t.fit(2)
    data, meta = compare(*trs)._repr_mimebundle_()
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell('compare(a, b)', outputs=[
        nbformat.v4.new_output('display_data', data=data, metadata=meta)]))
    nbformat.write(nb, tmp_path / 'saved.ipynb')
    html, _ = HTMLExporter().from_notebook_node(nbformat.read(tmp_path / 'saved.ipynb', as_version=4))
    pic = html[html.index('<picture class="trainer-nb-curves">'):]
    pic = pic[:pic.index('</picture>')]
    assert pic.count('data:image/png;base64,') == 2 and 'media="(max-width: 700px)"' in pic


def test_live_plot_draws_a_baseline_under_the_fit(tmp_path):
    """`LivePlot(compare='last')`: the frames carry the last fit's curves (its smoothed loss over its own steps, its
    validations), the picture left behind draws them; a resumed fit keeps its baseline; a run that is not there is
    refused when the fit starts, naming it."""
    from trainer_nb.base import smooth
    from trainer_nb.liveplot import LivePlot, draw_curves
    first = trainer(lr=0.01)
    first.fit(2)
    base = first.get_hook(RunRecorder).record
    class StopAt(Hook):
        def after_step(self):
            if self.trainer.state.step == 9: self.trainer.stop()
    plot = LivePlot(mode='text', path=tmp_path / 'curves.png', metrics=False, compare='last')
    second = trainer([plot, StopAt()], lr=0.05)
    with pytest.raises(KeyboardInterrupt):
        second.fit(3)
    fr = plot.frame()
    s = fr['series']
    assert fr['baseline'] == f"baseline: {base['name']}" and list(s['base_step']) == base['series']['step']
    assert s['base_smooth'] == pytest.approx(smooth(base['series']['loss'], plot._beta(), steps=s['base_step']))
    assert list(s['base_valid_step']) == [6, 12]
    assert list(s['base_valid_loss']) == [e['valid_loss'] for e in base['epochs']]
    assert draw_curves(fr) != draw_curves({**fr, 'baseline': None})   # the picture draws it
    second.resume()   # the fit before it is now `second` itself: the baseline stays the one it started with
    fr = plot.frame()
    assert fr['baseline'] == f"baseline: {base['name']}" and list(fr['series']['base_step']) == base['series']['step']
    assert png_size(tmp_path / 'curves.png')[0] > 0
    with pytest.raises(ValueError, match='no-such-run'):
        trainer([LivePlot(mode='text', path=tmp_path / 'x.png', compare='no-such-run')]).fit(1)


def test_trainer_run_dir_writes_the_record_there(tmp_path):
    "`Trainer(run_dir=...)`: the record in that directory, with the default hooks or without them."
    ds = regression_ds(48)
    for i, default in enumerate((True, False)):
        d = tmp_path / f'run{i}'
        t = Trainer(small_model(), DataLoader(ds, batch_size=8), loss_func=F.mse_loss, cpu=True, run_dir=d,
                    default_hooks=default, hooks=() if default else [Recorder()])
        t.fit(1)
        assert [type(h) for h in t.hooks].count(RunRecorder) == 1
        rec = read_run(d)
        assert rec['status'] == 'done' and rec['steps'] == 6 and rec['name'] == f'run{i}'
        assert runs(tmp_path, kernel=False).name.tolist().count(f'run{i}') == 1


def test_every_seconds_changed_during_a_fit_counts_from_the_next_step(tmp_path):
    "Written every hour; at step 3 a hook asks for every 0 s: the record is written at that step, and at each after."
    rr = RunRecorder(tmp_path, every_seconds=3600)
    seen = {}

    class Ask(Hook):
        order = 50   # before the RunRecorder (90) at each step
        def after_step(self):
            if self.trainer.state.step == 3: rr.every_seconds = 0

    class Read(Hook):
        order = 95   # after it: what the file holds once the step is done
        def after_step(self):
            seen[self.trainer.state.step] = json.loads((tmp_path / RECORD).read_text())['steps']

    trainer([Ask(), Read()], rr=rr).fit(1)   # 6 steps
    assert seen == {1: 0, 2: 0, 3: 3, 4: 4, 5: 5, 6: 6}   # (before: the file of before_fit, written at step 0)
    with pytest.raises(ValueError, match='every_seconds must be a number >= 0'): rr.every_seconds = -1


# ---- what happened to a run: the settings changed by hand, and who ended it ----

class SetAt(Hook):
    "At step `at`, asks the fit for a new LR from its own thread, as the view's LR box does from another."
    def __init__(self, at, lr): self.at, self.lr = at, lr
    def after_step(self):
        if self.trainer.state.step == self.at: self.trainer.set(lr=self.lr)


@pytest.mark.parametrize('where', ['foreground', 'background'])
def test_a_run_changed_by_hand_says_so_in_its_record_runs_and_compare(tmp_path, where):
    """The record (in memory and in record.json) holds each change (step, name, old, new); `runs()` shows it in a
    `changes` column, and a compared run of the same config is labelled as changed, not taken for the plain one."""
    plain = trainer(rr=RunRecorder(tmp_path / 'plain'))
    plain.fit(2)
    t = trainer([SetAt(4, 0.0125)], rr=RunRecorder(tmp_path / 'by-hand'))
    if where == 'background':
        t.fit(2, background=True)
        t.wait()
    else: t.fit(2)
    want = [(4, 'lr', 0.05, 0.0125)]
    rec = t.get_hook(RunRecorder).record
    on_disk = json.loads((tmp_path / 'by-hand' / RECORD).read_text())
    for r in (rec, on_disk): assert [(c['step'], c['name'], c['old'], c['new']) for c in r['changes']] == want
    assert t.changes[-1]['step'] == 4 and plain.get_hook(RunRecorder).record['changes'] == []
    df = runs(tmp_path, kernel=False).set_index('name')
    assert df.loc['by-hand', 'changes'] == 'lr 0.05 -> 0.0125 at 4' and df.loc['plain', 'changes'] == ''
    labels = repr(compare(tmp_path / 'plain', tmp_path / 'by-hand')).removeprefix('RunComparison(')
    assert labels == 'plain, by-hand, by hand: lr -> 0.0125 at 4)', labels


@pytest.mark.parametrize('how, status', [('done', 'done'), ('stop', 'stopped'), ('hook', 'cancelled'),
                                         ('early', 'early-stopped'), ('own', 'pruned'), ('error', 'error')])
def test_the_status_says_who_ended_the_run(how, status):
    """done; stopped by the user (`stop()`: the Stop button's way); cancelled by a hook (`CancelFit`); early-stopped
    (`EarlyStopping`); a hook's own word (`CancelFit(status=)`, as a search's pruner says 'pruned'); an error."""
    from trainer_nb.base import CancelFit
    from trainer_nb.monitor import EarlyStopping

    class EndAt(Hook):
        def after_step(self):
            if self.trainer.state.step != 8: return
            if how == 'stop': self.trainer.stop()
            if how == 'hook': raise CancelFit('enough')
            if how == 'own': raise CancelFit('a bad trial', status='pruned')
            if how == 'error': raise ZeroDivisionError('in a hook')
    hooks = [EarlyStopping(patience=1, min_delta=1e9)] if how == 'early' else [EndAt()]
    t = trainer(hooks)
    try: t.fit(4)
    except (KeyboardInterrupt, ZeroDivisionError): pass
    rec = t.get_hook(RunRecorder).record
    assert rec['status'] == status, (rec['status'], rec['message'])
    assert rec['steps'] == {'done': 24, 'early': 12}.get(how, 8)
    if how != 'done': assert rec['events'][-1]['kind'] == status


def test_runs_of_a_folder_leave_out_this_kernels_fits_kept_elsewhere(tmp_path):
    """`runs(path)` lists the runs under `path` and this kernel's fits that have no directory; a fit of this kernel
    whose directory is elsewhere is not one of them (it is listed by `runs` of its own folder)."""
    elsewhere, here = tmp_path / 'elsewhere', tmp_path / 'here'
    trainer(run_dir=elsewhere / 'a').fit(1)
    trainer(run_dir=here / 'b').fit(1)
    trainer().fit(1)   # (no directory)
    assert set(runs(here)['path']) >= {str(here / 'b')} and str(elsewhere / 'a') not in set(runs(here)['path'])
    assert str(elsewhere / 'a') in set(runs(elsewhere)['path'])
    assert any(p.startswith('kernel:') for p in runs(here)['path'])
