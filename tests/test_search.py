"""Hyperparameter search (trainer_nb.search) on real Optuna: it finds what a grid of the same size finds, prunes bad
trials from live validations, records every trial, refuses bad input before training, runs beside the caller, and
shares one study among processes, a killed one included."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip('optuna')

from trainer_nb.runs import runs  # noqa: E402
from trainer_nb.search import SearchError, intrange, loguniform, search, still_bundle, uniform  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import search_parts as P  # noqa: E402

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
SPACE = {'lr': loguniform(1e-3, 1.0), 'momentum': [0.0, 0.5, 0.9], 'epochs': 2}


@pytest.fixture(autouse=True)
def _here(tmp_path, monkeypatch): monkeypatch.chdir(tmp_path)


def _grid_best(momentum: float) -> float:
    "The best valid loss of 12 fits whose LRs are evenly spaced on a log scale from 1e-3 to 1."
    best = math.inf
    for k in range(12):
        t = P.make(10 ** (-3 + 3 * k / 11), momentum)
        t.fit(2)
        best = min(best, t.evaluate()['valid_loss'])
    return best


def test_search_finds_as_good_as_a_grid():
    s = search(P.make, {**SPACE, 'momentum': 0.5}, n_trials=12, study_name='vs-grid', seed=0)
    grid = _grid_best(0.5)
    assert len(s.study.trials) == 12
    assert s.best['value'] <= grid, (s.best, grid)
    assert s.best['params']['epochs'] == 2 and s.direction == 'minimize'
    df = s.table()
    assert list(df.index) == list(range(12)) and {'lr', 'valid_loss', 'state', 'run'} <= set(df.columns)
    best = df.loc[s.best['trial']]
    assert best['valid_loss'] == s.best['value'] and best['state'] == 'complete'
    t = s.refit()   # trained again from the best parameters: the same numbers (the same seed, the same fit)
    assert t.evaluate()['valid_loss'] == pytest.approx(s.best['value'], rel=1e-5)


def test_pruning_stops_bad_trials_and_none_without_a_pruner():
    s = search(P.make, SPACE, n_trials=12, study_name='pruned', seed=1, fit={'eval_every': 4})
    states = s.table()['state']
    assert (states == 'pruned').sum() >= 4, states.tolist()   # at least a third
    recs = {r['name']: r for r in (json.loads(p.read_text()) for p in Path('runs/pruned').glob('*/record.json'))}
    pruned = [n for n, st in states.items() if st == 'pruned']
    for n in pruned:   # each pruned trial's record says so, and it stopped early (fewer steps than a full fit)
        rec = recs[f'trial-{n:03d}']
        assert rec['status'] == 'pruned' and rec['steps'] < 24 and 'pruned at step' in rec['message']
    s = search(P.make, SPACE, n_trials=6, study_name='unpruned', seed=1, pruner=None, fit={'eval_every': 4})
    assert (s.table()['state'] == 'complete').all()


def test_hyperband_prunes_too():
    s = search(P.make, SPACE, n_trials=10, study_name='hb', seed=2, pruner='hyperband', fit={'eval_every': 2})
    assert (s.table()['state'] == 'pruned').sum() >= 1


def test_every_trial_is_a_run_and_a_failed_one_is_recorded():
    def make(lr, momentum):
        if momentum == 0.9: raise RuntimeError('no momentum of 0.9 here')
        return P.make(lr, momentum)
    s = search(make, {'lr': loguniform(1e-2, 0.2), 'momentum': [0.0, 0.9]}, n_trials=6, study_name='mixed', seed=3,
               pruner=None)
    df = s.table()
    failed = df[df['momentum'] == 0.9]
    assert len(failed) >= 1 and (failed['state'] == 'failed').all()
    assert failed['error'].str.contains('RuntimeError: no momentum of 0.9 here').all()
    assert (df[df['momentum'] == 0.0]['state'] == 'complete').all() and len(df) == 6
    r = runs('runs/mixed', kernel=False)
    assert {'study', 'trial', 'lr', 'momentum'} <= set(r.columns)
    assert set(r['study']) == {'mixed'} and sorted(r['trial']) == sorted(df[df['state'] == 'complete'].index)
    assert (r['status'] == 'done').all()


def test_an_error_inside_the_fit_is_recorded_in_the_run():
    s = search(P.make, {'lr': [5.0, 0.05]}, n_trials=4, study_name='nan', pruner=None, seed=0, epochs=3)
    df = s.table()
    assert set(df['lr']) == {5.0, 0.05} and len(df) == 4
    assert (df[df['lr'] == 0.05]['state'] == 'complete').all()
    bad = df[df['lr'] == 5.0].iloc[0]
    assert bad['state'] == 'failed' and 'NonFinite' in bad['error']
    rec = json.loads((Path(bad['run']) / 'record.json').read_text())
    assert rec['status'] == 'error' and 'loss' in rec['message']


@pytest.mark.parametrize('space, kw, msg', [
    ({'lr': loguniform(1e-3, 1.0), 'hiden': [4]}, {}, "space key 'hiden' names no argument of make; its arguments "
                                                        "are lr, momentum"),
    ({'lr': loguniform(1e-1, 1e-3)}, {}, "space['lr']: the range 0.1 .. 0.001 is inverted"),
    ({'lr': uniform(0.1, 0.1)}, {}, "space['lr']: the range 0.1 .. 0.1 is empty"),
    ({'lr': loguniform(0, 1)}, {}, "a log range must be above 0"),
    ({'lr': 0.1, 'momentum': []}, {}, "space['momentum']: an empty list of choices"),
    ({'lr': intrange(3, 1)}, {}, "is inverted"),
    ({'lr': 0.1}, {'metric': 'accuracy'}, "metric 'accuracy' is not among the results the trainer reports: "
                                          "train_loss, valid_loss"),
    ({'lr': 0.1}, {'metric': 'speed'}, "say direction='minimize' or direction='maximize'"),
    ({'lr': 0.1}, {'storage': 'sqlite:////no/such/dir/x.db'}, "storage 'sqlite:////no/such/dir/x.db' can't be opened"),
])
def test_bad_input_is_refused_before_any_trial_trains(space, kw, msg):
    with pytest.raises((ValueError, SearchError)) as e: search(P.make, space, n_trials=2, study_name='bad', **kw)
    assert msg in str(e.value)
    assert not list(Path('.').glob('runs/bad/trial-*/record.json'))   # nothing trained, nothing recorded


def test_config_search():
    cfg = {'imports': ['search_parts'], 'import_dirs': [str(Path(P.__file__).parent)], 'model': 'lin',
           'data': 'lin_data', 'loss': 'mse', 'optimizer': 'SGD', 'fit': {'epochs': 1}, 'checkpoint': False,
           'metrics_log': False}
    with pytest.raises(ValueError, match="model.hidden"):
        search(cfg, {'model.hidden': [4, 8]}, n_trials=2, study_name='cfg-bad')
    s = search(cfg, {'lr': loguniform(1e-2, 0.3), 'optimizer.momentum': [0.0, 0.5]}, n_trials=3, study_name='cfg')
    assert len(s.table()) == 3 and (s.table()['state'] == 'complete').all()
    r = runs('runs/cfg', kernel=False)
    assert sorted(r['trial']) == [0, 1, 2] and 'optimizer.momentum' in r.columns


def test_background_search_stops_and_goes_on():
    s = search(P.make, SPACE, n_trials=30, study_name='bg', seed=4, pruner=None, background=True, epochs=50)
    deadline = time.monotonic() + 60
    while s.current is None or s.current.state.step < 3:   # (a trial is training)
        assert time.monotonic() < deadline and not s.done.is_set()
        time.sleep(0.01)
    s.stop()
    s.wait(60)
    rows = s.trials()
    assert rows[-1]['state'] == 'interrupted' and len(rows) < 30
    # the same study goes on: the interrupted trial does not count, the finished ones are kept
    s2 = search(P.make, SPACE, n_trials=len(rows), study_name='bg', pruner=None, epochs=1)
    states = [r['state'] for r in s2.trials()]
    assert states[:len(rows)] == [r['state'] for r in rows] and states[-1] == 'complete'
    assert sum(st != 'interrupted' for st in states) == len(rows)


@pytest.mark.parametrize('kind', ['grid', 'brute'])
def test_a_sampler_that_tries_every_combination_ends_the_search(kind):
    """Optuna's GridSampler and BruteForceSampler stop the study when every combination has run (Optuna allows that
    inside `Study.optimize` only): the search ends there, each combination tried once, and a search that goes on with
    the same study trains nothing more."""
    grid = {'lr': [0.01, 0.1], 'momentum': [0.0, 0.9]}
    def sampler():
        return (optuna.samplers.GridSampler(grid, seed=0) if kind == 'grid'
                else optuna.samplers.BruteForceSampler(seed=0))
    s = search(P.make, {**grid, 'epochs': 1}, n_trials=10, sampler=sampler(), study_name=kind, pruner=None)
    df = s.table()
    assert s.exhausted and len(df) == 4 and (df['state'] == 'complete').all(), df
    assert sorted(zip(df['lr'], df['momentum'])) == [(0.01, 0.0), (0.01, 0.9), (0.1, 0.0), (0.1, 0.9)]
    assert 'every combination tried' in repr(s) and 'every combination' in still_bundle(s)[0]['text/html']
    again = search(P.make, {**grid, 'epochs': 1}, n_trials=10, sampler=sampler(), study_name=kind, pruner=None)
    assert len(again.study.trials) == 4 or kind == 'brute'   # (BruteForceSampler cannot say it is done before a trial)
    assert again.exhausted


def test_optuna_is_optional():
    "`import trainer_nb.all` does not import Optuna; without it, a search says how to install it."
    code = ("import sys\nimport trainer_nb.all\nprint('optuna' in sys.modules)\n"
            "sys.modules['optuna'] = None   # (as if it were not installed)\n"
            "from trainer_nb.search import search\n"
            "try: search(lambda lr: None, {'lr': 0.1}, n_trials=1)\nexcept ImportError as e: print(e)\n")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, 'PYTHONPATH': str(Path(__file__).parents[1])})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0] == 'False'
    assert 'pip install trainer_nb[search]' in lines[1]


def _config(tmp_path, epochs: int, trials: int) -> Path:
    "A config of the linear problem with a search: section (YAML, as a user writes it)."
    p = tmp_path / 'lin.yaml'
    p.write_text(f"""name: lin
imports: [search_parts]
import_dirs: [{Path(P.__file__).parent}]
model: lin
data: lin_data
loss: mse
optimizer: SGD
fit: {{epochs: {epochs}}}
checkpoint: false
metrics_log: false
search:
  lr: {{log: [1e-3, 1e-1]}}
  optimizer.momentum: [0.0, 0.5, 0.9]
  trials: {trials}
  pruner: null
""")
    return p


def _cli(*args):
    "`trainer-nb search ARGS` in a process of its own, its output in files (a pipe nobody reads would block it)."
    n = len(list(Path('.').glob('out-*.txt')))
    out, err = open(f'out-{n}.txt', 'w+'), open(f'err-{n}.txt', 'w+')
    p = subprocess.Popen([sys.executable, '-m', 'trainer_nb', 'search', *map(str, args)], stdout=out, stderr=err,
                         env={**os.environ, 'PYTHONPATH': str(Path(__file__).parents[1])})
    p.out, p.err = Path(out.name), Path(err.name)
    return p


def _ended(p, timeout=300) -> str:
    "Wait for `p`; its output (a failure: its errors)."
    p.wait(timeout)
    assert p.returncode == 0, p.err.read_text()[-3000:]
    return p.out.read_text()


def _study(name: str):
    from optuna.storages.journal import JournalFileBackend
    storage = optuna.storages.JournalStorage(JournalFileBackend(f'runs/{name}/study.journal'))
    return optuna.load_study(study_name=name, storage=storage)


def test_two_workers_share_one_study(tmp_path):
    cfg = _config(tmp_path, epochs=2, trials=8)
    _ended(_cli(cfg, '--workers', 2, '--study', 'two'))
    trials = _study('two').trials
    assert len(trials) == 8 and sorted(t.number for t in trials) == list(range(8))
    assert all(t.state.name == 'COMPLETE' for t in trials)
    assert len({t.user_attrs['pid'] for t in trials}) == 2   # both worked
    assert len({t.user_attrs['dir'] for t in trials}) == 8   # a run each, none trained twice
    recs = [json.loads(p.read_text()) for p in Path('runs/two').glob('trial-*/record.json')]
    assert len(recs) == 8 and {r['status'] for r in recs} == {'done'}


def test_a_killed_search_goes_on(tmp_path):
    cfg = _config(tmp_path, epochs=60, trials=3)
    p = _cli(cfg, '--study', 'killed')
    deadline = time.monotonic() + 120
    rec = Path('runs/killed/trial-001/record.json')
    while not (rec.is_file() and json.loads(rec.read_text())['status'] == 'running'):   # the second trial trains
        assert p.poll() is None and time.monotonic() < deadline, p.err.read_text()[-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = _study('killed').trials
    assert [t.state.name for t in before] == ['COMPLETE', 'RUNNING']
    out = _ended(_cli(cfg, 'fit.epochs=2', '--study', 'killed'))
    after = _study('killed').trials
    assert after[0].value == before[0].value and after[0].state.name == 'COMPLETE'   # kept, not run again
    assert after[1].state.name == 'FAIL' and after[1].user_attrs['failure'] == 'interrupted'
    assert [t.state.name for t in after[2:]] == ['COMPLETE', 'COMPLETE'] and len(after) == 4
    assert json.loads(rec.read_text())['status'] == 'running'   # the killed trial's record: runs() reads it 'killed'
    assert runs('runs/killed', kernel=False).set_index('name').loc['trial-001', 'status'] == 'killed'
    assert 'best:' in out


def test_the_view_shows_the_trials_best_first_and_the_best_curves():
    s = search(P.make, {**SPACE, 'momentum': 0.5}, n_trials=5, study_name='view', seed=5, pruner=None)
    from trainer_nb.search import SearchView, overlay_png, trials_html
    html = trials_html(s)
    order = s.table(best_first=True).index.tolist()
    assert order[0] == s.best['trial']
    pos = [html.index(f'<th>{n}</th>') for n in order]   # the rows in that order
    assert pos == sorted(pos)
    c = s.compare(3)   # the best three's runs
    assert [r['name'] for r in c.records] == [f'trial-{n:03d}' for n in order[:3]]
    png = overlay_png(s, n=3)
    assert png[:8] == b'\x89PNG\r\n\x1a\n'
    v = SearchView(s)   # (the widgets, built here without a page to show them)
    v.update(s, done=True)
    assert 'max-width:100%' in v.overlay.value and 'of 5 trials' in v.status.value and v.stop_button.disabled
    assert "overflow-x:auto" in v.table.value   # a narrow page scrolls the table sideways


def test_a_background_search_leaves_a_still_picture_in_the_saved_notebook(tmp_path, monkeypatch):
    """A notebook run by nbclient and saved: the cell that started a background search holds, once the search ended,
    the overlay's PNG and the table of trials as HTML, and no widget (a notebook reopened without its kernel shows
    them)."""
    import base64
    from conftest import REPO
    from test_browser import htmls_of, pngs_of, run_nbclient, widget_views
    setup = (f"import sys\nsys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'tests')!r})\n"
             "import search_parts as P\nfrom trainer_nb.search import search, loguniform")
    nb = run_nbclient(tmp_path, monkeypatch, [
        setup,
        "s = search(P.make, {'lr': loguniform(1e-3, 1.0), 'momentum': 0.5, 'epochs': 2}, n_trials=4, "
        "study_name='still', seed=5, pruner=None, background=True)",
        "s.wait(); print('ENDED', len(s.study.trials), s.best['trial'])"])
    assert 'ENDED 4' in ''.join(o.get('text', '') for o in nb.cells[2].outputs)
    outs = nb.cells[1].outputs
    assert not widget_views(outs), outs
    pngs = pngs_of(outs)
    assert len(pngs) == 1 and pngs[0][:8] == b'\x89PNG\r\n\x1a\n' and len(pngs[0]) > 5000
    html = ''.join(htmls_of(outs))
    assert '<table' in html and html.count('<th>valid_loss</th>') == 1 and 'ended: 4 of 4 trials' in html
    assert all(f'<th>{n}</th>' in html for n in range(4))   # a row a trial
    assert base64.b64encode(pngs[0]).decode() in html       # the picture in the HTML too


def _launch(args, cwd, timeout):
    """`accelerate launch` of `args` on two processes (gloo on the CPU, as tests/test_distributed.py does); on a
    timeout the whole group of processes is killed and the test fails with what they wrote."""
    from conftest import REPO, VENV_BIN, free_port
    env = dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1',
               PYTHONPATH=str(REPO))
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()), *map(str, args)]
    with open(cwd / 'launch.txt', 'w+') as out:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try: p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"the two processes did not end in {timeout} s:\n{(cwd / 'launch.txt').read_text()[-4000:]}")
    assert p.returncode == 0, (cwd / 'launch.txt').read_text()[-4000:]


def test_a_trial_on_two_processes_reports_from_rank_0_and_prunes_on_both(tmp_path):
    """A trial's fit launched on two processes (gloo, for real): the main process reports each validation to the trial,
    the pruner's decision reaches both, and both stop at the same step, pruned (a decision on one process only would
    leave the other waiting in its next gradient exchange)."""
    from conftest import REPO
    _launch([REPO / 'tests' / 'search_dist_script.py', tmp_path], tmp_path, 120)
    r0, r1 = (json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1))
    assert r0['status'] == r1['status'] == 'pruned' and r0['step'] == r1['step'] == r0['pruned'] == r1['pruned'] == 4
    assert [s for s, _ in r0['values']] == [s for s, _ in r1['values']] == [2, 4]
    assert r0['values'] == r1['values']                           # the same validations (gathered over both)
    assert r0['study'] == {str(s): v for s, v in r0['values']}    # reported once each, by the main process


def test_a_search_launched_on_two_processes_trains_each_trial_on_both(tmp_path):
    """`trainer-nb search` under `accelerate launch` on two processes (gloo, for real): the main process alone asks and
    tells the study, the other trains each trial with it, from the parameters it is sent; the trials are N, each
    reported once, by one process, and pruned or not on both together."""
    cfg = _config(tmp_path, epochs=2, trials=4)
    _launch(['-m', 'trainer_nb', 'search', cfg, '--study', 'dist'], tmp_path, 240)
    trials = _study('dist').trials
    assert len(trials) == 4 and sorted(t.number for t in trials) == list(range(4)), [t.number for t in trials]
    assert len({t.user_attrs['pid'] for t in trials}) == 1                 # one process asked them all
    assert all(t.state.name in ('COMPLETE', 'PRUNED') for t in trials)
    assert all(t.intermediate_values for t in trials)
    done = [t for t in trials if t.state.name == 'COMPLETE']
    assert done and all(max(t.intermediate_values) == 12 for t in done)  # 2 epochs of 6 steps each on 2 processes


def test_a_lock_a_killed_search_left_is_broken(tmp_path, monkeypatch):
    """A search SIGKILLed while it wrote its journal leaves the journal's lock (a symlink) behind: the next one on the
    study waits Optuna's grace period (30 s) and goes on. The symlink pointed at the journal's path relative to the
    working folder, which a symlink reads from its own folder: the next search spun on the lock for ever."""
    import threading
    from trainer_nb.search import open_storage
    monkeypatch.chdir(tmp_path)
    path = Path('runs/stale/study.journal')   # relative, as a config's run folder is
    held = open_storage(path, path)
    held._backend._lock.acquire()   # taken and never released: what a process killed while writing leaves
    target = os.path.join(path.parent, os.readlink(f'{path}.lock'))   # (a symlink's target: from its own folder)
    assert os.path.isfile(target), target
    made = []
    worker = threading.Thread(target=lambda: made.append(optuna.create_study(
        storage=open_storage(path, path), study_name='stale')), daemon=True)
    worker.start()
    worker.join(180)
    assert not worker.is_alive() and made and made[0].study_name == 'stale'
