"PlateauLR: torch's ReduceLROnPlateau driven once an epoch by a monitored metric; saved, resumed, seen by the Recorder."
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import regression_ds, small_model
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.core import Hook, Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.workflow import PlateauLR

pytestmark = [pytest.mark.usefixtures('fresh_accelerate'),
              pytest.mark.filterwarnings('ignore:Resuming with a changed config')]
SCORES = [1., .5, .6, .7, .8, .9, .4, .45]   # plateau from epoch 2, a new best at epoch 6


def make(hooks=(), **kw):
    torch.manual_seed(0)
    box = {}
    def score(preds, targets): return SCORES[box['t'].state.epoch]
    t = Trainer(small_model(), DataLoader(regression_ds(48), batch_size=8, shuffle=True),
                DataLoader(regression_ds(16, seed=1), batch_size=8), loss_func=F.mse_loss, lr=1e-2, metrics=[score],
                hooks=[Recorder(), *hooks], default_hooks=False, **kw)
    box['t'] = t
    return t


def epoch_lrs(t): return t.get_hook(Recorder).steps.lr.to_numpy().reshape(-1, 6)   # 6 steps an epoch


def test_lr_drops_after_patience_epochs_without_improvement():
    t = make([PlateauLR('score', patience=1, factor=0.5)])
    t.fit(8)
    lrs = epoch_lrs(t)
    assert (lrs == lrs[:, :1]).all()   # it changes only between epochs
    # epochs 2, 3 bad -> x0.5 from epoch 4; 4, 5 bad -> x0.5 from epoch 6; 6 is a new best; 7 bad (1 <= patience)
    assert np.allclose(lrs[:, 0], [1e-2] * 4 + [5e-3] * 2 + [2.5e-3] * 2)
    assert [g['lr'] for g in t.opt.param_groups] == pytest.approx([2.5e-3] * len(t.opt.param_groups))   # (no-decay twin too)


def test_every_group_drops_keeping_its_ratio():
    t = make([PlateauLR('score', patience=1)])
    t.split('0', '2')
    t.fit(5, lr=[1e-3, 1e-2])
    s = t.get_hook(Recorder).steps
    assert np.allclose(s.lr_1 / s.lr, 10) and np.isclose(s.lr.iloc[-1], 1e-4)


class Crash(Hook):
    def after_batch(self):
        s = self.trainer.state
        if s.epoch == 5 and s.batch == 3: raise RuntimeError("crash")


def test_saved_and_resumed(tmp_path):
    ref = make([PlateauLR('score', patience=1, factor=0.5)])
    ref.fit(8)
    t = make([PlateauLR('score', patience=1, factor=0.5), Checkpoint(tmp_path, every_steps=2), Crash()])
    with pytest.raises(RuntimeError, match='crash'): t.fit(8)
    t2 = make([PlateauLR('score', patience=1, factor=0.5), Checkpoint(tmp_path, every_steps=2)])
    t2.fit(8, resume='last')
    assert t2.get_hook(Recorder).steps.lr.tolist() == ref.get_hook(Recorder).steps.lr.tolist()
    assert t2.get_hook(PlateauLR).state_dict() == ref.get_hook(PlateauLR).state_dict()
    assert all(torch.equal(a, b) for a, b in zip(t2.model.parameters(), ref.model.parameters()))


def test_refusals():
    with pytest.raises(ValueError, match='Factor should be < 1.0'): PlateauLR(factor=2.)
    t = make([PlateauLR('score')])
    with pytest.raises(ValueError, match='PlateauLR sets the LRs itself'): t.fit_one_cycle(1)
    t = make([PlateauLR('acc')])
    with pytest.raises(KeyError, match="PlateauLR monitors 'acc'"): t.fit(1)
