"""The EMA hook: the average a hand-written loop makes, every N steps, no warm-up, on the CPU; resumed from a
checkpoint exactly, its tensors out of the checkpoint's JSON; weights put back when validation fails; what it
refuses."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import flat, regression_ds, small_model

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def by_hand(epochs, decay, every, warmup, lr=0.05):
    "SGD in a plain loop, and the EMA of its weights in float32, updated after every `every`-th step."
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    avg, n, step = [p.detach().clone() for p in model.parameters()], 0, 0
    for _ in range(epochs):
        for x, y in DataLoader(regression_ds(), batch_size=8):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step % every: continue
            d = min(decay, (1 + n) / (10 + n)) if warmup else decay
            for a, p in zip(avg, model.parameters()): a.mul_(d).add_(p.detach(), alpha=1 - d)
            n += 1
    return model, avg, n


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('every,warmup,device', [(1, True, None), (3, False, 'cpu')])
def test_average_matches_a_hand_written_loop(every, warmup, device):
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import EMA
    model, avg, n = by_hand(2, 0.9, every, warmup)
    ema = EMA(decay=0.9, every=every, warmup=warmup, device=device)
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss,
                opt_func=torch.optim.SGD, lr=0.05, hooks=[ema], default_hooks=False)
    t.fit(2)
    assert torch.equal(flat(t.model), flat(model))
    assert ema.n_updates == n == 12 // every
    for a, s in zip(avg, ema.shadow): assert torch.allclose(a, s, atol=1e-6, rtol=0)
    assert not torch.allclose(torch.cat([s.flatten() for s in ema.shadow]), flat(model))


def test_resumed_from_a_checkpoint_the_average_is_bitwise_the_same(tmp_path):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import EMA
    def make(d):
        torch.manual_seed(0)
        ema = EMA(decay=0.95, evaluate=True)
        t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8, shuffle=True),
                    DataLoader(regression_ds(seed=2), batch_size=16), loss_func=F.mse_loss, lr=1e-2,
                    hooks=[ema, Checkpoint(d, every_steps=4, keep_last=None)], default_hooks=False)
        return t, ema
    ref, ref_ema = make(tmp_path / 'a')
    ref.fit(3)
    mid = [p for p in list_checkpoints(tmp_path / 'a') if p.name == 'step-00000008'][0]   # mid-epoch 2 (6 a epoch)
    t, ema = make(tmp_path / 'b')
    t.fit(3, resume=mid)
    assert torch.equal(flat(t.model), flat(ref.model))
    assert ema.n_updates == ref_ema.n_updates == 18
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, ref_ema.shadow))
    assert t.epoch_results['valid_loss'] == ref.epoch_results['valid_loss']   # validated on the same average


def test_weights_put_back_when_validation_fails():
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import EMA
    def bad_metric(preds, targets): raise RuntimeError("metric broke")
    ema = EMA(evaluate=True)
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), DataLoader(regression_ds(), batch_size=8),
                loss_func=F.mse_loss, metrics=[bad_metric], hooks=[ema], default_hooks=False)
    with pytest.raises(RuntimeError, match='metric broke'): t.fit(1)
    trained = flat(t.model)
    with ema.applied(): assert not torch.equal(flat(t.model), trained)   # (the average differs from the weights)
    assert torch.equal(flat(t.model), trained)


def test_refusals():
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import EMA
    with pytest.raises(ValueError, match='decay must be in'): EMA(decay=1.)
    with pytest.raises(ValueError, match='every must be an int'): EMA(every=0)
    ema = EMA()
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss, hooks=[ema],
                default_hooks=False)
    t.fit(1)
    with ema.applied():
        with pytest.raises(RuntimeError, match='in the model already'): ema.swap_in()
    other = EMA()
    other.load_state_dict(ema.state_dict())
    Trainer(torch.nn.Linear(5, 1), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss,
            hooks=[other], default_hooks=False)
    with pytest.raises(ValueError, match='does not fit this model'): other.before_fit()


def test_a_large_average_stays_out_of_the_json(tmp_path):
    "An EMA of a 10M-parameter model: its checkpoint's JSON files stay under 100 kB; the average resumes bitwise."
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import EMA
    def make(d):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 2500), torch.nn.Tanh(), torch.nn.Linear(2500, 4000),
                                    torch.nn.Tanh(), torch.nn.Linear(4000, 1))
        ema = EMA(decay=0.9)
        return Trainer(model, DataLoader(regression_ds(16), batch_size=8), loss_func=F.mse_loss,
                       opt_func=torch.optim.SGD, hooks=[ema, Checkpoint(d, keep_last=1, monitor=None)],
                       default_hooks=False), ema
    t, ema = make(tmp_path)
    assert sum(p.numel() for p in t.model.parameters()) >= 10_000_000
    t.fit(1)
    last = list_checkpoints(tmp_path)[-1]
    sizes = {p.name: p.stat().st_size for p in last.glob('*.json')}
    assert {'trainer_state.json', 'manifest.json', 'rng_0.json'} <= set(sizes) and sum(sizes.values()) < 100_000, sizes
    assert (last / 'trainer_state.safetensors').stat().st_size > 4 * 10_000_000   # the average, float32
    st = json.loads((last / 'trainer_state.json').read_text())
    assert st['hooks']['EMA']['shadow'][0] == {'__tensor__': 'hooks/EMA/shadow/0'} and 'logged' not in st
    t2, ema2 = make(tmp_path)
    t2.fit(1, resume=last)   # (nothing left to train)
    assert ema2.n_updates == ema.n_updates == 2
    assert all(torch.equal(a, b) for a, b in zip(ema2.shadow, ema.shadow))
