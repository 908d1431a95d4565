"""trainer.summary() (shapes from one real batch, parameter counts, memory; HTML and text) and find_batch_size() (halves
on out-of-memory, the trainer as it was), and a kernel still usable after an out-of-memory error inside fit."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from conftest import regression_ds
from trainer_nb.core import Trainer
from trainer_nb.workflow import ModelSummary

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(16, 1)
    def forward(self, x): return self.head(self.body(x))


def make(model=None, bs=8, **kw):
    return Trainer(model or Net(), DataLoader(regression_ds(64), batch_size=bs, shuffle=True), loss_func=F.mse_loss,
                   cpu=True, default_hooks=False, **kw)


def test_summary_rows_counts_memory_and_nothing_changed():
    t = make()
    t.split('body', 'head').freeze()
    bn = {k: v.clone() for k, v in t.model.body[1].state_dict().items()}
    rng = torch.get_rng_state()
    s = t.summary()
    assert isinstance(s, ModelSummary)
    assert list(s.rows.module) == ['body.0', 'body.1', 'body.2', 'body.3', 'head']
    assert s.rows['output shape'].tolist() == [(8, 16)] * 4 + [(8, 1)]
    assert s.rows.params.tolist() == [96, 32, 0, 0, 17] and s.rows.trainable.tolist() == [0, 0, 0, 0, 17]
    assert (s.totals['params'], s.totals['trainable'], s.totals['frozen']) == (145, 17, 128)
    assert s.totals['weights_bytes'] == 4 * 145 + 4 * 32 + 8   # BatchNorm: running mean, var (float32), count (int64)
    assert s.totals['optimizer_bytes'] == 0 and s.totals['input'] == [(8, 5), (8, 1)]
    assert torch.equal(torch.get_rng_state(), rng) and t.model.training and t.model.body[3].training
    assert all(torch.equal(v, t.model.body[1].state_dict()[k]) for k, v in bn.items())   # eval mode: stats untouched
    t.fit(1)
    s = t.summary()
    assert s.totals['optimizer_bytes'] == 2 * 4 * 17 + 2 * 4   # AdamW's two moments and a step for the head's 2 tensors
    text, page = repr(s), s._repr_html_()
    assert 'body.0' in text and '145 (17 trainable: 11.72%, 128 frozen)' in text and 'optimizer state: 0.00 MB' in text
    assert page.count('<table') == 2 and '<td>BatchNorm1d</td>' in page and '145 (17 trainable: 11.72%, 128 frozen)' in page


def test_summary_of_a_dict_model():
    class Dicty(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 1)
        def forward(self, x, labels=None):
            out = self.lin(x)
            return {'loss': F.mse_loss(out, labels), 'logits': out}
    ds = [{'x': x, 'labels': y} for x, y in regression_ds(16)]
    t = Trainer(Dicty(), DataLoader(ds, batch_size=4), cpu=True, default_hooks=False)
    s = t.summary()
    assert s.rows['output shape'].tolist() == [(4, 1)] and s.totals['output'] == {'loss': (), 'logits': (4, 1)}


class Greedy(nn.Module):
    "Out of memory (the error PyTorch raises) above `limit` samples a batch."
    def __init__(self, limit):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.limit, self.tried = nn.Linear(5, 1), limit, []
    def forward(self, x):
        self.tried.append(len(x))
        if len(x) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return self.lin(x)


@pytest.mark.parametrize('limit,start,found,tried', [(20, 64, 16, [64, 32, 16]), (64, 1024, 64, [64]),
                                                      (1, 8, 1, [8, 4, 2, 1])])
def test_find_batch_size_halves_on_oom(limit, start, found, tried):
    t = make(Greedy(limit))
    before = [p.detach().clone() for p in t.model.parameters()]
    assert t.find_batch_size(start) == found
    assert t.model.tried == tried   # (start is capped at the dataset's 64 samples)
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
    assert t.state.step == 0 and len(t.losses) == 0 and len(t.train_dl) == 8   # the trainer as it was


def test_find_batch_size_nothing_fits_and_other_errors_pass_through():
    t = make(Greedy(0))
    with pytest.raises(RuntimeError, match='No executable batch size found'): t.find_batch_size(8)
    class Broken(nn.Linear):
        def forward(self, x): raise ValueError("a bug, not memory")
    t = make(Broken(5, 1))
    with pytest.raises(ValueError, match='a bug'): t.find_batch_size(8)


def test_oom_inside_fit_leaves_a_usable_trainer():
    t = make(Greedy(16), bs=32)
    with pytest.raises(torch.OutOfMemoryError) as info: t.fit(1)
    assert any('Out of memory: the trainer let go' in n for n in info.value.__notes__)
    assert t.batch is None and t.loss is None and t.preds is None and not t.fitting
    frames, tb = [], info.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert not any(isinstance(v, torch.Tensor) and v.shape[:1] == (32,) for f in frames[1:] for v in f.f_locals.values())
    t.train_dl = DataLoader(regression_ds(64), batch_size=16)
    t.fit(1)
    assert t.state.step == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_find_batch_size_on_a_gpu():
    "A real out-of-memory: activations of 2**16 floats a sample; the batch found trains, and memory is given back."
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(5, 2 ** 16), nn.Linear(2 ** 16, 1)
        def forward(self, x): return self.down(torch.relu(self.up(x)).pow(2))
    free, _ = torch.cuda.mem_get_info()
    # samples: far more than fit (about 1 MB of activations each: 1 TB), and no more, as the loader collates a batch
    # sample by sample (from 2**26, the first try alone reads 67 million samples, one at a time)
    n = 2 ** 20
    x = torch.randn(n, 5)
    t = Trainer(Wide(), DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=8), loss_func=F.mse_loss,
                default_hooks=False)
    found = t.find_batch_size(n)
    assert 1 <= found < n and found * 2 ** 16 * 4 < free
    base = torch.cuda.memory_allocated()
    t.train_dl = DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=found * 4)
    with pytest.raises(torch.OutOfMemoryError): t.fit(1)
    assert torch.cuda.memory_allocated() <= base + 2 ** 20   # the failed step's tensors are gone
    t.train_dl = DataLoader(torch.utils.data.TensorDataset(x[:found * 2], x[:found * 2, :1]), batch_size=found)
    t.fit(1)
    assert t.state.step == 2
