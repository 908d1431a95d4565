"Mixed precision: bf16 and fp16 on CUDA (skipped without a GPU), and bf16 on the CPU."
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Hook, Trainer

pytestmark = pytest.mark.usefixtures('fresh_accelerate')

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU (torch.cuda.is_available() is False)')


class Watch(Hook):
    "Per batch: did the optimizer step, did the scaler skip it; per epoch: the training loss."
    def __init__(self): self.stepped, self.skipped, self.epoch_losses = [], [], []
    def after_batch(self):
        t = self.trainer
        self.stepped.append(t.state.opt_stepped)
        self.skipped.append(t.accelerator.sync_gradients and bool(getattr(t.opt, 'step_was_skipped', False)))
    def after_epoch(self): self.epoch_losses.append(self.trainer.epoch_results['train_loss'])


def _train(mixed_precision, cpu=False, grad_accum=1, max_grad_norm=None, epochs=4, setup=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    dtypes = set()
    model[0].register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    watch = Watch()
    t = Trainer(model, DataLoader(TensorDataset(x, y), batch_size=32), DataLoader(TensorDataset(x[:100], y[:100]), batch_size=32),
                loss_func=F.mse_loss, lr=3e-2, mixed_precision=mixed_precision, cpu=cpu, grad_accum=grad_accum,
                max_grad_norm=max_grad_norm, hooks=[watch], default_hooks=False)
    if setup is not None: setup(t)
    t.fit(epochs)
    return t, watch, dtypes


def _check(t, watch, dtypes, compute_dtype, device, grad_accum=1, epochs=4):
    assert t.device.type == device
    assert dtypes == {compute_dtype}                           # autocast was on in the forward pass
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in t.model.parameters())
    assert watch.epoch_losses[-1] < 0.5 * watch.epoch_losses[0], watch.epoch_losses
    assert all(math.isfinite(l) for l in watch.epoch_losses)
    assert t.state.iteration == 8 * epochs and t.state.samples == 256 * epochs
    assert sum(watch.stepped) == t.state.step == epochs * math.ceil(8 / grad_accum) - sum(watch.skipped)
    assert t.eval_samples == 100 and t.valid_results['valid_loss'] < watch.epoch_losses[0]
    preds, _ = t.predict(t.valid_dl)
    assert preds.shape == (100, 1) and preds.device.type == 'cpu' and torch.isfinite(preds).all()


def test_bf16_cpu():
    t, watch, dtypes = _train('bf16', cpu=True)
    assert t.accelerator.scaler is None
    _check(t, watch, dtypes, torch.bfloat16, 'cpu')
    assert not any(watch.skipped)


@needs_cuda
def test_bf16_cuda():
    if not torch.cuda.is_bf16_supported(): pytest.skip('this GPU has no bf16 support')
    t, watch, dtypes = _train('bf16')
    assert t.accelerator.scaler is None                        # bf16 needs no loss scaling
    _check(t, watch, dtypes, torch.bfloat16, 'cuda')
    assert not any(watch.skipped)


def _check_scaler(t, watch):
    scaler = t.accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    # the scaler was updated once per optimizer step: its growth tracker counts the steps since the last skip
    since_skip = 0
    for s, k in zip(watch.stepped, watch.skipped):
        if s: since_skip += 1
        elif k: since_skip = 0
    assert scaler.state_dict()['_growth_tracker'] == since_skip


@needs_cuda
def test_fp16_cuda():
    t, watch, dtypes = _train('fp16')
    _check(t, watch, dtypes, torch.float16, 'cuda')
    _check_scaler(t, watch)


@needs_cuda
def test_fp16_cuda_accumulation_and_clipping():
    "fp16 + grad_accum=3 (8 batches: groups of 3, 3, 2) + clipping, on unscaled gradients, once per step."
    norms = []
    def spy(t):
        def pre_step(opt, args, kwargs):
            norms.append(float(torch.cat([p.grad.float().flatten() for p in t.model.parameters()]).norm()))
        t.opt.optimizer.register_step_pre_hook(pre_step)
    t, watch, dtypes = _train('fp16', grad_accum=3, max_grad_norm=0.5, setup=spy)
    _check(t, watch, dtypes, torch.float16, 'cuda', grad_accum=3)
    _check_scaler(t, watch)
    assert [s or k for s, k in zip(watch.stepped, watch.skipped)] == [(i % 8) in (2, 5, 7) for i in range(32)]
    assert len(norms) == t.state.step                          # the torch optimizer ran only on real steps
    assert all(n <= 0.5 * (1 + 1e-3) for n in norms), norms    # clipped, in unscaled units


@needs_cuda
def test_timing_reads_cuda_events_without_a_sync_per_batch():
    """On a GPU, `Timing`'s step time is the device's, from a pair of CUDA events per batch read when the split is asked
    for: its per-batch work and the reads at the dashboard's pace make no host-device sync (CUDA's sync debug mode
    raises on one), and at the fit's end no event is left unread."""
    from trainer_nb.hooks import Timing

    class Strict(Timing):
        "Timing, with CUDA raising on any synchronizing call in its per-batch work and its reads."
        def _strict(self, f, *args):
            torch.cuda.set_sync_debug_mode('error')
            try: return f(*args)
            finally: torch.cuda.set_sync_debug_mode('default')
        def before_batch(self): self._strict(super().before_batch)
        def after_batch(self):
            self._strict(super().after_batch)
            self.reads.append(self._strict(self.report)['train_step'])   # as a display would, each batch
        def before_fit(self):
            super().before_fit()
            self.reads = []

    timing = Strict()
    t, watch, _ = _train('no', setup=lambda t: t.add_hooks(timing))
    r = t.timing
    assert timing._cuda and timing._events == [] and len(timing.reads) == 32
    assert r['train_step'] > 0 and r['train_step'] >= timing.reads[-1] and timing.reads == sorted(timing.reads)
    assert r['train_step'] <= r['wall'] and r['other'] >= 0


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=needs_cuda)])
def test_batches_from_a_list_and_logged_cpu_values(device):
    """Accelerate moves the batches of the `DataLoader`s it prepares; a list of CPU batches is moved by the trainer, for
    training, evaluation and prediction alike. Values logged as numbers, CPU tensors and tensors on the trainer's
    device in one epoch make one mean."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    class LogThree(Hook):
        def after_batch(self):
            t = self.trainer
            t.log('v', 1.0)
            t.log('v', torch.tensor(2.0))
            t.log('v', torch.tensor(3.0, device=t.device))

    t = Trainer(model, batches, batches, loss_func=F.mse_loss, lr=1e-2, hooks=[LogThree()], default_hooks=False,
                cpu=device == 'cpu')
    t.fit(3)
    assert t.device.type == device and t.state.iteration == 12
    assert t.epoch_results['v'] == 2.0 and math.isfinite(t.epoch_results['train_loss'])
    with torch.no_grad(): expected = t.model(x.to(device)).cpu()
    assert t.valid_results['valid_loss'] == pytest.approx(F.mse_loss(expected, y).item(), rel=1e-5)
    preds, targets = t.predict(batches)
    assert preds.device.type == 'cpu' and preds.shape == (64, 1) and torch.equal(targets, y)
    torch.testing.assert_close(preds, expected)
    # a list already on the device: its batches are taken as they are (the same objects: no work per batch)
    on_device = [tuple(v.to(device) for v in b) for b in batches]
    seen = []
    class Seen(Hook):
        def after_batch(self): seen.append(self.trainer.batch)
    t.train_dl = on_device
    t.add_hooks(Seen())
    t.fit(1)
    assert len(seen) == 4 and all(s is b for s, b in zip(seen, on_device))   # (a moved batch: a new tuple)


@needs_cuda
def test_a_cpu_trainer_beside_gpu_trainers_in_one_process():
    """Accelerate's device is process-wide: it refuses `cpu=True` once a GPU state exists ("restart your runtime"), and
    keeps the CPU for a trainer made after a `cpu=True` one. Each trainer here trains on its own device, in any order,
    the earlier ones again after the later were made."""
    a, wa, da = _train('no')
    b, wb, db = _train('no', cpu=True)           # the CPU after a GPU trainer
    c, wc, dc = _train('bf16')                   # the GPU after a CPU trainer
    _check(a, wa, da, torch.float32, 'cuda')
    _check(b, wb, db, torch.float32, 'cpu')
    _check(c, wc, dc, torch.bfloat16, 'cuda')
    for t, device, watch in ((a, 'cuda', wa), (b, 'cpu', wb), (c, 'cuda', wc), (b, 'cpu', wb)):
        assert t.device.type == device
        t.fit(1)                                 # again, each after another trainer was made or fitted
        assert all(p.device.type == device for p in t.model.parameters())
        assert t.accelerator.device.type == device and math.isfinite(watch.epoch_losses[-1])
        preds, _ = t.predict(t.valid_dl)
        assert preds.shape == (100, 1) and torch.isfinite(preds).all()
    assert b.state.iteration == 8 * 6 and a.state.iteration == c.state.iteration == 8 * 5
