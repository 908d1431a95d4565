"""The same config, unchanged, on several processes: `accelerate launch -m trainer_nb train` with 2 processes on one
machine, with 2 "machines" of 1 process each on 127.0.0.1, and `torchrun -m trainer_nb train`; all on the CPU (gloo).

Each run's final weights must be identical on every process and equal (within float tolerance) to one process
training on the same global batch; only the main process prints and writes the run directory.
"""
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, VENV_BIN, free_port

PER_PROCESS_BS = 8
EPOCHS = 3
N_TRAIN = 64

CONFIG = f"""
imports: [cli_parts]
data: {{type: regression_data, bs: {PER_PROCESS_BS}, shuffle: true}}
model: regression_model
loss: mse_loss
metrics: [mae]
optimizer: {{type: SGD, momentum: 0.9}}
schedule: one_cycle
fit: {{epochs: {EPOCHS}, lr: 0.05}}
hooks: [{{type: SaveWeights, out: weights}}]
run_dir: runs/{{name}}-{{time}}
"""


def _workdir(tmp_path_factory, name):
    d = tmp_path_factory.mktemp(name)
    (d / 'reg.yaml').write_text(CONFIG)
    shutil.copy(REPO / 'tests' / 'cli_parts.py', d / 'cli_parts.py')
    return d


def _env():
    # the CPU for every process (gloo); one thread each: two processes share this machine's cores
    return dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')


def _launch(extra: list, cwd, machine_rank=None):
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--mixed_precision', 'no', '--dynamo_backend', 'no',
           *extra, '-m', 'trainer_nb', 'train', 'reg.yaml']
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(workdir, stdout: str, ranks=(0, 1)):
    runs = sorted((workdir / 'runs').iterdir())
    return {'stdout': stdout, 'runs': runs,
            'ranks': [torch.load(workdir / 'weights' / f'rank{r}.pt', weights_only=False) for r in ranks]}


def _finish(p, timeout=240):
    try: out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill(); out, err = p.communicate()
        raise AssertionError(f"timed out:\n{out[-3000:]}\n{err[-3000:]}")
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return out


@pytest.fixture(scope='module')
def single(tmp_path_factory):
    "One process, global batch of 2 x PER_PROCESS_BS."
    d = _workdir(tmp_path_factory, 'single')
    p = subprocess.run([sys.executable, '-m', 'trainer_nb', 'train', 'reg.yaml', f'data.bs={2 * PER_PROCESS_BS}'],
                       cwd=d, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return _result(d, p.stdout, ranks=(0,))


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
    d = _workdir(tmp_path_factory, 'two_processes')
    p = _launch(['--num_processes', '2', '--num_machines', '1', '--main_process_port', str(free_port())], d)
    return _result(d, _finish(p))


@pytest.fixture(scope='module')
def two_machines(tmp_path_factory):
    "Two launchers, each a 'machine' of one process, meeting at 127.0.0.1."
    d = _workdir(tmp_path_factory, 'two_machines')
    port = str(free_port())
    ps = [_launch(['--num_processes', '2', '--num_machines', '2', '--machine_rank', str(r),
                   '--main_process_ip', '127.0.0.1', '--main_process_port', port], d) for r in (0, 1)]
    outs = [_finish(p) for p in ps]
    return _result(d, outs[0]) | {'stdout_machine1': outs[1]}


@pytest.fixture(scope='module')
def torchrun(tmp_path_factory):
    d = _workdir(tmp_path_factory, 'torchrun')
    return _result(d, _finish(_torchrun(d, _env())))


def _torchrun(cwd, env, *overrides):
    return subprocess.Popen([str(VENV_BIN / 'torchrun'), '--nproc_per_node', '2', '--master_addr', '127.0.0.1',
                             '--master_port', str(free_port()), '-m', 'trainer_nb', 'train', 'reg.yaml', *overrides],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_torchrun_without_the_cpu_setting_is_refused(tmp_path_factory):
    "With no GPU, Accelerate runs each of torchrun's processes alone unless told to use the CPU: an error, not 2 runs."
    d = _workdir(tmp_path_factory, 'torchrun_alone')
    env = {k: v for k, v in _env().items() if k != 'ACCELERATE_USE_CPU'}
    p = _torchrun(d, env)
    out, err = p.communicate(timeout=240)
    assert p.returncode != 0
    assert err.count('started as one of 2 (WORLD_SIZE=2)') == 2 and 'trainer_args.cpu=true' in err, err[-3000:]
    assert 'trainer_nb/registry.py' not in err    # no traceback of ours (torchrun prints its own report)
    assert not (d / 'runs').exists() and out.strip() == ''
    # with the setting in the config instead of the environment, it runs
    p = _torchrun(d, env, 'trainer_args.cpu=true')
    _finish(p)
    assert len(list((d / 'runs').iterdir())) == 1


RUNS = ['two_processes', 'two_machines', 'torchrun']


@pytest.mark.parametrize('name', RUNS)
def test_weights_identical_on_every_rank_and_equal_to_one_process(name, request, single):
    r = request.getfixturevalue(name)
    (ref,) = single['ranks']
    w0, w1 = (x['weights'] for x in r['ranks'])
    assert [x['num_processes'] for x in r['ranks']] == [2, 2] and ref['num_processes'] == 1
    assert [x['rank'] for x in r['ranks']] == [0, 1]
    for k in ref['weights']:
        assert torch.equal(w0[k], w1[k]), k
        torch.testing.assert_close(w0[k], ref['weights'][k], atol=1e-5, rtol=0)
    assert not torch.equal(ref['weights']['0.weight'], torch.zeros_like(ref['weights']['0.weight']))
    steps = EPOCHS * N_TRAIN // (2 * PER_PROCESS_BS)
    for x in (*r['ranks'], ref):
        assert x['state']['step'] == steps and x['state']['samples'] == EPOCHS * N_TRAIN


@pytest.mark.parametrize('name', RUNS)
def test_one_run_directory_written_by_the_main_process(name, request):
    r = request.getfixturevalue(name)
    assert len(r['runs']) == 1, r['runs']                    # the same name on every process (chosen by rank 0)
    run = r['runs'][0]
    assert [x['run_dir'] for x in r['ranks']] == [f'runs/{run.name}'] * 2
    names = {p.name for p in run.iterdir()}
    assert {'config.json', 'history.csv', 'loss_lr.png', 'metrics.jsonl'} <= names
    assert not [n for n in names if n.startswith(('.tmp', '.trash'))]
    cks = sorted(n for n in names if n.startswith('step-'))
    assert cks == [f'step-{s:08d}' for s in (4, 8, 12)]
    # in each checkpoint: the main process's files, and each process's own generator states and losses
    files = {p.name for p in (run / cks[-1]).iterdir()}
    assert {'model.safetensors', 'trainer_state.json', 'rng_0.json', 'rng_1.json'} <= files


@pytest.mark.parametrize('name', RUNS)
def test_only_the_main_process_prints(name, request):
    r = request.getfixturevalue(name)
    out = r['stdout'] + r.get('stdout_machine1', '')
    lines = out.splitlines()
    assert sum(l.startswith('run directory: ') for l in lines) == 1, out
    assert sum(l.startswith('valid loss: ') for l in lines) == 1, out
    assert lines[-1].startswith('valid mae: '), out
    if 'stdout_machine1' in r: assert r['stdout_machine1'].strip() == '', r['stdout_machine1']
    # the epoch table of the Progress hook: once
    assert sum(l.split()[:1] == ['epoch'] for l in lines) == 1, out


def test_valid_results_agree_with_one_process(two_processes, single):
    last = lambda out: float(out.strip().splitlines()[-1].split()[-1])
    assert last(two_processes['stdout']) == pytest.approx(last(single['stdout']), abs=2e-4)


def _rank_of(pid) -> int | None:
    "The RANK a launched worker was given (None for another process)."
    try: env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
    except OSError: return None
    ranks = [int(e[5:]) for e in env if e.startswith(b'RANK=')]
    return ranks[0] if ranks else None


KILL_CONFIG = """
imports: [cli_parts]
data: {type: regression_data, n: 256, bs: 8, shuffle: true}
model: regression_model
loss: mse_loss
optimizer: {type: SGD, momentum: 0.9}
schedule: one_cycle
fit: {epochs: 3, lr: 0.05}
checkpoint: {every_steps: 4}
hooks: [{type: SaveWeights, out: weights}]
run_dir: runs/{name}
"""


def _launch_kill_config(d, *overrides):
    "`accelerate launch` of 2 processes training KILL_CONFIG in `d`, with `overrides`: the process."
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--mixed_precision', 'no', '--dynamo_backend', 'no',
           '--num_processes', '2', '--num_machines', '1', '--main_process_port', str(free_port()),
           '-m', 'trainer_nb', 'train', 'kill.yaml', *overrides]
    return subprocess.Popen(cmd, cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope='module')
def whole_run(tmp_path_factory):
    "The run of KILL_CONFIG never interrupted, on 2 processes: the folder of each rank's final weights."
    d = _workdir(tmp_path_factory, 'whole')
    (d / 'kill.yaml').write_text(KILL_CONFIG)
    _finish(_launch_kill_config(d, 'hooks.0.out=weights_whole', 'run_dir=runs/whole'))
    return d / 'weights_whole'


@pytest.mark.skipif(sys.platform != 'linux', reason="finds the workers' ranks in /proc")
@pytest.mark.parametrize('victim', [1, 0])
def test_a_rank_killed_mid_epoch_ends_the_job_and_the_run_resumes_exactly(tmp_path_factory, whole_run, victim):
    """SIGKILL one rank of a 2-process run mid-epoch: the job ends (no rank left waiting in a collective), non-zero,
    naming the rank that died; `fit.resume=last` then ends with the weights of a run never interrupted."""
    import psutil
    d = _workdir(tmp_path_factory, f'killed{victim}')
    (d / 'kill.yaml').write_text(KILL_CONFIG)
    def launch(*overrides): return _launch_kill_config(d, *overrides)
    # mid-epoch 1 (16 steps an epoch), slowed down from there so that the kill surely lands mid-fit
    p = launch('run_dir=runs/killed', 'hooks=[{type: SaveWeights, out: weights_killed}, '
               '{type: Pause, at_step: 21, sleep: 0.05}]')
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith('PAUSED'): break
    assert seen and seen[-1].startswith('PAUSED'), ''.join(seen) + p.stderr.read()
    ranks = {_rank_of(q.pid): q for q in psutil.Process(p.pid).children(recursive=True)}
    ranks[victim].kill()
    t0 = time.monotonic()
    try: out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for q in psutil.Process(p.pid).children(recursive=True): q.kill()
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"the job was still running 60 s after rank {victim} was killed:\n{err[-5000:]}")
    assert time.monotonic() - t0 < 60
    assert p.returncode != 0
    assert f"rank      : {victim} (local_rank: {victim})\n  exitcode  : -9" in err, err[-3000:]   # the root cause
    assert not [q for q in ranks.values() if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
    cks = sorted(x.name for x in (d / 'runs' / 'killed').iterdir() if x.name.startswith('step-'))
    assert cks and 20 <= int(cks[-1][5:]) < 48, cks
    _finish(launch('run_dir=runs/killed', 'fit.resume=last', 'hooks.0.out=weights_resumed'))
    for r in (0, 1):
        a, b = (torch.load(w / f'rank{r}.pt', weights_only=False) for w in (d / 'weights_resumed', whole_run))
        assert a['state']['step'] == b['state']['step'] == 48
        for k in b['weights']: assert torch.equal(a['weights'][k], b['weights'][k]), (r, k)
