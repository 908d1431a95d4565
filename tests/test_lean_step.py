"""A lean step: no reference to a batch's predictions survives its backward pass, so the tensors alive during the
optimizer step are a hand-written loop's (counted at each step, over every tensor Python can reach); a hook with
`keep_preds = True` keeps them, and `after_loss`/`after_backward` hooks see them."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
N_CLASSES = 4000   # logits of a batch: 16 x 4000 floats (256 kB), as large as a third of the weights


def live_bytes(opt) -> int:
    "Bytes of every distinct tensor storage that Python objects reach now, `opt`'s gradients included."
    grads = [p.grad for g in opt.param_groups for p in g['params']]   # (each reachable from Python from here on)
    gc.collect()
    seen = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == 'cpu' and not o.is_meta:
            s = o.untyped_storage()
            try: seen[s.data_ptr()] = s.nbytes()
            except RuntimeError: pass   # a fake tensor (left by an earlier torch.compile in this process): no memory
    del grads
    return sum(seen.values())


def setup():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, N_CLASSES, (64,), generator=g)
    torch.manual_seed(0)
    return torch.nn.Linear(32, N_CLASSES), DataLoader(TensorDataset(x, y), batch_size=16)


def at_steps(opt):
    "The live tensor bytes when each step of `opt` begins."
    sizes = []
    opt.register_step_pre_hook(lambda o, *a: sizes.append(live_bytes(o)))
    return sizes


def by_hand():
    model, dl = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sizes = at_steps(opt)
    for x, y in dl:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return sizes


def by_trainer(hooks=()):
    from trainer_nb.core import Trainer
    model, dl = setup()
    t = Trainer(model, dl, loss_func=F.cross_entropy, lr=1e-3, cpu=True, default_hooks=False, hooks=hooks)
    sizes = at_steps(t.opt.optimizer)
    t.fit(1)
    return sizes


def test_step_holds_what_a_hand_written_loop_holds():
    from trainer_nb.base import Hook
    hand = by_hand()
    gc.collect()
    lean = by_trainer()
    assert len(hand) == len(lean) == 4
    for h, t in zip(hand, lean): assert abs(t - h) <= 1e-3 * h, (hand, lean)

    class Keep(Hook):
        keep_preds = True
        def after_loss(self): self.seen = [self.trainer.preds.shape]
        def after_backward(self): self.seen.append(self.trainer.preds.shape)
        def after_batch(self): self.kept = self.trainer.preds is not None
    keep = Keep()
    kept = by_trainer([keep])
    assert keep.seen == [(16, N_CLASSES)] * 2 and keep.kept
    logits = 16 * N_CLASSES * 4
    for h, t in zip(hand, kept): assert t - h >= logits, (hand, kept)   # asked for: the logits stay
