"""Evaluation with torchmetrics and plain metrics, for `tests/test_metrics.py` and `tests/test_hf.py`.

`python metrics_script.py memory N KIND OUT`: evaluate a model on N generated samples with torchmetrics' accuracy
(KIND 'streaming') or a plain function ('plain'), and write the result and the peak growth of resident memory.
`python metrics_script.py lm_memory OUT`: `predict` a tiny GPT-2 over 256 sequences x 64 tokens x 8,000 words with
`preprocess_preds=argmax`, and write the peak growth of resident memory.
`[accelerate launch ...] metrics_script.py MODES OUT` with MODES one or more of 'dist', 'cls' and 'lm', joined by
commas: each process runs each of them in turn and writes what it evaluated to OUT/<mode>/rank<i>.json (see each
function).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassF1Score,
                                         MulticlassPrecision)

from trainer_nb.core import Trainer
from trainer_nb.metrics import Mean


def accuracy(preds, targets): return (preds.argmax(-1) == targets).float().mean()
def abs_err(preds, targets): return (preds[:, 0] - targets.float()).abs()
def mae(preds, targets): return abs_err(preds, targets).double().mean()


class Total(Metric):
    "The sum of `f(preds, targets)` over every sample of every process (a count with `f` = ones)."
    full_state_update = False
    def __init__(self, f):
        super().__init__()
        self.f = f
        self.add_state('total', torch.zeros((), dtype=torch.float64), dist_reduce_fx='sum')
    def update(self, preds, targets): self.total += self.f(preds, targets).double().sum()
    def compute(self): return self.total


class TokenAccuracy(Metric):
    "`hf_parts.token_accuracy` streamed: right and counted next-token predictions (argmax ids), -100 skipped."
    full_state_update = False
    def __init__(self):
        super().__init__()
        self.add_state('right', torch.zeros((), dtype=torch.int64), dist_reduce_fx='sum')
        self.add_state('total', torch.zeros((), dtype=torch.int64), dist_reduce_fx='sum')
    def update(self, preds, labels):
        p, y = preds[:, :-1], labels[:, 1:]
        keep = y != -100
        self.right += (p[keep] == y[keep]).sum()
        self.total += keep.sum()
    def compute(self): return self.right.double() / self.total


class Batches(Dataset):
    "N samples as whole batches made from their index: nothing held per sample."
    def __init__(self, n, bs=10_000): self.n, self.bs = n, bs
    def __len__(self): return -(-self.n // self.bs)
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        m = min(self.bs, self.n - i * self.bs)
        return torch.randn(m, 8, generator=g), torch.randint(0, 10, (m,), generator=g)


def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'): return int(line.split()[1]) * 1024


def peak_growth(f):
    "`(f(), growth of the peak resident memory while it ran)`."
    open('/proc/self/clear_refs', 'w').write('5')   # the peak (VmHWM) from the current resident size
    base = status('VmRSS')
    res = f()
    return res, status('VmHWM') - base


def memory(n, kind, out):
    torch.manual_seed(0)
    metric = MulticlassAccuracy(10, average='micro') if kind == 'streaming' else accuracy
    t = Trainer(torch.nn.Linear(8, 10), loss_func=F.cross_entropy, metrics={'accuracy': metric}, cpu=True,
                default_hooks=False)
    t.evaluate(DataLoader(Batches(20_000), batch_size=None))   # warm up
    res, peak = peak_growth(lambda: t.evaluate(DataLoader(Batches(n), batch_size=None)))
    json.dump({'result': res, 'samples': t.eval_samples, 'peak': peak}, open(out, 'w'))


def lm_memory(out):
    from hf_parts import argmax, gpt2
    from transformers import DataCollatorForLanguageModeling
    from hf_parts import tokenizer
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 8000, (256, 64), generator=g)
    examples = [{'input_ids': r.tolist()} for r in ids]
    collate = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    t = Trainer(gpt2(vocab_size=8000), cpu=True, default_hooks=False, preprocess_preds=argmax)
    t.predict(DataLoader(examples[:16], batch_size=2, collate_fn=collate))   # warm up
    (preds, targets), peak = peak_growth(lambda: t.predict(DataLoader(examples, batch_size=2, collate_fn=collate)))
    json.dump({'peak': peak, 'preds': list(preds.shape), 'dtype': str(preds.dtype), 'targets_equal': bool(
        torch.equal(targets, ids)), 'full_logits_bytes': 256 * 64 * 8000 * 4}, open(out, 'w'))


def dist(out):
    "101 samples, batches of 8: plain and streaming (torchmetrics, `Mean`) accuracy and mean absolute error."
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(101, 8, generator=g)
    ds = TensorDataset(x, torch.randint(0, 3, (101,), generator=g))
    t = Trainer(torch.nn.Linear(8, 3), valid_dl=DataLoader(ds, batch_size=8),
                metrics={'accuracy': accuracy, 'streaming_accuracy': MulticlassAccuracy(3, average='micro'),
                         'mae': mae, 'streaming_mae': Mean(abs_err)},
                loss_func=F.cross_entropy, default_hooks=False)
    write(out, t, {'result': t.evaluate()})


def cls(out):
    """203 samples, 4 classes, batches of 4 per process: on 2 processes the last batch holds 3 real samples on process
    0 and none on process 1. torchmetrics (keyed, a collection, a confusion matrix), evaluated twice, and the
    predictions to check them with scikit-learn."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(203, 8, generator=g)
    ds = TensorDataset(x, torch.randint(0, 4, (203,), generator=g))
    metrics = {'count': Total(lambda p, y: torch.ones_like(y)), 'target_sum': Total(lambda p, y: y),
               'acc': MulticlassAccuracy(4, average='micro'), 'acc_macro': MulticlassAccuracy(4),
               'f1': MulticlassF1Score(4, average='macro'), 'cm': MulticlassConfusionMatrix(4),
               'set': MetricCollection({'prec': MulticlassPrecision(4, average='macro'),
                                        'acc': MulticlassAccuracy(4, average='micro')}), 'plain_acc': accuracy}
    t = Trainer(torch.nn.Linear(8, 4), valid_dl=DataLoader(ds, batch_size=4), metrics=metrics,
                loss_func=F.cross_entropy, default_hooks=False)
    first, second = t.evaluate(), t.evaluate()
    preds, targets = t.predict(t.valid_dl)
    write(out, t, {'result': plain(first), 'again': plain(second), 'preds': preds.argmax(-1).tolist(),
                   'targets': targets.tolist()})


def lm(out):
    """37 sentences of 3 to 20 words, batches of 4 per process, a tiny GPT-2: `predict` (argmax ids) and a plain and a
    torchmetrics token accuracy, with what each sequence gives alone."""
    from hf_parts import argmax, by_hand, gpt2, lm_data, token_accuracy, top2_gap
    examples, collate = lm_data(37)
    model = gpt2()
    t = Trainer(model, valid_dl=DataLoader(examples, batch_size=4, collate_fn=collate), default_hooks=False,
                metrics={'token_accuracy': token_accuracy, 'streaming_token_accuracy': TokenAccuracy()},
                preprocess_preds=argmax)
    res = t.evaluate()
    preds, targets = t.predict(t.valid_dl)
    with t.temporary(preprocess_preds=None): logits, _ = t.predict(t.valid_dl)
    hand, hand_acc = by_hand(model, examples)
    lens = [len(e['input_ids']) for e in examples]
    diff = max((logits[i, :k] - hand[i]).abs().max().item() for i, k in enumerate(lens))
    write(out, t, {'result': res, 'hand_accuracy': hand_acc, 'max_logit_diff': diff, 'min_top2_gap': top2_gap(hand),
                   'shape': list(preds.shape), 'logits_shape': list(logits.shape), 'max_len': max(lens),
                   'ids_equal': all(torch.equal(preds[i, :k], hand[i].argmax(-1)) for i, k in enumerate(lens)),
                   'targets_equal': all(targets[i, :k].tolist() == e['input_ids'] and (targets[i, k:] == -100).all()
                                        for i, (k, e) in enumerate(zip(lens, examples))),
                   'batch_pads': [(preds[i, max(lens[i // 4 * 4:i // 4 * 4 + 4]):] == -100).all().item()
                                  for i in range(len(lens) - 1)]})   # (the last: beside copies on 2 processes)


def plain(res): return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in res.items()}


def write(out, t, d):
    acc = t.accelerator
    d.update(samples=t.eval_samples, processes=acc.num_processes)
    json.dump(d, open(f'{out}/rank{acc.process_index}.json', 'w'))


if __name__ == '__main__':
    mode = sys.argv[1]
    if mode == 'memory': memory(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif mode == 'lm_memory': lm_memory(sys.argv[2])
    else:
        for m in mode.split(','):
            os.makedirs(f'{sys.argv[2]}/{m}', exist_ok=True)
            {'dist': dist, 'cls': cls, 'lm': lm}[m](f'{sys.argv[2]}/{m}')
