"""A model's output in any shape (a dict with its loss, a tuple `(loss, logits)`, a transformers `ModelOutput`,
`preds_key=`): training, `evaluate`'s metrics and `predict` see the same predictions, never the loss."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [{'x': a, 'labels': b} for a, b in zip(x, y)]


class Shaped(torch.nn.Module):
    "Returns its loss and logits as `shape` says."
    def __init__(self, shape):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.shape = torch.nn.Linear(4, 3), shape

    def forward(self, x, labels=None):
        logits = self.lin(x)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if self.shape == 'dict': return {'output': logits, 'loss': loss}
        if self.shape == 'dict2': return {'loss': loss, 'scores': logits, 'hidden': 2 * logits}
        if self.shape == 'tuple': return (loss, logits) if loss is not None else (logits,)
        if self.shape == 'model_output':
            from transformers.modeling_outputs import SequenceClassifierOutput
            return SequenceClassifierOutput(loss=loss, logits=logits)
        raise ValueError(self.shape)


class Seen:
    "A plain metric that keeps the predictions it was given."
    __name__ = 'seen'
    def __call__(self, preds, targets):
        self.preds = preds
        return (preds.argmax(-1) == targets).float().mean()


def trainer(shape, **kw):
    from trainer_nb.core import Trainer
    d = data()
    return Trainer(Shaped(shape), DataLoader(d, batch_size=8), DataLoader(d, batch_size=16), cpu=True,
                   default_hooks=False, lr=0.05, **kw)


@pytest.mark.parametrize('shape', ['dict', 'tuple', 'model_output'])
def test_predictions_are_the_output_without_its_loss(shape):
    seen = Seen()
    t = trainer(shape, metrics=[seen])
    before = t.evaluate()['valid_loss']
    t.fit(2)
    res = t.evaluate()
    assert res['valid_loss'] < before and t.state.step == 10
    preds, targets = t.predict(t.valid_dl)
    x = torch.stack([b['x'] for b in data()])
    with torch.no_grad(): logits = t.model.lin(x)
    torch.testing.assert_close(preds, logits)
    torch.testing.assert_close(seen.preds, preds)   # the metric saw what predict returns
    assert res['seen'] == (preds.argmax(-1) == targets).float().mean().item()


def test_unlabelled_batches_predict_without_a_loss():
    t = trainer('tuple')
    x = torch.stack([b['x'] for b in data()])
    preds, targets = t.predict(DataLoader([{'x': v} for v in x], batch_size=16))
    assert targets is None
    with torch.no_grad(): torch.testing.assert_close(preds, t.model.lin(x))


def test_several_outputs_and_preds_key():
    x = torch.stack([b['x'] for b in data()])
    t = trainer('dict2')
    preds, _ = t.predict(t.valid_dl)   # every output but the loss, by name
    assert sorted(preds) == ['hidden', 'scores']
    with torch.no_grad(): torch.testing.assert_close(preds['scores'], t.model.lin(x))
    for key in ('scores', lambda out: out['scores']):
        seen = Seen()
        t = trainer('dict2', preds_key=key, metrics=[seen])
        t.fit(1)
        t.evaluate()
        preds, _ = t.predict(t.valid_dl)
        with torch.no_grad(): torch.testing.assert_close(preds, t.model.lin(x))
        torch.testing.assert_close(seen.preds, preds)
    t = trainer('tuple', preds_key=1)
    t.fit(1)
    with torch.no_grad(): torch.testing.assert_close(t.predict(t.valid_dl)[0], t.model.lin(x))
    t = trainer('dict2', preds_key='logits')
    with pytest.raises(KeyError, match="preds_key='logits'.*its keys: 'loss', 'scores', 'hidden'"): t.fit(1)


def test_hooks_after_pred_see_the_predictions():
    from trainer_nb.base import Hook
    class Look(Hook):
        def after_pred(self): self.shapes = getattr(self, 'shapes', []) + [tuple(self.trainer.preds.shape)]
    look = Look()
    t = trainer('tuple', hooks=[look])
    t.fit(1)
    assert look.shapes == [(8, 3)] * 5
