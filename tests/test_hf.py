"""The models and data users bring: a tiny GPT-2 with `DataCollatorForLanguageModeling` (ragged outputs padded with
-100 across batches and processes, `preprocess_preds`, its memory), dict batches with `loss_func`, keys the model's
forward doesn't take, and `datasets`. Random weights from configs, tokenizers built in memory: nothing downloaded."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import REPO
from test_metrics import run_script

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
sys.path.insert(0, str(REPO / 'tests'))
SCRIPT = str(REPO / 'tests' / 'metrics_script.py')


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('processes', [1, 2])
def test_causal_lm_predict_and_token_accuracy_equal_by_hand(tmp_path, processes):
    for r in run_script(tmp_path, 'lm', processes):
        assert r['samples'] == 37 and r['shape'] == [37, r['max_len']] and r['logits_shape'] == [37, r['max_len'], 42]
        # the by-hand argmax can be compared exactly: no two logits are closer than their rounding differences
        assert r['min_top2_gap'] > 10 * r['max_logit_diff'], r
        assert r['ids_equal'] and r['targets_equal'] and all(r['batch_pads'])
        res = r['result']
        assert res['token_accuracy'] == pytest.approx(r['hand_accuracy'], rel=1e-12, abs=0)
        assert res['streaming_token_accuracy'] == pytest.approx(r['hand_accuracy'], rel=1e-12, abs=0)


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason="needs Linux's /proc/self/clear_refs")
def test_preprocess_preds_keeps_ids_not_logits(tmp_path):
    """256 sequences x 64 tokens x 8,000 words: the peak grows by less than a quarter of what the logits would take
    (524 MB; kept, they and their concatenation raise it by 1.06 GB). The allocator's own high-water mark for the
    per-batch work moves between 17 and 81 MB from run to run on a busy machine, so a tenth (52 MB) failed by chance."""
    out = tmp_path / 'lm_memory.json'
    p = subprocess.run([sys.executable, SCRIPT, 'lm_memory', str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r['preds'] == [256, 64] and r['dtype'] == 'torch.int64' and r['targets_equal']
    assert r['peak'] < r['full_logits_bytes'] / 4, r


class Net(torch.nn.Module):
    "Takes `x` by name; returns logits, or an HF-style output with `.logits`."
    def __init__(self, hf_output=False):
        super().__init__()
        self.lin, self.hf_output = torch.nn.Linear(4, 3), hf_output
    def forward(self, x):
        out = self.lin(x)
        return {'logits': out} if self.hf_output else out


def dict_batches(n=64, key='labels', extra=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [{'x': a, key: b, **({'idx': torch.tensor(i)} if extra else {})} for i, (a, b) in enumerate(zip(x, y))]


@pytest.mark.parametrize('hf_output', [False, True])
def test_dict_batches_with_loss_func(hf_output):
    from trainer_nb.core import Trainer
    torch.manual_seed(0)
    data = dict_batches()
    t = Trainer(Net(hf_output), DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=10),
                loss_func=F.cross_entropy, lr=0.05, cpu=True, default_hooks=False,
                metrics={'acc': lambda p, y: (p.argmax(-1) == y).float().mean()})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        before = t.evaluate()['valid_loss']
        t.fit(3)
        t.evaluate()
    notes = [str(x.message) for x in w if 'dropped' in str(x.message)]
    assert notes == ["Batch keys 'idx' dropped: Net.forward takes no argument of that name"]   # one note, once
    res = t.evaluate()
    x, y = torch.stack([d['x'] for d in data]), torch.stack([d['labels'] for d in data])
    with torch.no_grad(): logits = t.model.lin(x)
    assert res['valid_loss'] < before
    assert res['valid_loss'] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert res['acc'] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    p, targets = t.predict(t.valid_dl)
    torch.testing.assert_close(p, logits)
    assert torch.equal(targets, y)


def test_target_key_and_errors_that_say_what_they_expected():
    from trainer_nb.core import Trainer
    data = dict_batches(key='y', extra=False)
    t = Trainer(Net(), DataLoader(data, batch_size=8), loss_func=F.cross_entropy, cpu=True, default_hooks=False,
                target_key='y')
    t.fit(1)
    assert t.state.step == 8
    t = Trainer(Net(), DataLoader(data, batch_size=8), loss_func=F.cross_entropy, cpu=True, default_hooks=False)
    with pytest.raises(KeyError, match="no 'labels' \\(its keys: 'x', 'y'\\): pass target_key="): t.fit(1)
    t = Trainer(Net(), DataLoader(range(8), batch_size=4, collate_fn=set), loss_func=F.cross_entropy, cpu=True,
                default_hooks=False)
    with pytest.raises(TypeError, match="got a set, expected an \\(x, y\\) tuple or list.*a dict"): t.fit(1)


def test_datasets_and_a_transformers_classifier_with_an_extra_column():
    "A `datasets.Dataset` in torch format with an `idx` column: dropped for the model, with its own loss or loss_func."
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification
    from trainer_nb.core import Trainer
    from hf_parts import sentences, tokenizer
    tok = tokenizer()
    texts = sentences(48, lo=4, hi=4)   # one length: the dataset's default collation stacks them
    labels = [int(s.split()[0] < 'w2') for s in texts]
    ds = Dataset.from_dict({'text': texts, 'labels': labels, 'idx': list(range(48))})
    ds = ds.map(lambda b: tok(b['text']), batched=True, remove_columns=['text']).with_format('torch')
    cfg = BertConfig(vocab_size=42, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     num_labels=2, max_position_embeddings=16, pad_token_id=0)
    for loss_func in (None, F.cross_entropy):
        torch.manual_seed(0)
        t = Trainer(BertForSequenceClassification(cfg), DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=16),
                    loss_func=loss_func, cpu=True, default_hooks=False, lr=1e-2)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            t.fit(2)
        assert [str(x.message) for x in w if 'dropped' in str(x.message)] == [
            "Batch keys 'idx' dropped: BertForSequenceClassification.forward takes no argument of that name"]
        preds, targets = t.predict(t.valid_dl)
        assert preds.shape == (48, 2) and torch.equal(targets, torch.tensor(labels))
        assert t.evaluate()['valid_loss'] == pytest.approx(F.cross_entropy(preds, targets).item(), rel=1e-5)
