"""The default optimizer (AdamW, weight_decay=0.01) decays weight matrices, not biases and normalisation weights, and
keeps one parameter group (split, lrs); an optimizer instance of the user's is left as it is; `summary()` says which."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import regression_ds

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def by_trainer(m, **kw):
    from trainer_nb.core import Trainer
    t = Trainer(m, DataLoader(regression_ds(48), batch_size=8), loss_func=F.mse_loss, cpu=True, default_hooks=False,
                **kw)
    t.opt.param_groups[0]['weight_decay'] = 0.5 if 'opt_func' not in kw else t.opt.param_groups[0]['weight_decay']
    t.fit(2)
    return t


def by_hand(groups, lr=1e-3):
    m = model()
    params = [[p for p in m.parameters() if (p.ndim > 1) == matrices] for matrices in (True, False)]
    opt = torch.optim.AdamW([{'params': params[0], 'weight_decay': 0.5},
                             {'params': params[1], 'weight_decay': 0.5 if groups == 'all' else 0.}], lr=lr)
    for _ in range(2):
        for x, y in DataLoader(regression_ds(48), batch_size=8):
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    return m


def test_default_optimizer_spares_biases_and_norm_weights():
    t = by_trainer(model())
    assert len(t.opt.param_groups) == 1 and len(t.lrs) == 1
    want = by_hand('matrices')
    for p, q in zip(t.model.parameters(), want.parameters()): torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    decays_all = by_hand('all')
    assert max((p - q).abs().max() for p, q in zip(t.model.parameters(), decays_all.parameters())) > 1e-4
    assert "weight decay: 0.5 on 96 parameters; none on 49 (biases, normalisation weights)" in repr(t.summary())


def test_an_optimizer_of_the_users_is_left_alone():
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.5)
    t = by_trainer(m, opt_func=opt)
    want = by_hand('all')
    for p, q in zip(t.model.parameters(), want.parameters()): torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert "weight decay: 0.5 on 145 parameters\n" in repr(t.summary()) + '\n'
