"Quick checks: fit(limit_batches=), fit(overfit_batches=), fit(fast_dev_run=True) and what describe_hooks then shows."
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from conftest import regression_ds, small_model
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.monitor import MetricsLog
from trainer_nb.core import EVENTS, Hook, Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.schedule import one_cycle

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Batches(Hook):
    "Notes the first input row of every training batch, by epoch."
    def before_fit(self): self.seen = []
    def before_epoch(self): self.seen.append([])
    def before_batch(self): self.seen[-1].append(self.trainer.batch[0][0].clone())


def make(hooks=(), shuffle=True, **kw):
    torch.manual_seed(0)
    return Trainer(small_model(), DataLoader(regression_ds(64), batch_size=8, shuffle=shuffle),
                   DataLoader(regression_ds(40, seed=1), batch_size=8), loss_func=F.mse_loss, lr=1e-2,
                   hooks=[Recorder(), *hooks], default_hooks=False, **kw)


def test_limit_batches_keeps_the_order_and_the_schedule_counts_them():
    b = Batches()
    t = make([b], scheduler=one_cycle())
    dl = t.train_dl
    t.fit(2, limit_batches=3)
    assert t.state.step == 6 and t.state.n_batches == 3 and t.eval_samples == 24
    assert [len(e) for e in b.seen] == [3, 3]
    assert not all(torch.equal(x, y) for x, y in zip(*b.seen))   # shuffled anew each epoch
    lrs = t.get_hook(Recorder).steps.lr
    assert lrs.iloc[-1] == pytest.approx(1e-2 / 1e5, rel=1e-6)   # the one cycle ended within the 6 steps
    assert t.train_dl is dl and t.valid_dl is not None and len(t.valid_dl) == 5   # put back
    t.fit(1)
    assert t.state.step == 14   # a plain fit has every batch again


@pytest.mark.usefixtures('on_the_cpu')
def test_overfit_batches_the_same_batches_in_order_validated_on():
    b = Batches()
    t = make([b])
    t.fit(3, overfit_batches=2)
    first = torch.stack([regression_ds(64)[i][0] for i in (0, 8)])   # the dataset's first two batches, unshuffled
    for epoch in b.seen: assert torch.equal(torch.stack(epoch), first)
    assert t.eval_samples == 16
    losses = t.history.valid_loss
    assert losses.iloc[-1] < losses.iloc[0]


def test_fast_dev_run_runs_every_hook_once_and_puts_everything_back(tmp_path):
    calls = []
    class Every(Hook):
        pass
    for e in EVENTS:
        setattr(Every, e, lambda self, e=e: calls.append(e))
    ck, ml = Checkpoint(tmp_path / 'run'), MetricsLog(tmp_path / 'logs', every_steps=1)
    t = make([Every(), ck, ml])
    t.fit(1)
    calls.clear()
    before = [p.detach().clone() for p in t.model.parameters()]
    opt = copy.deepcopy(t.opt.state_dict())
    state, n_losses, rng = t.state.state_dict(), len(t.losses), torch.get_rng_state()
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob('*'))
    metrics = (tmp_path / 'logs' / 'metrics.jsonl').read_text()
    table = t.fit(5, fast_dev_run=True)
    assert [e for e in calls if e in ('before_batch', 'after_batch')] == ['before_batch', 'after_batch']   # one batch
    assert set(calls) == set(EVENTS) - {'after_cancel', 'after_change', 'after_pause'}   # (nothing was asked)
    col = table['ran in fast_dev_run']
    assert col['after_cancel'] == '-' and col['before_valid'] == 'Every'
    assert col['after_epoch'] == 'Every, Recorder'   # in their order; Checkpoint and MetricsLog sit a dev run out
    assert t.describe_hooks()['ran in fast_dev_run'].equals(col)
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
    assert t.opt.state_dict()['state'][0]['step'] == opt['state'][0]['step']
    assert t.state.state_dict() == state and len(t.losses) == n_losses and torch.equal(torch.get_rng_state(), rng)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob('*')) == files   # nothing written
    assert (tmp_path / 'logs' / 'metrics.jsonl').read_text() == metrics
    assert not t.dev_run


def test_bad_arguments():
    t = make()
    with pytest.raises(ValueError, match='limit_batches must be an int >= 1'): t.fit(1, limit_batches=0)
    with pytest.raises(ValueError, match='Pass one of limit_batches, fast_dev_run'):
        t.fit(1, limit_batches=2, fast_dev_run=True)
    with pytest.raises(ValueError, match="can't be combined with resume="): t.fit(1, overfit_batches=1, resume='last')
    t.train_dl = [b for b in DataLoader(regression_ds(16), batch_size=4)]   # batches, but no DataLoader
    with pytest.raises(TypeError, match='limit_batches needs a torch DataLoader, got list'):
        t.fit(1, limit_batches=2)


def test_a_stream_of_no_length_takes_every_quick_check():
    "An IterableDataset: its first N batches' samples each epoch; with a length then, schedules count them."
    class Stream(IterableDataset):
        def __iter__(self): return iter(regression_ds(64))
    t = make(scheduler=one_cycle())
    t.train_dl = DataLoader(Stream(), batch_size=8)
    t.fit(2, limit_batches=3)
    assert t.state.step == 6 and t.state.n_batches == 3
    t.fit(2, overfit_batches=2)
    assert t.state.step == 10 and t.eval_samples == 16
    t.fit(1, fast_dev_run=True)
    assert t.state.step == 10
