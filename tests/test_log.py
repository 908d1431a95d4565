"""`trainer.log` and `log_scalar`: values from a train_step, a model's forward and a hook, averaged per epoch into the
history and metrics.jsonl, kept through a state_dict round trip; what is refused."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import LoggingModel, regression_ds, small_model

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def test_log_from_step_model_and_hook_into_history_and_metrics_jsonl(tmp_path):
    from trainer_nb.monitor import MetricsLog, read_metrics
    from trainer_nb.core import Hook, Trainer, log_scalar
    from trainer_nb.recorder import Recorder
    seen = {'out_mean': [], 'x_abs': []}
    def step(batch, t):
        x, y = batch
        out = t.model(x)
        seen['out_mean'].append(out.mean().item())
        seen['x_abs'].append(x.abs().mean().item())
        t.log('x_abs', x.abs().mean())
        return {'loss': F.mse_loss(out, y)}
    class Every(Hook):
        def after_batch(self): self.trainer.log('iteration', self.trainer.state.iteration)   # a plain number
    log_scalar('nothing', 1.)   # no fit running: does nothing
    t = Trainer(LoggingModel(), DataLoader(regression_ds(), batch_size=8), DataLoader(regression_ds(seed=1), batch_size=16),
                train_step=step, eval_step=lambda b, t: {'loss': F.mse_loss(t.model(b[0]), b[1])},
                hooks=[Recorder(), Every(), MetricsLog(tmp_path)], default_hooks=False, sync_every=4)
    t.fit(2)
    h = t.history
    assert list(h.columns) == ['train_loss', 'valid_loss', 'iteration', 'out_mean', 'x_abs', 'time']
    for k in ('out_mean', 'x_abs'):
        assert h[k].tolist() == pytest.approx([sum(seen[k][:6]) / 6, sum(seen[k][6:]) / 6], rel=1e-6), k
    assert h['iteration'].tolist() == [3.5, 9.5]   # means of 1..6 and 7..12 (after_batch sees the counter advanced)
    assert len(t.logged['out_mean'].values) == 12 and 'nothing' not in t.logged
    m = read_metrics(tmp_path)
    ep = m[m.kind == 'epoch']
    assert ep['x_abs'].tolist() == pytest.approx(h['x_abs'].tolist())
    t.evaluate()   # the model's log_scalar() does nothing outside fit (and did nothing while fit validated)
    assert len(t.logged['out_mean'].values) == 12


def test_logged_values_round_trip_and_resume_means():
    from trainer_nb.core import Trainer
    def step(batch, t):
        loss = F.mse_loss(t.model(batch[0]), batch[1])
        t.log('double', 2 * loss)
        return {'loss': loss}
    mk = lambda: Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), train_step=step,
                         default_hooks=False)
    a = mk()
    a.fit(1)
    b = mk()
    sd = a.state_dict()
    tensors = {k: sd.pop(k) for k in ('losses', 'logged')}   # (a checkpoint keeps tensors in files of their own)
    b.load_state_dict({**json.loads(json.dumps(sd)), **tensors})
    assert torch.equal(b.logged['double'].values, a.logged['double'].values)
    assert a.epoch_results['double'] == pytest.approx(2 * a.epoch_results['train_loss'], rel=1e-6)
    b.fit(1)   # the next epoch's mean counts only its own values
    assert b.epoch_results['double'] == pytest.approx(2 * b.epoch_results['train_loss'], rel=1e-6)


def test_log_refusals_and_non_finite_values():
    from trainer_nb.core import Trainer
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss,
                metrics=[lambda p, y: 0.], default_hooks=False)
    with pytest.raises(ValueError, match="the trainer reports its own 'train_loss'"): t.log('train_loss', 1.)
    with pytest.raises(ValueError, match="the trainer reports its own '<lambda>'"): t.log('<lambda>', 1.)
    with pytest.raises(ValueError, match=r"needs one number, got a tensor of shape \(2,\)"): t.log('x', torch.ones(2))
    with pytest.raises(TypeError, match='non-empty str'): t.log('', 1.)
    t.log('x', math.nan)
    t.log('x', torch.tensor(3.))
    assert t.logged.epoch_means(t.accelerator) == {'x': 3.}   # non-finite values left out
    assert math.isnan(t.logged.epoch_means(t.accelerator)['x'])   # nothing new since


def test_the_loss_log_packs_host_numbers_as_torch_rounds_them():
    "The CPU loop's losses are Python floats; a flush packs them as float32, each rounded as `torch.tensor` rounds it."
    import random
    from trainer_nb.base import LossLog
    rng = random.Random(0)
    vals = [rng.uniform(-1e3, 1e3) for _ in range(5000)] + [rng.lognormvariate(0, 40) for _ in range(5000)]
    vals += [math.nan, math.inf, -math.inf, 1e39, -1e39, 1e-46, 1e-40, 5e-324, -0.0, 0.1]
    log = LossLog()
    for v in vals: log.append(v)
    got = log.flush(checked=True)
    want = torch.tensor(vals, dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    log.append(2.5)
    log.append_skipped()   # a batch cancelled before its loss: NaN in its place
    log.append(torch.tensor(0.75))
    tail = log.flush(checked=True)
    assert tail.dtype == torch.float32 and tail[0] == 2.5 and math.isnan(tail[1]) and tail[2] == 0.75
    values = log.values   # the two chunks as one
    assert len(values) == len(vals) + 3 and torch.equal(values[:len(vals)].view(torch.int32), want.view(torch.int32))
