"""Two processes on the CPU (gloo), launched for real with `accelerate launch`.

On the CPU, `accelerate launch --cpu` starts one process only (several CPU processes need mpirun), so this
uses Accelerate's torchrun-based launcher (`--multi_gpu`) with `ACCELERATE_USE_CPU=1`, which makes each
process join a gloo group on the CPU.
"""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, VENV_BIN, free_port

pytestmark = pytest.mark.usefixtures('fresh_accelerate')

SCRIPT = REPO / 'tests' / 'dist_script.py'
BATCH = 8        # per process


def _script_module():
    spec = importlib.util.spec_from_file_location('dist_script', SCRIPT)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp('dist')
    env = dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()),
           str(SCRIPT), str(out), str(BATCH)]
    p = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [torch.load(out / f'rank{r}.pt', weights_only=False) for r in (0, 1)]
    return p.stdout, ranks


@pytest.fixture(scope='module')
def single():
    """The same training in this process, on one process with the global batch (2 x BATCH), on the CPU as the two
    processes are (where a GPU is visible too)."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True); GradientState._reset_state()
    mod = _script_module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('ACCELERATE_USE_CPU', '1')   # (read when the trainer makes its accelerator)
        t = mod.make_trainer(2 * BATCH)
    t.remove_hooks(*t.hooks)
    t.fit(mod.EPOCHS)
    fit_valid = dict(t.valid_results)
    preds, targets = t.predict(t.valid_dl)
    weights = {k: v.detach().clone() for k, v in t.unwrapped_model.state_dict().items()}
    AcceleratorState._reset_state(True); GradientState._reset_state()
    return mod, t.state, weights, fit_valid, preds, targets


def test_two_processes_ran(run):
    _, ranks = run
    assert [r['rank'] for r in ranks] == [0, 1]
    assert all(r['num_processes'] == 2 for r in ranks)


def test_weights_identical_and_equal_to_single_process(run, single):
    _, ranks = run
    _, _, ref, *_ = single
    w0, w1 = ranks[0]['weights'], ranks[1]['weights']
    assert w0.keys() == w1.keys() == ref.keys()
    for k in ref:
        assert torch.equal(w0[k], w1[k]), k
        torch.testing.assert_close(w0[k], ref[k], atol=1e-5, rtol=0)


def test_background_fit_is_refused_on_several_processes(run):
    "Under launch, `background=True` is refused on every process, with what to do instead; nothing ran in a thread."
    _, ranks = run
    for r in ranks:
        assert r['background'].startswith("fit(background=True) runs the call in a thread of this process, and this "
                                          "trainer trains on 2 processes")
        assert 'call fit without background=' in r['background']


def test_counters(run, single):
    _, ranks = run
    mod, state, *_ = single
    for r in ranks:
        s = r['state']
        assert s['step'] == s['iteration'] == state.step == mod.EPOCHS * mod.N_TRAIN // (2 * BATCH)
        assert s['samples'] == state.samples == mod.EPOCHS * mod.N_TRAIN   # counted over both processes
        assert s['epoch'] == mod.EPOCHS


def test_evaluation_counts_every_sample_once(run, single):
    "101 validation samples, batches of 10 on 2 processes: the padding Accelerate adds is dropped."
    _, ranks = run
    mod, _, _, fit_valid, preds, targets = single
    for r in ranks:
        assert r['fit_eval_samples'] == mod.N_VALID == 101
        assert r['preds_rows'] == r['targets_rows'] == 101
        torch.testing.assert_close(r['targets'], mod.make_data()[1].tensors[1])     # in order, no duplicates
        torch.testing.assert_close(r['preds'], preds, atol=1e-5, rtol=0)
        assert r['valid_results']['mae'] == pytest.approx(fit_valid['mae'], abs=1e-5)


def test_valid_loss_equals_single_process(run, single):
    _, ranks = run
    *_, fit_valid, _, _ = single
    for r in ranks:
        assert r['valid_results']['valid_loss'] == pytest.approx(fit_valid['valid_loss'], rel=1e-5)


def test_named_validation_loaders_equal_single_process(run, single):
    "valid_dl as a dict: each loader's loss and metric, over both processes, as on one process."
    from accelerate.state import AcceleratorState, GradientState
    _, ranks = run
    mod = single[0]
    AcceleratorState._reset_state(True); GradientState._reset_state()
    try: want = mod.named_run(2 * BATCH)
    finally: AcceleratorState._reset_state(True); GradientState._reset_state()
    names = ['valid_all_loss', 'valid_all_mae', 'valid_few_loss', 'valid_few_mae']
    assert [k for k in want if k.startswith('valid_')] == names
    for r in ranks:
        for k in names: assert r['named'][k] == pytest.approx(want[k], rel=1e-5), k


def test_only_main_process_prints(run):
    stdout, ranks = run
    epochs = _script_module().EPOCHS
    lines = [l for l in stdout.splitlines() if l.startswith('epoch ')]
    assert len(lines) == epochs, stdout
    assert [l.split()[1] for l in lines] == [str(i) for i in range(1, epochs + 1)]   # epochs counted from 1
    assert ranks[0]['epoch_results']['train_loss'] == ranks[1]['epoch_results']['train_loss']   # averaged over processes


def test_main_process_hook_runs_on_main_only(run):
    _, (r0, r1) = run
    n = r0['state']['iteration']
    assert (r0['calls_everywhere'], r1['calls_everywhere']) == (n, n)
    assert (r0['calls_on_main'], r1['calls_on_main']) == (n, 0)
    col = 'hooks (order)'
    assert r0['describe'][col]['after_batch'] == 'CountEverywhere (0), CountOnMain (0)'
    assert r1['describe'][col]['after_batch'] == 'CountEverywhere (0), CountOnMain (0) [main process only]'
    assert r1['describe'][col]['after_epoch'] == 'PrintMetrics (90) [main process only]'


def test_uneven_train_set_counts_real_samples(run):
    "61 training samples in global batches of 16: the copies padding the last batch are not counted."
    _, ranks = run
    mod = _script_module()
    for r in ranks:
        s = r['uneven']['state']
        assert s['iteration'] == mod.EPOCHS * 4
        assert s['samples'] == mod.N_UNEVEN * mod.EPOCHS


def test_nan_skip_on_one_process_skips_on_all(run):
    "The NaN sample is in process 0's share of step 1 only: both processes skip that step, and stay in step."
    _, (r0, r1) = run
    mod = _script_module()
    u0, u1 = r0['uneven'], r1['uneven']
    for u in (u0, u1):
        assert u['state']['step'] == mod.EPOCHS * 3          # one step of 4 skipped, in each epoch
        assert len(u['skipped']) == mod.EPOCHS and all('Skipped batch 2 of epoch' in m for m in u['skipped'])
        assert all(torch.isfinite(w).all() for w in u['weights'].values())
    assert all('non-finite loss nan' in m for m in u0['skipped'])
    assert all('non-finite loss on another process' in m for m in u1['skipped'])
    assert math.isnan(u0['losses'][1]) and math.isfinite(u1['losses'][1])    # each logs its own loss
    for k in u0['weights']:
        assert torch.equal(u0['weights'][k], u1['weights'][k]), k
