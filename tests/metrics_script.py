"""Evaluation with streaming and plain metrics, for `tests/test_metrics.py`.

`python metrics_script.py memory N KIND OUT`: evaluate a model on N generated samples with a streaming accuracy
(KIND 'streaming') or the plain one ('plain'), and write the result and the peak growth of resident memory.
`accelerate launch ... metrics_script.py dist OUT`: each process writes the results of evaluating, on an uneven
validation set, both kinds of metric.
"""
import json
import sys

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainer_nb.core import Trainer
from trainer_nb.metrics import Accuracy, Mean


def accuracy(preds, targets): return (preds.argmax(-1) == targets).float().mean()
def abs_err(preds, targets): return (preds[:, 0] - targets.float()).abs()
def mae(preds, targets): return abs_err(preds, targets).double().mean()


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


def memory(n, kind, out):
    torch.manual_seed(0)
    metric = Accuracy('accuracy') if kind == 'streaming' else accuracy
    t = Trainer(torch.nn.Linear(8, 10), loss_func=torch.nn.functional.cross_entropy, metrics=[metric], cpu=True,
                default_hooks=False)
    t.evaluate(DataLoader(Batches(20_000), batch_size=None))   # warm up
    open('/proc/self/clear_refs', 'w').write('5')   # the peak (VmHWM) from the current resident size
    base = status('VmRSS')
    res = t.evaluate(DataLoader(Batches(n), batch_size=None))
    json.dump({'result': res, 'samples': t.eval_samples, 'peak': status('VmHWM') - base}, open(out, 'w'))


def dist(out):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(101, 8, generator=g)
    ds = TensorDataset(x, torch.randint(0, 3, (101,), generator=g))
    t = Trainer(torch.nn.Linear(8, 3), valid_dl=DataLoader(ds, batch_size=8),
                metrics=[accuracy, Accuracy('streaming_accuracy'), mae, Mean(abs_err, 'streaming_mae')],
                loss_func=torch.nn.functional.cross_entropy, default_hooks=False)
    res = t.evaluate()
    rank = t.accelerator.process_index
    json.dump({'result': res, 'samples': t.eval_samples, 'processes': t.accelerator.num_processes},
              open(f'{out}/rank{rank}.json', 'w'))


if __name__ == '__main__':
    if sys.argv[1] == 'memory': memory(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else: dist(sys.argv[2])
