"""Token-exact gradient accumulation: a GPT-2-shaped model (random weights from a config) on sentences of ragged
lengths, padded per batch with -100 labels: batches of 4 accumulated 2 at a time train as batches of 8 do."""
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import REPO, flat

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
sys.path.insert(0, str(REPO / 'tests'))


def train(bs, grad_accum):
    "The weights after 3 steps of SGD (no dropout, no shuffling): the same 24 sentences in the same order."
    from trainer_nb.core import Trainer
    from hf_parts import gpt2, lm_data
    examples, collate = lm_data(24, seed=3)
    model = gpt2()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout): m.p = 0.
    t = Trainer(model, DataLoader(examples, batch_size=bs, collate_fn=collate), opt_func=torch.optim.SGD, lr=0.5,
                grad_accum=grad_accum, cpu=True, default_hooks=False)
    t.fit(1)
    assert t.state.step == 3
    return flat(t.model)


def test_accumulated_small_batches_train_as_the_big_batch(monkeypatch):
    import trainer_nb.loop as loop
    big, small = train(8, 1), train(4, 2)
    torch.testing.assert_close(small, big, rtol=0, atol=2e-6)
    monkeypatch.setattr(loop, '_counts_items', lambda t: False)   # each micro-batch's mean divided by grad_accum
    old = train(4, 2)
    assert (old - big).abs().max() > 100 * (small - big).abs().max()
    print(f"max |weights - big batch's|: counted {(small - big).abs().max():.3g}, "
          f"each mean / grad_accum {(old - big).abs().max():.3g}")


def test_two_processes_train_as_the_big_batch(tmp_path):
    "2 processes (gloo) x batches of 2 x accumulation 2: the same 8 sentences per step as one process's batch of 8."
    import os
    import subprocess
    from conftest import VENV_BIN, free_port
    env = dict(os.environ, ACCELERATE_USE_CPU='1', CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()),
           __file__, str(tmp_path / 'weights.pt')]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    torch.testing.assert_close(torch.load(tmp_path / 'weights.pt'), train(8, 1), rtol=0, atol=2e-6)



class Tagger(torch.nn.Module):
    "A tag per token: `(batch, tags, tokens)` logits, as `nn.CrossEntropyLoss` takes them."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 5)
    def forward(self, x): return self.out(self.emb(x)).transpose(1, 2)


def tagged(n=24, seed=0):
    "Sequences of 2 to 12 tokens, a tag each."
    g = torch.Generator().manual_seed(seed)
    return [(x, x % 5) for x in (torch.randint(0, 20, (int(k),), generator=g)
                                 for k in torch.randint(2, 13, (n,), generator=g))]


def pad(batch):
    "Each batch padded to its own longest sequence: inputs with 0, tags with -100."
    xs, ys = zip(*batch)
    return (torch.nn.utils.rnn.pad_sequence(xs, batch_first=True),
            torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100))


def tag_train(bs, grad_accum, loss_func):
    from trainer_nb.core import Trainer
    t = Trainer(Tagger(), DataLoader(tagged(), batch_size=bs, collate_fn=pad), DataLoader(tagged(), batch_size=24,
                collate_fn=pad), loss_func=loss_func, opt_func=torch.optim.SGD, lr=0.5, grad_accum=grad_accum,
                cpu=True, default_hooks=False)
    t.fit(1)
    return flat(t.model), t


def test_a_summing_loss_func_is_divided_by_the_group_s_items():
    big, tb = tag_train(8, 1, torch.nn.CrossEntropyLoss())   # the mean over the big batch's tokens
    small, ts = tag_train(4, 2, torch.nn.CrossEntropyLoss(reduction='sum'))
    torch.testing.assert_close(small, big, rtol=0, atol=1e-6)
    one, _ = tag_train(8, 1, torch.nn.CrossEntropyLoss(reduction='sum'))
    torch.testing.assert_close(one, big, rtol=0, atol=1e-6)
    assert ts.valid_results['valid_loss'] == pytest.approx(tb.valid_results['valid_loss'], rel=1e-5)   # a mean too
    mean4, _ = tag_train(4, 2, torch.nn.CrossEntropyLoss())   # a plain mean: each micro-batch's / grad_accum
    assert (mean4 - big).abs().max() > 100 * (small - big).abs().max()

if __name__ == '__main__':   # one of the processes of `test_two_processes_train_as_the_big_batch`
    sys.path.insert(0, str(REPO))
    w = train(2, 2)
    from accelerate import PartialState
    if PartialState().is_main_process: torch.save(w, sys.argv[1])
