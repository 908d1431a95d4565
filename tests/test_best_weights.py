"""Best weights: EarlyStopping(restore_best=True) and Checkpoint(load_best_at_end=True) end the fit with the weights of
the best monitored epoch, bitwise those of that epoch's checkpoint, also when the fit was resumed after a crash."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from conftest import regression_ds, small_model
from trainer_nb.checkpoint import Checkpoint, list_checkpoints
from trainer_nb.monitor import EarlyStopping
from trainer_nb.base import Hook
from trainer_nb.core import Trainer

pytestmark = [pytest.mark.usefixtures('fresh_accelerate'),
              pytest.mark.filterwarnings('ignore:Resuming with a changed config')]   # (the Crash hook is gone)
SCORES = [5., 2., 3., 1., 4., 6., 7., 8.]   # by epoch: the best is epoch 3 (mode='min')
PER_EPOCH = 6                               # 48 samples, batches of 8


def make(hooks):
    torch.manual_seed(0)
    box = {}
    def score(preds, targets): return SCORES[box['t'].state.epoch]
    t = Trainer(small_model(), DataLoader(regression_ds(48), batch_size=8, shuffle=True),
                DataLoader(regression_ds(16, seed=1), batch_size=8), loss_func=F.mse_loss, lr=1e-2, metrics=[score],
                hooks=list(hooks), default_hooks=False)
    box['t'] = t
    return t


class Crash(Hook):
    "A crash (an error) in the middle of epoch `epoch`."
    def __init__(self, epoch): self.epoch = epoch
    def after_batch(self):
        s = self.trainer.state
        if s.epoch == self.epoch and s.batch == 2: raise RuntimeError("crash")


def weights_of(path): return load_file(str(path / 'model.safetensors'))


def assert_weights(model, saved):
    sd = model.state_dict()
    assert sd.keys() == saved.keys()
    for k in sd: assert torch.equal(sd[k], saved[k]), k


def epoch_checkpoint(run, epoch): return run / f'step-{(epoch + 1) * PER_EPOCH:08d}'


@pytest.mark.usefixtures('on_the_cpu')
def test_early_stopping_restores_the_best_epoch(tmp_path):
    t = make([EarlyStopping('score', patience=2, restore_best=True), Checkpoint(tmp_path, keep_last=None, monitor=None)])
    t.fit(8)
    assert t.state.epoch == 5 and t.get_hook(EarlyStopping).best_epoch == 3   # stopped after epochs 4 and 5
    assert_weights(t.model, weights_of(epoch_checkpoint(tmp_path, 3)))
    assert not torch.equal(weights_of(epoch_checkpoint(tmp_path, 3))['0.weight'],
                           weights_of(epoch_checkpoint(tmp_path, 5))['0.weight'])


@pytest.mark.usefixtures('on_the_cpu')
def test_early_stopping_without_restore_keeps_the_last(tmp_path):
    t = make([EarlyStopping('score', patience=2), Checkpoint(tmp_path, keep_last=None, monitor=None)])
    t.fit(8)
    assert_weights(t.model, weights_of(epoch_checkpoint(tmp_path, 5)))


@pytest.mark.usefixtures('on_the_cpu')
def test_restore_best_at_the_end_of_a_fit_that_was_not_stopped(tmp_path):
    t = make([EarlyStopping('score', patience=10, restore_best=True), Checkpoint(tmp_path, keep_last=None)])
    t.fit(5)
    assert_weights(t.model, weights_of(epoch_checkpoint(tmp_path, 3)))


def test_an_error_keeps_the_last_weights(tmp_path):
    t = make([EarlyStopping('score', patience=10, restore_best=True), Crash(4)])
    with pytest.raises(RuntimeError, match='crash'): t.fit(6)
    last = {k: v.clone() for k, v in t.model.state_dict().items()}
    assert t.state.epoch == 4   # nothing restored: the weights are those of the batch that crashed
    assert_weights(t.model, last)


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('crash_at', [4, 5])
def test_restore_best_after_a_resume(tmp_path, crash_at):
    "The best epoch (3) came before the crash: after the resume the weights come from its checkpoint."
    run = tmp_path / 'run'
    t = make([EarlyStopping('score', patience=3, restore_best=True),
              Checkpoint(run, keep_last=1, monitor='score'), Crash(crash_at)])
    with pytest.raises(RuntimeError, match='crash'): t.fit(8)
    t2 = make([EarlyStopping('score', patience=3, restore_best=True), Checkpoint(run, keep_last=1, monitor='score')])
    t2.fit(8, resume='last')
    assert t2.state.epoch == 6 and t2.get_hook(EarlyStopping).best_epoch == 3
    best = t2.get_hook(Checkpoint).best
    assert best == epoch_checkpoint(run, 3) and best in list_checkpoints(run)   # kept out of the rotation
    assert_weights(t2.model, weights_of(best))


@pytest.mark.usefixtures('on_the_cpu')
def test_restore_best_after_a_resume_without_the_checkpoint_warns(tmp_path):
    run = tmp_path / 'run'
    hooks = lambda: [EarlyStopping('score', patience=3, restore_best=True), Checkpoint(run, keep_last=1, monitor=None)]
    t = make([*hooks(), Crash(5)])
    with pytest.raises(RuntimeError): t.fit(8)
    t2 = make(hooks())
    with pytest.warns(UserWarning, match=r'best epoch \(4\) are neither in memory'): t2.fit(8, resume='last')
    assert_weights(t2.model, weights_of(epoch_checkpoint(run, 6)))   # its last weights


@pytest.mark.usefixtures('on_the_cpu')
def test_checkpoint_load_best_at_end_after_a_resume(tmp_path):
    t = make([Checkpoint(tmp_path, keep_last=1, monitor='score', load_best_at_end=True), Crash(5)])
    with pytest.raises(RuntimeError): t.fit(6)
    t2 = make([Checkpoint(tmp_path, keep_last=1, monitor='score', load_best_at_end=True)])
    t2.fit(6, resume='last')
    assert t2.state.epoch == 6 and t2.get_hook(Checkpoint).best == epoch_checkpoint(tmp_path, 3)
    assert_weights(t2.model, weights_of(epoch_checkpoint(tmp_path, 3)))
