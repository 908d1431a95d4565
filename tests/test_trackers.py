"""Trackers in one argument: `Trainer(log_with=..., project_dir=...)`. The data is read back with each tracker's own
reader: TensorBoard's event files with its `EventAccumulator`, MLflow's runs with `MlflowClient` from its SQLite store."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import regression_ds, small_model
from trainer_nb.monitor import MetricsLog, read_metrics
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.trackers import Trackers

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def mae(preds, targets): return (preds - targets).abs().mean()

def make(tmp_path, log_with, hooks=(), **kw):
    torch.manual_seed(0)
    t = Trainer(small_model(), DataLoader(regression_ds(64), batch_size=8),
                DataLoader(regression_ds(24, seed=1), batch_size=8), loss_func=F.mse_loss, metrics=[mae], cpu=True, default_hooks=False, hooks=[Recorder(), *hooks],
                log_with=log_with, project_dir=tmp_path, **kw)
    t.split('0', '2')   # two parameter groups, at a tenth of each other
    return t

def scalars(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(path), size_guidance={'scalars': 0})
    ea.Reload()
    return {k: [(e.step, e.value) for e in ea.Scalars(k)] for k in ea.Tags()['scalars']}


def test_tensorboard_from_one_argument(tmp_path):
    pytest.importorskip('tensorboard')
    t = make(tmp_path, 'tensorboard', [Trackers(log_every=4, run_name='tb'),
                                       MetricsLog(tmp_path / 'log', every_steps=4)])
    assert sum(isinstance(h, Trackers) for h in t.hooks) == 1   # the one given; none added
    t.fit_one_cycle(2, lr_max=slice(1e-2))
    got = scalars(tmp_path / 'tb')
    assert sorted(got) == ['epoch/mae', 'epoch/train_loss', 'epoch/valid_loss', 'train/loss', 'train/lr', 'train/lr_1']
    for k in ('train/loss', 'train/lr', 'train/lr_1'): assert [s for s, _ in got[k]] == [4, 8, 12, 16]   # once each:
    for k in ('epoch/mae', 'epoch/valid_loss'): assert [s for s, _ in got[k]] == [8, 16]               # MetricsLog sent none
    steps = t.get_hook(Recorder).steps   # the LR each logged step used, every group's
    for k, col in (('train/lr', 'lr'), ('train/lr_1', 'lr_1')):
        assert [v for _, v in got[k]] == pytest.approx(steps[col].iloc[[3, 7, 11, 15]].tolist(), rel=1e-6)
    assert [v for _, v in got['epoch/valid_loss']] == pytest.approx(t.history.valid_loss.tolist(), rel=1e-6)
    jl = read_metrics(tmp_path / 'log')
    assert [v for _, v in got['train/loss']] == pytest.approx(jl[jl.kind == 'train'].loss.tolist(), rel=1e-6)
    assert not t.accelerator.trackers   # ended after the fit
    hp = (tmp_path / 'tb').rglob('hparams.yml')   # the hyperparameters, once (Accelerate writes them beside)
    import yaml
    hp = yaml.safe_load(next(hp).read_text())
    assert hp['lr'] == pytest.approx(1e-2) and hp['lrs'] == str(t.lrs) and hp['scheduler'] == 'OneCycleLR'
    assert hp['model'] == 'Sequential' and hp['epochs'] == 2 and hp['batch_size'] == 8


def test_log_with_alone_adds_the_hook_and_a_second_fit_continues_the_run(tmp_path):
    pytest.importorskip('tensorboard')
    t = make(tmp_path, 'tensorboard')
    hook = t.get_hook(Trackers)
    assert hook.log_every == 50
    t.fit(1)
    t.fit(1, eval_every=3)
    name = hook.run_name
    assert name.startswith('run-')
    got = scalars(tmp_path / name)
    assert [s for s, _ in got['epoch/valid_loss']] == [8, 16] and [s for s, _ in got['valid/valid_loss']] == [9, 12, 15]
    assert 'train/loss' not in got   # (50 steps between records)


def test_mlflow_in_project_dir(tmp_path):
    mlflow = pytest.importorskip('mlflow')
    from mlflow.tracking import MlflowClient
    uri = mlflow.get_tracking_uri()
    t = make(tmp_path, 'mlflow', [Trackers(log_every=4, run_name='ml')])
    t.fit(1)
    assert mlflow.get_tracking_uri() == uri   # the store was this fit's only
    t.fit_cosine(1)                           # the same run, continued
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name('ml')
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == 'ml' and run.info.status == 'FINISHED'
    hist = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
            for k in ('train/loss', 'train/lr', 'train/lr_1', 'epoch/valid_loss', 'epoch/mae')}
    assert [s for s, _ in hist['train/lr_1']] == [4, 8, 12, 16] and [s for s, _ in hist['epoch/mae']] == [8, 16]
    assert [v for _, v in hist['epoch/valid_loss']] == pytest.approx(t.history.valid_loss.tolist())
    lrs = t.get_hook(Recorder).steps
    assert [v for _, v in hist['train/lr_1']] == pytest.approx(lrs.lr_1.iloc[[3, 7, 11, 15]].tolist())
    p = run.data.params
    assert p['model'] == 'Sequential' and float(p['lr']) == pytest.approx(t.lr) and p['epochs'] == '1'


def test_both_in_a_list(tmp_path):
    pytest.importorskip('mlflow')
    pytest.importorskip('tensorboard')
    from mlflow.tracking import MlflowClient
    t = make(tmp_path, ['tensorboard', 'mlflow'], [Trackers(log_every=8, run_name='both')])
    t.fit(2)
    assert [s for s, _ in scalars(tmp_path / 'both')['train/loss']] == [8, 16]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name('both').experiment_id])[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, 'train/loss')] == [8, 16]
