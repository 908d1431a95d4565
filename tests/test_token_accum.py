"""Token-exact gradient accumulation: a GPT-2-shaped model (random weights from a config) on sentences of ragged
lengths, padded per batch with -100 labels: batches of 4 accumulated 2 at a time train as batches of 8 do."""
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import REPO, flat

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
sys.path.insert(0, str(REPO / 'tests'))


def train(bs, grad_accum, record=False):
    """The weights after 3 steps of SGD (no dropout, no shuffling): the same 24 sentences in the same order; with
    `record`, `(weights, each step's logged loss, the epoch's train_loss)`."""
    from trainer_nb.core import Trainer
    from trainer_nb.recorder import Recorder
    from hf_parts import gpt2, lm_data
    examples, collate = lm_data(24, seed=3)
    model = gpt2()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout): m.p = 0.
    t = Trainer(model, DataLoader(examples, batch_size=bs, collate_fn=collate), opt_func=torch.optim.SGD, lr=0.5,
                grad_accum=grad_accum, cpu=True, default_hooks=False, hooks=[Recorder()] if record else [])
    t.fit(1)
    assert t.state.step == 3
    if not record: return flat(t.model)
    return flat(t.model), t.get_hook(Recorder).steps['loss'].tolist(), float(t.history['train_loss'].iloc[-1])


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
    got, (big, losses, train_loss) = torch.load(tmp_path / 'weights.pt'), train(8, 1, record=True)
    torch.testing.assert_close(got['weights'], big, rtol=0, atol=2e-6)
    # the loss logged for each step: over the step's tokens on both processes (as HF's Trainer logs it), the same on
    # each process, and so the epoch's train_loss too
    for rank in (0, 1):
        assert got['losses'][rank] == pytest.approx(losses, rel=1e-5, abs=0)
        assert got['train_loss'][rank] == pytest.approx(train_loss, rel=1e-5, abs=0)


def test_logged_loss_is_the_step_s_loss():
    """Batches of 4 accumulated 2 at a time (each padded apart, each a mean over its own tokens): the loss logged for
    each step (Recorder, metrics.jsonl, the epoch's train_loss) is the mean over the step's 8 sentences' tokens, as the
    batch of 8 (one step each) logs it, not the mean of the two batches' means."""
    _, big, big_epoch = train(8, 1, record=True)
    _, small, small_epoch = train(4, 2, record=True)
    assert small == pytest.approx(big, rel=1e-5, abs=0) and small_epoch == pytest.approx(big_epoch, rel=1e-5, abs=0)



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


def by_hand_losses(bs=8):
    "Each step's loss of SGD on batches of `bs` (the mean over their real tags), computed before the step."
    model, losses = Tagger(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in DataLoader(tagged(), batch_size=bs, collate_fn=pad):
        loss = torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def test_logged_loss_of_a_summing_loss_func_is_the_step_s_loss(tmp_path):
    """A summing loss, batches of 4 padded apart, accumulated 2 at a time: each step's logged loss (Recorder,
    metrics.jsonl, history) is the sum of its tags' losses over their number, computed here by hand on batches of 8."""
    import json
    from trainer_nb.core import Trainer
    from trainer_nb.monitor import MetricsLog
    from trainer_nb.recorder import Recorder
    t = Trainer(Tagger(), DataLoader(tagged(), batch_size=4, collate_fn=pad),
                loss_func=torch.nn.CrossEntropyLoss(reduction='sum'), opt_func=torch.optim.SGD, lr=0.5, grad_accum=2,
                cpu=True, default_hooks=False, hooks=[Recorder(), MetricsLog(tmp_path, every_steps=1)])
    t.fit(1)
    hand = by_hand_losses()
    assert len(hand) == 3
    assert t.get_hook(Recorder).steps['loss'].tolist() == pytest.approx(hand, rel=1e-5, abs=0)
    lines = [json.loads(x) for x in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert [x['loss'] for x in lines if x['kind'] == 'train'] == pytest.approx(hand, rel=1e-5, abs=0)
    assert t.history['train_loss'].iloc[-1] == pytest.approx(sum(hand) / 3, rel=1e-5, abs=0)
    assert t.losses.values.tolist() == pytest.approx([v for v in hand for _ in (0, 1)], rel=1e-5, abs=0)


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
    w, losses, train_loss = train(2, 2, record=True)
    from accelerate import PartialState
    from accelerate.utils import gather_object
    losses, train_loss = gather_object([losses]), gather_object([train_loss])   # each process's
    if PartialState().is_main_process: torch.save(dict(weights=w, losses=losses, train_loss=train_loss), sys.argv[1])
