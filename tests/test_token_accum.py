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
    import trainer_nb.core as core
    big, small = train(8, 1), train(4, 2)
    torch.testing.assert_close(small, big, rtol=0, atol=2e-6)
    monkeypatch.setattr(core, '_counts_items', lambda t: False)   # each micro-batch's mean divided by grad_accum
    old = train(4, 2)
    assert (old - big).abs().max() > 100 * (small - big).abs().max()
    print(f"max |weights - big batch's|: counted {(small - big).abs().max():.3g}, "
          f"each mean / grad_accum {(old - big).abs().max():.3g}")


def test_two_processes_train_as_the_big_batch(tmp_path):
    "2 processes (gloo) x batches of 2 x accumulation 2: the same 8 sentences per step as one process's batch of 8."
    import os
    import subprocess
    from conftest import VENV_BIN, free_port
    env = dict(os.environ, ACCELERATE_USE_CPU='1', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = [str(VENV_BIN / 'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()),
           __file__, str(tmp_path / 'weights.pt')]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    torch.testing.assert_close(torch.load(tmp_path / 'weights.pt'), train(8, 1), rtol=0, atol=2e-6)


if __name__ == '__main__':   # one of the processes of `test_two_processes_train_as_the_big_batch`
    sys.path.insert(0, str(REPO))
    w = train(2, 2)
    from accelerate import PartialState
    if PartialState().is_main_process: torch.save(w, sys.argv[1])
