"""A hook that monitors one of an epoch's results (EarlyStopping, Checkpoint, PlateauLR) and names one that no epoch
will report is refused before the fit trains a batch, with the names there will be; names reported only once training
runs (`trainer.log`, a model's `log_scalar`) still work."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import LoggingModel, regression_ds

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def mae(preds, targets): return (preds - targets).abs().mean()


def make(hooks, valid=True, model=None):
    from trainer_nb.core import Trainer
    return Trainer(model or torch.nn.Linear(5, 1), DataLoader(regression_ds(32), batch_size=8),
                   DataLoader(regression_ds(16, seed=1), batch_size=8) if valid else None, loss_func=F.mse_loss,
                   metrics=[mae], cpu=True, default_hooks=False, hooks=hooks)


def test_result_names():
    assert make([]).result_names() == ['epoch', 'train_loss', 'valid_loss', 'mae', 'time']
    t = make([], valid=False)
    assert t.result_names() == ['epoch', 'train_loss', 'time']
    assert t.result_names(valid=True) == ['epoch', 'train_loss', 'valid_loss', 'mae', 'time']


@pytest.mark.parametrize('monitor, valid, match', [
    ('valid_loss', False, r"EarlyStopping monitors 'valid_loss', which only validation reports, and the trainer has "
                          r"no valid_dl: give it one, or monitor one of the results it will have \(epoch, train_loss, "
                          r"time\)"),
    ('mae', False, "only validation reports"),
    ('valid_los', True, r"did you mean 'valid_loss'\? The results: epoch, train_loss, valid_loss, mae, time"),
    ('mea', True, "did you mean 'mae'"),
    ('val_loss', False, "did you mean 'valid_loss', which only validation reports"),
])
def test_early_stopping_on_a_name_no_epoch_reports_is_refused_before_training(monitor, valid, match):
    from trainer_nb.monitor import EarlyStopping
    t = make([EarlyStopping(monitor)], valid)
    with pytest.raises(ValueError, match=match): t.fit(2)
    assert t.state.iteration == 0


def test_checkpoint_refuses_a_name_no_epoch_reports_and_warns_for_its_default(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    t = make([Checkpoint(tmp_path / 'a', monitor='mae', mode='min')], valid=False)
    with pytest.raises(ValueError, match="Checkpoint monitors 'mae', which only validation reports"): t.fit(1)
    assert t.state.iteration == 0 and not (tmp_path / 'a').exists()
    t = make([Checkpoint(tmp_path / 'b')], valid=False)   # the default monitor: saves, and says nothing is marked best
    with pytest.warns(UserWarning, match="Checkpoint monitors 'valid_loss', which only validation reports"): t.fit(1)
    assert len(list_checkpoints(tmp_path / 'b')) == 1


def test_names_known_only_once_reported_still_work():
    "A value the model logs (`log_scalar` in its forward) is known only once it is logged: monitoring it works."
    from trainer_nb.monitor import EarlyStopping
    from trainer_nb.workflow import PlateauLR
    es = EarlyStopping('out_mean', patience=10)
    t = make([es, PlateauLR('train_loss')], valid=False, model=LoggingModel())
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        t.fit(2)
    assert es.best is not None and t.state.epoch == 2
    with pytest.raises(ValueError, match="PlateauLR monitors 'train_los'.*did you mean 'train_loss'"):
        make([PlateauLR('train_los')]).fit(1)
