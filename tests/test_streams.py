"""Streams and long epochs: `max_steps` (fits that end at a step, schedules over a loader with no length), `eval_every`
(validation and the best checkpoint inside an epoch), `set_epoch` (one order per epoch, prepared by Accelerate or
not), an exact mid-stream resume, and the quick checks over a stream. The stream is a `datasets` one, shuffled."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import flat, regression_ds, small_model
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.core import CancelFit, Hook, Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.schedule import constant, cosine, one_cycle

datasets = pytest.importorskip('datasets')
pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def stream(n=48, seed=0):
    "`regression_ds(n)` as a `datasets` stream, shuffled with a buffer as large as the data (an order per epoch)."
    x, y = regression_ds(n, seed=seed).tensors
    ds = datasets.Dataset.from_dict({'x': x.tolist(), 'y': y.tolist()}).to_iterable_dataset()
    return ds.shuffle(seed=0, buffer_size=n).with_format('torch')

def collate(rows): return torch.stack([r['x'] for r in rows]), torch.stack([r['y'] for r in rows])

def loader(n=48, bs=8, seed=0): return DataLoader(stream(n, seed), batch_size=bs, collate_fn=collate)

def order(ds, epoch, bs=8):
    "The first input of each sample, by batch, as `ds` gives them in `epoch`."
    ds.set_epoch(epoch)
    xs = [r['x'][0] for r in ds]
    return [torch.stack(xs[i:i + bs]) for i in range(0, len(xs), bs)]

class Seen(Hook):
    "The first input of each sample of every training batch, by epoch; each validation's (step, phase, results)."
    def before_fit(self): self.batches, self.valid = {}, []
    def before_batch(self):
        self.batches.setdefault(self.trainer.state.epoch, []).append(self.trainer.batch[0][:, 0].clone())
    def after_valid(self):
        t = self.trainer
        self.valid.append((t.state.step, t.phase, dict(t.valid_results)))

def make(dl=None, hooks=(), **kw):
    torch.manual_seed(0)
    return Trainer(small_model(), dl if dl is not None else loader(), loss_func=F.mse_loss, lr=1e-2, cpu=True,
                   default_hooks=False, hooks=[Recorder(), *hooks], **kw)

def expected_lrs(factory, total, lr=1e-2):
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)
    sched, lrs = factory(opt, total), []
    for _ in range(total):
        lrs.append(opt.param_groups[0]['lr'])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize('grad_accum', [1, 2])
def test_set_epoch_one_order_per_epoch_with_or_without_accelerate(grad_accum):
    "grad_accum=2 has Accelerate prepare the loader: the order of each epoch is the same as without."
    seen = Seen()
    make(hooks=[seen], grad_accum=grad_accum).fit(3)
    ds = stream()
    for e in range(3):
        assert all(torch.equal(a, b) for a, b in zip(seen.batches[e], order(ds, e))), e
        assert len(seen.batches[e]) == 6
    assert not torch.equal(torch.cat(seen.batches[0]), torch.cat(seen.batches[1]))   # a new order each epoch


@pytest.mark.parametrize('method,factory', [('fit_one_cycle', one_cycle()), ('fit_cosine', cosine()),
                                            ('fit_constant', constant(warmup_steps=3)), ('fit', cosine(lr_min=1e-4))])
@pytest.mark.parametrize('grad_accum', [1, 2])
def test_max_steps_on_a_stream_with_every_schedule(method, factory, grad_accum):
    "A loader with no length: the schedule spans max_steps, the fit ends there, inside an epoch (6 / grad_accum steps)."
    t = make(grad_accum=grad_accum, scheduler=factory if method == 'fit' else None)
    kw = {'warmup_steps': 3} if method == 'fit_constant' else {}
    getattr(t, method)(max_steps=10, **kw)
    per_epoch = 6 // grad_accum
    assert t.state.step == 10 and t.state.epoch == -(-10 // per_epoch) and t.state.iteration == 10 * grad_accum
    assert t.get_hook(Recorder).steps.lr.tolist() == pytest.approx(expected_lrs(factory, 10), rel=1e-12)
    assert len(t.history) == t.state.epoch   # the last, shorter epoch ended like any other


def test_a_schedule_over_a_stream_without_max_steps_says_what_to_pass():
    with pytest.raises(ValueError, match=r'no length \(a stream\), so pass max_steps='): make().fit_one_cycle(2)


def test_max_steps_on_a_sized_loader_and_with_epochs():
    t = make(DataLoader(regression_ds(48), batch_size=8))
    t.fit(max_steps=4)                  # inside the first epoch
    assert (t.state.step, t.state.epoch, t.state.iteration, len(t.history)) == (4, 1, 4, 1)
    t.fit(3, max_steps=100)             # epochs end first
    assert t.state.step == 4 + 18
    t.fit_one_cycle(max_steps=8)        # 1 epoch and 2 batches of the next; the cycle over the 8 steps
    lrs = t.get_hook(Recorder).steps.lr.tolist()[-8:]
    assert t.state.step == 30 and lrs == pytest.approx(expected_lrs(one_cycle(), 8), rel=1e-12)
    with pytest.raises(ValueError, match='fit needs epochs, max_steps or both'): t.fit()
    with pytest.raises(ValueError, match='max_steps must be an int >= 1'): t.fit(max_steps=0)


def test_eval_every_validates_inside_epochs_and_checkpoint_keeps_the_best(tmp_path):
    seen = Seen()
    ck = Checkpoint(tmp_path / 'run', at_epoch_end=False, monitor='valid_loss')
    t = make(hooks=[seen, ck], valid_dl=DataLoader(regression_ds(24, seed=1), batch_size=8))
    t.fit_one_cycle(max_steps=12, eval_every=4)
    # 6 steps an epoch: inside epoch 0 at 4, its end at 6; inside epoch 1 at 8; at 12 the fit's end (once)
    assert [(s, p) for s, p, _ in seen.valid] == [(4, 'valid_step'), (6, 'valid'), (8, 'valid_step'), (12, 'valid')]
    best_step = min(seen.valid, key=lambda v: v[2]['valid_loss'])[0]
    best = json.loads((tmp_path / 'run' / 'best.json').read_text())
    assert best['name'] == f'step-{best_step:08d}' and (tmp_path / 'run' / best['name']).is_dir()
    assert best['value'] == pytest.approx(min(v[2]['valid_loss'] for v in seen.valid))
    assert t.state.step == 12 and t.phase is None
    with pytest.raises(ValueError, match='eval_every= validates on valid_dl'): make().fit(1, eval_every=2)


class Crash(Hook):
    "An error at the `at`th optimizer step (a killed run)."
    def __init__(self, at): self.at = at
    def after_step(self):
        if self.trainer.state.step == self.at: raise RuntimeError('killed')


@pytest.mark.parametrize('grad_accum', [1, 2])
def test_resume_mid_stream_is_exact(tmp_path, grad_accum):
    "Killed at step 7 of 10 (checkpoint at 5, inside epoch 0 or 1): the resumed fit ends as the uninterrupted one."
    ref_seen = Seen()
    ref = make(hooks=[ref_seen], grad_accum=grad_accum)
    ref.fit_one_cycle(max_steps=10)
    run = tmp_path / 'run'
    killed = make(hooks=[Checkpoint(run, every_steps=5, at_epoch_end=False, monitor=None), Crash(7)],
                  grad_accum=grad_accum)
    with pytest.raises(RuntimeError, match='killed'): killed.fit_one_cycle(max_steps=10)
    assert [p.name for p in sorted(run.glob('step-*'))] == ['step-00000005']   # inside an epoch (of 6 or 3 steps)
    seen = Seen()
    again = make(hooks=[Checkpoint(run, every_steps=5, at_epoch_end=False, monitor=None), seen], grad_accum=grad_accum)
    again.fit_one_cycle(max_steps=10, resume='last')
    assert again.state.step == 10 and again.state.max_step == 10
    assert torch.equal(flat(again.model), flat(ref.model))
    assert torch.equal(again.losses.values, ref.losses.values)
    assert again.get_hook(Recorder).steps.lr.tolist() == ref.get_hook(Recorder).steps.lr.tolist()
    e = max(seen.batches)   # the resumed epoch's batches after the checkpoint are the reference's
    assert all(torch.equal(a, b) for a, b in zip(seen.batches[e], ref_seen.batches[e][-len(seen.batches[e]):]))


def test_quick_checks_over_a_stream():
    seen = Seen()
    t = make(hooks=[seen], scheduler=one_cycle(), valid_dl=loader(24, seed=1))
    t.fit(2, limit_batches=3)           # the first 3 batches of each epoch's order; the schedule counts them
    ds = stream()
    assert t.state.step == 6 and t.eval_samples == 24
    for e in (0, 1): assert all(torch.equal(a, b) for a, b in zip(seen.batches[e], order(ds, e)[:3]))
    assert t.get_hook(Recorder).steps.lr.tolist() == pytest.approx(expected_lrs(one_cycle(), 6), rel=1e-12)
    t.fit(2, overfit_batches=2)         # the same 2 batches every epoch, validated on
    assert all(torch.equal(a, b) for a, b in zip(seen.batches[t.state.epoch - 1], seen.batches[t.state.epoch - 2]))
    assert t.eval_samples == 16
    table = t.fit(1, fast_dev_run=True)
    assert table.loc['before_batch', 'ran in fast_dev_run'] == 'Seen' and t.state.step == 10
    t.fit(max_steps=3, limit_batches=2)  # fit's other arguments go with a quick check
    assert t.state.step == 13
