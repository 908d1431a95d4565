"`Trainer(seed=...)`: the data's order and dropout come out the same for the same seed, and differ for another."
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import flat, regression_ds

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def trained(seed):
    from trainer_nb.core import Trainer
    torch.manual_seed(123)   # the same initial weights every time: only the trainer's seed differs
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    torch.manual_seed(seed + 1000)   # (what came before the trainer: overridden by its seed)
    t = Trainer(model, DataLoader(regression_ds(48), batch_size=8, shuffle=True), loss_func=F.mse_loss, lr=1e-2,
                cpu=True, default_hooks=False, seed=seed)
    t.fit(2)
    return flat(t.model)


def test_the_same_seed_trains_the_same():
    a, b, c = trained(0), trained(0), trained(1)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
