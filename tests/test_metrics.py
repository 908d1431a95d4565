"""Metrics: torchmetrics (keyed, collections, non-scalar results) and plain functions, equal to scikit-learn and to each
other on 1 and 2 gloo processes (an uneven set, a process left without samples in the last batch), flat memory when
evaluating a million samples, results that a fit records, logs and checkpoints."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO, VENV_BIN, free_port

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
SCRIPT = str(REPO / 'tests' / 'metrics_script.py')
sys.path.insert(0, str(REPO / 'tests'))


def run_modes(tmp_path, modes, processes) -> dict:
    """`{mode: each process's JSON}` from `metrics_script.py MODES` (modes joined by commas, run in turn by each process)
    on `processes` processes (gloo on the CPU for 2)."""
    out = tmp_path / f"{modes.replace(',', '_')}_{processes}"
    out.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [sys.executable, SCRIPT, modes, str(out)] if processes == 1 else [
        str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
        '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()),
        SCRIPT, modes, str(out)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = {m: [json.loads((out / m / f'rank{r}.json').read_text()) for r in range(processes)]
           for m in modes.split(',')}
    assert all([r['processes'] for r in ranks] == [processes] * processes for ranks in res.values())
    return res


def run_script(tmp_path, mode, processes):
    "Each process's JSON from `metrics_script.py MODE` run on `processes` processes."
    return run_modes(tmp_path, mode, processes)[mode]


@pytest.fixture(scope='module')
def evaluated(tmp_path_factory):
    """`{(mode, processes): each process's JSON}` for the modes 'dist' and 'cls', on 1 and on 2 processes (one run
    of both modes for each: a launch costs more than either)."""
    d = tmp_path_factory.mktemp('evaluated')
    return {(m, n): ranks for n in (2, 1) for m, ranks in run_modes(d, 'dist,cls', n).items()}


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


def test_torchmetrics_keyed_and_plain_mixed_and_errors_named():
    from metrics_script import accuracy
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix
    from trainer_nb.core import Trainer
    from trainer_nb.metrics import Mean
    g = torch.Generator().manual_seed(0)
    x = torch.randn(333, 8, generator=g)
    dl = DataLoader(TensorDataset(x, torch.randint(0, 4, (333,), generator=g)), batch_size=32)
    torch.manual_seed(0)
    mk = lambda metrics: Trainer(torch.nn.Linear(8, 4), loss_func=F.cross_entropy, metrics=metrics, cpu=True,
                                 default_hooks=False)
    t = mk({'acc_s': MulticlassAccuracy(4, average='micro'), 'acc_macro': MulticlassAccuracy(4),
            'cm': MulticlassConfusionMatrix(4), 'accuracy': accuracy})
    res = t.evaluate(dl)
    assert list(res) == ['valid_loss', 'acc_s', 'acc_macro', 'cm', 'accuracy']
    assert res['acc_s'] == res['accuracy'] and res['acc_s'] != res['acc_macro']
    assert isinstance(res['cm'], torch.Tensor) and res['cm'].sum() == 333 and res['cm'].device.type == 'cpu'
    assert t.evaluate(dl)['cm'].sum() == 333   # reset per evaluation
    # a list names each by its name; a collection by its members' names (under a dict's key: key_member)
    coll = lambda: MetricCollection({'a': MulticlassAccuracy(4, average='micro'), 'b': MulticlassAccuracy(4)})
    assert list(mk([accuracy, coll()]).evaluate(dl)) == ['valid_loss', 'accuracy', 'a', 'b']
    assert list(mk({'val': coll()}).evaluate(dl)) == ['valid_loss', 'val_a', 'val_b']
    assert list(mk(coll()).evaluate(dl)) == ['valid_loss', 'a', 'b']
    with pytest.raises(ValueError, match="Two metrics are named 'MulticlassAccuracy'.*metrics=\\{'name'"):
        mk([MulticlassAccuracy(4), MulticlassAccuracy(4, average='micro')])
    with pytest.raises(ValueError, match="Two metrics are named 'a'"): mk([coll(), coll()])
    with pytest.raises(ValueError, match="can't be named 'valid_loss'"): mk({'valid_loss': accuracy})
    with pytest.raises(TypeError, match='or streaming metrics'): mk([3])
    with pytest.raises(TypeError, match='a list of metrics or a'): mk('accuracy')
    # Mean: a per-sample function's mean, in float64, as torchmetrics computes it
    abs_err = lambda p, y: (p[:, 0] - y.float()).abs()
    t2 = mk({'mae': Mean(abs_err)})
    p, y = t2.predict(dl)
    assert t2.evaluate(dl)['mae'] == pytest.approx(abs_err(p, y).double().mean().item(), rel=1e-12, abs=0)
    class Broken(MulticlassAccuracy):
        def update(self, p, y): raise RuntimeError("bad update")
    with pytest.raises(RuntimeError, match='bad update') as e: mk({'broken': Broken(4)}).evaluate(dl)
    assert "streaming metric 'broken'" in '\n'.join(e.value.__notes__)


def test_non_scalar_results_are_recorded_logged_and_checkpointed(tmp_path):
    "A confusion matrix and a collection through a fit with the default hooks, a MetricsLog and a Checkpoint."
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix
    from trainer_nb.checkpoint import Checkpoint
    from trainer_nb.monitor import MetricsLog, read_metrics
    from trainer_nb.core import Trainer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    ds = TensorDataset(x, torch.randint(0, 3, (96,), generator=g))
    torch.manual_seed(0)
    metrics = {'cm': MulticlassConfusionMatrix(3), 'set': MetricCollection([MulticlassAccuracy(3)])}
    t = Trainer(torch.nn.Linear(8, 3), DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=32), cpu=True,
                loss_func=F.cross_entropy, metrics=metrics, hooks=[MetricsLog(tmp_path), Checkpoint(tmp_path / 'ck')])
    t.fit(2)
    h = t.history
    assert list(h.columns[:4]) == ['train_loss', 'valid_loss', 'cm', 'set_MulticlassAccuracy']
    assert torch.tensor(h['cm'].iloc[-1]).sum() == 96 and isinstance(h['set_MulticlassAccuracy'].iloc[-1], float)
    logged = read_metrics(tmp_path)
    cms = logged[logged['kind'] == 'epoch']['cm'].tolist()
    assert len(cms) == 2 and cms[-1] == h['cm'].iloc[-1] and isinstance(cms[-1], list)
    t2 = Trainer(torch.nn.Linear(8, 3), DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=32), cpu=True,
                 loss_func=F.cross_entropy, metrics=metrics, hooks=[Checkpoint(tmp_path / 'ck')])
    t2.fit(2, resume='last')   # the checkpoint loads: the fit was complete, nothing left to train
    assert t2.history['cm'].iloc[-1] == h['cm'].iloc[-1]


def test_two_processes_equal_the_plain_metrics_and_one_process(evaluated):
    ranks, (single,) = evaluated['dist', 2], evaluated['dist', 1]
    for r in ranks:
        res = r['result']
        assert r['samples'] == 101
        assert res['streaming_accuracy'] == res['accuracy'] == single['result']['accuracy']
        assert res['streaming_mae'] == pytest.approx(res['mae'], rel=1e-12, abs=0)
        assert res['streaming_mae'] == pytest.approx(single['result']['streaming_mae'], rel=1e-12, abs=0)


def test_torchmetrics_exact_against_scikit_learn_on_one_and_two_processes(evaluated):
    "203 samples in batches of 4 a process: on 2 processes, process 1 has no real sample in the last batch."
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score
    ranks, (single,) = evaluated['cls', 2], evaluated['cls', 1]
    for r in (single, *ranks):
        y, p = r['targets'], r['preds']
        res = r['result']
        assert r['samples'] == len(y) == len(p) == 203
        assert res['count'] == 203 and res['target_sum'] == sum(y)   # each sample counted once
        assert res['cm'] == confusion_matrix(y, p).tolist()
        assert res['acc'] == res['set_acc'] == pytest.approx(accuracy_score(y, p), rel=1e-6, abs=0)
        assert res['plain_acc'] == pytest.approx(accuracy_score(y, p), rel=1e-6, abs=0)
        assert res['f1'] == pytest.approx(f1_score(y, p, average='macro'), rel=1e-6, abs=0)
        assert res['set_prec'] == pytest.approx(precision_score(y, p, average='macro'), rel=1e-6, abs=0)
        assert r['again'] == res   # reset per evaluation
        assert res == single['result'] and p == single['preds']
