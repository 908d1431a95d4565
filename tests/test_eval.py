"evaluate / predict: dict batches, custom steps, unlabelled data, exact sample counts."
import weakref
from dataclasses import dataclass

import warnings
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import regression_ds, small_model
from trainer_nb.core import Trainer

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class DictModel(torch.nn.Module):
    "Takes `x` and optional `labels`; returns an object with `.loss` and `.logits`, like HF models."
    def __init__(self):
        super().__init__()
        self.net = small_model()
    def forward(self, x, labels=None):
        logits = self.net(x)
        return Output(F.mse_loss(logits, labels) if labels is not None else None, logits)


def dict_ds(n, seed=0, labels=True):
    x, y = regression_ds(n, seed=seed).tensors
    return [({'x': a, 'labels': b} if labels else {'x': a}) for a, b in zip(x, y)]


@pytest.mark.usefixtures('on_the_cpu')
def test_dict_batches_with_model_loss():
    train, valid = dict_ds(48), dict_ds(101, seed=1)
    with warnings.catch_warnings():   # a normal setup (the Hugging Face way): no warning
        warnings.simplefilter('error')
        t = Trainer(DictModel(), DataLoader(train, batch_size=8), DataLoader(valid, batch_size=10),
                    opt_func=torch.optim.SGD, lr=0.05, default_hooks=False,
                    metrics=[lambda p, y: F.l1_loss(p, y)])
    before = t.evaluate()['valid_loss']
    t.fit(3)
    res = t.evaluate()
    assert res['valid_loss'] < before
    x = torch.stack([d['x'] for d in valid]); y = torch.stack([d['labels'] for d in valid])
    with torch.no_grad(): logits = t.model.net(x)
    assert res['valid_loss'] == pytest.approx(F.mse_loss(logits, y).item(), rel=1e-5)
    assert res['<lambda>'] == pytest.approx(F.l1_loss(logits, y).item(), rel=1e-5)
    assert t.eval_samples == 101
    preds, targets = t.predict(DataLoader(valid, batch_size=10))
    torch.testing.assert_close(preds, logits)
    torch.testing.assert_close(targets, y)
    # unlabelled dict batches: no loss, no targets
    preds, targets = t.predict(DataLoader(dict_ds(101, seed=1, labels=False), batch_size=10))
    assert targets is None and preds.shape == (101, 1)
    torch.testing.assert_close(preds, logits)


@pytest.mark.usefixtures('on_the_cpu')
def test_custom_train_and_eval_steps():
    "train_step/eval_step replace the defaults; they get the trainer; preds/targets from eval_step reach the metrics."
    x = torch.randn(60, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    seen = {'train': 0, 'eval': 0}
    def train_step(batch, trainer):
        seen['train'] += 1
        assert trainer.fitting and trainer.model.training
        xb, yb = batch
        logits = trainer.model(xb)
        return {'loss': F.cross_entropy(logits, yb), 'preds': logits}
    def eval_step(batch, trainer):
        seen['eval'] += 1
        assert not trainer.model.training and not torch.is_grad_enabled()
        xb, yb = batch
        logits = trainer.model(xb)
        return {'loss': F.cross_entropy(logits, yb), 'preds': logits.argmax(1), 'targets': yb}
    def accuracy(preds, targets): return (preds == targets).float().mean()
    torch.manual_seed(0)
    t = Trainer(torch.nn.Linear(4, 2), DataLoader(TensorDataset(x, y), batch_size=8),
                DataLoader(TensorDataset(x, y), batch_size=7), train_step=train_step, eval_step=eval_step,
                metrics=[accuracy], lr=0.1, default_hooks=False)
    t.fit(5)
    assert seen == {'train': 5 * 8, 'eval': 5 * 9}
    assert t.model.training                                 # evaluate puts train mode back
    res = t.valid_results
    with torch.no_grad(): logits = t.model(x)
    assert res['accuracy'] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    assert res['accuracy'] > 0.8
    assert res['valid_loss'] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    preds, targets = t.predict(DataLoader(TensorDataset(x, y), batch_size=7))
    assert preds.dtype == torch.long and torch.equal(targets, y) and torch.equal(preds, logits.argmax(1))


@pytest.mark.usefixtures('on_the_cpu')
def test_train_step_used_for_evaluation_without_eval_step():
    x, y = regression_ds(20).tensors
    t = Trainer(small_model(), DataLoader(TensorDataset(x, y), batch_size=8), default_hooks=False,
                train_step=lambda b, tr: {'loss': F.mse_loss(tr.model(b[0]), b[1])})
    res = t.evaluate(DataLoader(TensorDataset(x, y), batch_size=8))
    with torch.no_grad():
        assert res['valid_loss'] == pytest.approx(F.mse_loss(t.model(x), y).item(), rel=1e-5)


@pytest.mark.usefixtures('on_the_cpu')
def test_predict_unlabelled_exact_rows(make_trainer):
    t = make_trainer(n=16, bs=8)
    t.fit(1)
    x = regression_ds(101, seed=3).tensors[0]
    for dl in (DataLoader(TensorDataset(x), batch_size=10), DataLoader(x, batch_size=10)):
        preds, targets = t.predict(dl)
        assert targets is None
        assert preds.shape == (101, 1) and preds.device.type == 'cpu' and not preds.requires_grad
        with torch.no_grad(): torch.testing.assert_close(preds, t.model(x))
        assert t.eval_samples == 101


@pytest.mark.usefixtures('on_the_cpu')
def test_predict_and_evaluate_labelled_exact_rows(make_trainer):
    t = make_trainer(n=16, bs=8, metrics=[lambda p, y: len(p)])
    x, y = regression_ds(101, seed=3).tensors
    dl = DataLoader(TensorDataset(x, y), batch_size=10)
    preds, targets = t.predict(dl)
    assert preds.shape == targets.shape == (101, 1)
    assert torch.equal(targets, y)
    res = t.evaluate(dl)
    assert res['<lambda>'] == 101 and t.eval_samples == 101
    with torch.no_grad():
        assert res['valid_loss'] == pytest.approx(F.mse_loss(t.model(x), y).item(), rel=1e-5)


def test_evaluate_keeps_eval_mode_and_no_grad(make_trainer):
    t = make_trainer(n=16, bs=8, model=torch.nn.Sequential(small_model(), torch.nn.Dropout(0.5)))
    t.model.eval()
    dl = DataLoader(regression_ds(16), batch_size=8)
    a, b = t.evaluate(dl)['valid_loss'], t.evaluate(dl)['valid_loss']
    assert a == b and not t.model.training              # deterministic: dropout off, mode kept
    t.model.train()
    t.evaluate(dl)
    assert t.model.training
    assert all(p.grad is None for p in t.model.parameters())


class Probe(torch.nn.Module):
    "A linear model (5 inputs) that notes, at each forward pass, whether the output of the one before is still alive."
    def __init__(self):
        super().__init__()
        self.lin, self.prev, self.alive = torch.nn.Linear(5, 1), None, []
    def forward(self, x):
        self.alive.append(self.prev is not None and self.prev() is not None)
        out = self.lin(x)
        self.prev = weakref.ref(out)
        return out


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('default_hooks', [False, True])
def test_no_batch_predictions_live_past_the_next_forward_pass(default_hooks):
    """In training and in `evaluate`, with the default hooks or none, and no metric that needs them kept: each batch's
    predictions are gone before the next forward pass (a model whose predictions are large, an LM's logits, holds one
    batch's at a time, not two)."""
    model = Probe()
    t = Trainer(model, DataLoader(regression_ds(32), batch_size=8), DataLoader(regression_ds(40, seed=1), batch_size=8),
                loss_func=F.mse_loss, cpu=True, default_hooks=default_hooks)
    t.evaluate()
    assert model.alive == [False] * 5, model.alive
    model.alive.clear()
    t.fit(1)   # 4 batches, then the validation's 5
    assert model.alive == [False] * 9, model.alive
