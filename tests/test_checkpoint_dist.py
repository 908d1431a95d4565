"""Checkpoints on two processes (gloo on the CPU, launched for real as in `test_distributed.py`): a run killed on every
process and resumed ends bitwise equal to one never interrupted; only the main process writes the shared files;
early stopping ends every process at the same epoch."""
import json
import os
import re
import subprocess

import pandas as pd
import pytest
import torch

from conftest import REPO, VENV_BIN, free_port

pytestmark = pytest.mark.usefixtures('fresh_accelerate')

SCRIPT = REPO / 'tests' / 'ckpt_dist_script.py'
KILL_AT = 9   # epoch 1, batch 3 (6 iterations per epoch); the last checkpoint before it: step 8


def launch(cfg, cwd):
    env = dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()),
           str(SCRIPT), json.dumps(cfg)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def load_ranks(out):
    return [torch.load(f'{out}_rank{r}.pt', weights_only=False) for r in (0, 1)]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "An uninterrupted two-process run; one killed (SIGKILL on both processes) after a checkpoint; its resume."
    base = tmp_path_factory.mktemp('ckpt_dist')
    ref_dir, run_dir = base / 'ref', base / 'run'
    p = launch({'dir': str(ref_dir), 'out': str(base / 'ref'), 'ckpt': False, 'es_divergent': True}, base)
    assert p.returncode == 0, p.stderr[-4000:]
    ref = load_ranks(base / 'ref')
    killed = launch({'dir': str(run_dir), 'out': str(base / 'killed'), 'kill_at': KILL_AT}, base)
    after_kill = sorted(x.name for x in run_dir.iterdir())
    resumed = launch({'dir': str(run_dir), 'out': str(base / 'resumed'), 'resume': 'last'}, base)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return {'ref': ref, 'ref_dir': ref_dir, 'killed': killed, 'after_kill': after_kill, 'resumed': resumed,
            'res': load_ranks(base / 'resumed'), 'run_dir': run_dir, 'base': base}


def test_killed_on_both_processes_after_a_checkpoint(runs):
    p = runs['killed']
    assert p.returncode != 0
    for r in (0, 1): assert f'KILL rank {r} at iteration {KILL_AT}' in p.stdout, p.stdout
    assert not (runs['base'] / 'killed_rank0.pt').exists() and not (runs['base'] / 'killed_rank1.pt').exists()
    cks = [n for n in runs['after_kill'] if n.startswith('step-')]
    assert cks[-1] == 'step-00000008'   # saved after iteration 8, then killed before iteration 9 was trained
    assert 'LOCK' in runs['after_kill']   # left by the killed main process, taken over by the resume


def test_resume_is_bitwise_equal_on_both_processes_and_to_uninterrupted(runs):
    ref, res = runs['ref'], runs['res']
    assert [r['rank'] for r in res] == [0, 1] and all(r['num_processes'] == 2 for r in res)
    w_ref = ref[0]['weights']
    for r in (*res, ref[1]):
        assert r['weights'].keys() == w_ref.keys()
        for k in w_ref: assert torch.equal(r['weights'][k], w_ref[k]), (r['rank'], k)
    for r in res:
        assert r['state'] == ref[0]['state']
        assert r['state']['iteration'] == 18 and r['state']['epoch'] == 2   # early stopping: 3 epochs of 6
    # the metrics log: the same lines as the uninterrupted run's, each step once
    from trainer_nb.monitor import read_metrics
    a, b = read_metrics(runs['ref_dir']).drop(columns='time'), read_metrics(runs['run_dir']).drop(columns='time')
    pd.testing.assert_frame_equal(a, b)
    assert list(b[b.kind == 'train'].step) == list(range(2, 19, 2)) and list(b[b.kind == 'epoch'].step) == [6, 12, 18]


def test_early_stopping_same_epoch_on_every_process(runs):
    ref, res = runs['ref'], runs['res']
    # the resumed run's EarlyStopping continued from the checkpoint's state, and stopped where the reference did
    for r in (*ref, *res):
        assert r['state']['epoch'] == 2 and r['cancelled'].startswith('CancelFit(') and r['es']['wait'] == 2, r['rank']
    assert len({r['cancelled'] for r in (*ref, *res)}) == 1
    # the epoch it stopped at is saved (a save on both processes, in after_cancel), marked as where the fit stopped
    from trainer_nb.checkpoint import list_checkpoints
    last = list_checkpoints(runs['run_dir'])[-1]
    st = json.loads((last / 'trainer_state.json').read_text())
    assert last.name == 'step-00000018' and st['position'] == [3, 0] and st['stopped'].startswith('Early stopping')
    # the monitored value differs between the processes: the decision is still the main process's, on both
    d0, d1 = ref[0]['divergent'], ref[1]['divergent']
    assert d0['epoch'] == d1['epoch'] == 1
    assert d0['es']['wait'] == 1 and d1['es']['wait'] == 0   # process 1 alone would have gone on
    assert d0['cancelled'].startswith('CancelFit(') and d1['cancelled'].startswith('CancelFit(')


def test_only_main_process_writes_shared_files(runs):
    from trainer_nb.checkpoint import list_checkpoints, verify_checkpoint
    res, ref = runs['res'], runs['ref']
    # process 1 writes nothing in the run directory but its own generators and losses, in the temporary checkpoint
    w1 = res[1]['writes']
    assert all(e == 'open' and re.fullmatch(r'\.tmp-step-\d{8}/(rng_1\.json|losses_1\.safetensors)', p) for e, p in w1), w1
    assert {p.split('/')[1] for _, p in w1} == {'rng_1.json', 'losses_1.safetensors'}
    assert ref[1]['writes'] == []
    w0 = {p for _, p in res[0]['writes']}
    assert {'metrics.jsonl', '.config.json.tmp', 'config.json', 'LOCK', 'best.json'} <= w0
    assert any(re.fullmatch(r'\.tmp-step-\d{8}/(rng_0|trainer_state|manifest)\.json', p) for p in w0)
    # the run directory: complete checkpoints only, each file once, both processes' generators in each
    d = runs['run_dir']
    names = sorted(x.name for x in d.iterdir())
    assert not [n for n in names if n.startswith('.') or n == 'LOCK'], names
    cks = list_checkpoints(d)
    assert [c.name for c in cks] == [n for n in names if n.startswith('step-')] and len(cks) in (2, 3)
    assert set(names) - {c.name for c in cks} == {'best.json', 'config.json', 'metrics.jsonl'}
    for c in cks:
        files = set(verify_checkpoint(c)['files'])
        assert files | {'manifest.json'} == {str(p.relative_to(c)) for p in c.rglob('*') if p.is_file()}
        assert {'rng_0.json', 'rng_1.json', 'random_states_0.pkl', 'random_states_1.pkl', 'losses_0.safetensors',
                'losses_1.safetensors', 'model.safetensors', 'optimizer.bin', 'trainer_state.json'} <= files
    # the config: written once, by the main process; the resume with the same config reports no difference
    cfg = json.loads((d / 'config.json').read_text())
    assert cfg['data'] == 'regression-96' and cfg['trainer']['num_processes'] == 2 and cfg['trainer']['epochs'] == 6
    assert 'differs' not in runs['resumed'].stdout and 'changed config' not in runs['resumed'].stderr
