"""Streaming metrics: equal to the plain ones (alone, mixed, and over 2 gloo processes on an uneven set), and flat
memory when evaluating a million samples."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, VENV_BIN, free_port

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
SCRIPT = str(REPO / 'tests' / 'metrics_script.py')
sys.path.insert(0, str(REPO / 'tests'))


def memory(tmp_path, n, kind):
    out = tmp_path / f'{kind}_{n}.json'
    p = subprocess.run([sys.executable, SCRIPT, 'memory', str(n), kind, str(out)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason="needs Linux's /proc/self/clear_refs")
def test_a_million_samples_streaming_memory_stays_flat(tmp_path):
    small, big = memory(tmp_path, 100_000, 'streaming'), memory(tmp_path, 1_000_000, 'streaming')
    plain = memory(tmp_path, 1_000_000, 'plain')
    assert big['samples'] == plain['samples'] == 1_000_000
    assert big['result']['accuracy'] == plain['result']['accuracy']   # exactly the plain metric's
    # the plain metric holds every prediction (1M x 10 float32 = 40 MB) and target (8 MB); the streaming one none
    assert plain['peak'] > 40e6, plain
    assert big['peak'] < 10e6 and big['peak'] < small['peak'] + 4e6, (small, big)


def test_streaming_equals_plain_mixed_and_errors_named():
    from metrics_script import accuracy
    from torch.utils.data import DataLoader, TensorDataset
    from trainer_nb.core import Trainer
    from trainer_nb.metrics import Accuracy, Metric
    g = torch.Generator().manual_seed(0)
    x = torch.randn(333, 8, generator=g)
    dl = DataLoader(TensorDataset(x, torch.randint(0, 4, (333,), generator=g)), batch_size=32)
    torch.manual_seed(0)
    t = Trainer(torch.nn.Linear(8, 4), loss_func=F.cross_entropy, metrics=[Accuracy('acc_s'), accuracy], cpu=True,
                default_hooks=False)
    res = t.evaluate(dl)
    assert res['acc_s'] == res['accuracy'] and list(res) == ['valid_loss', 'acc_s', 'accuracy']
    class Broken(Metric):
        def reset(self): pass
        def update(self, p, y): raise RuntimeError("bad update")
        def compute(self): return 0.
    t = Trainer(torch.nn.Linear(8, 4), loss_func=F.cross_entropy, metrics=[Broken()], cpu=True, default_hooks=False)
    with pytest.raises(RuntimeError, match='bad update') as e: t.evaluate(dl)
    assert "streaming metric 'broken'" in '\n'.join(e.value.__notes__)
    with pytest.raises(TypeError, match='or streaming metrics'): Trainer(torch.nn.Linear(8, 4), metrics=[3])


def test_two_processes_equal_the_plain_metrics_and_one_process(tmp_path):
    env = dict(os.environ, ACCELERATE_USE_CPU='1', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()),
           SCRIPT, 'dist', str(tmp_path)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1)]
    one = tmp_path / 'one'
    one.mkdir()
    p = subprocess.run([sys.executable, SCRIPT, 'dist', str(one)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    single = json.loads((one / 'rank0.json').read_text())
    assert [r['processes'] for r in ranks] == [2, 2] and single['processes'] == 1
    for r in ranks:
        res = r['result']
        assert r['samples'] == 101
        assert res['streaming_accuracy'] == res['accuracy'] == single['result']['accuracy']
        assert res['streaming_mae'] == pytest.approx(res['mae'], rel=1e-12, abs=0)
        assert res['streaming_mae'] == pytest.approx(single['result']['streaming_mae'], rel=1e-12, abs=0)
