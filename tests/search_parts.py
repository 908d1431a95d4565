"""A small problem for the search tests (and the worker processes they start): a linear model trained with SGD, whose
learning rate has bad regions (too small: it barely moves; 1: it diverges) and a good one between."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Trainer

torch.manual_seed(0)
_x = torch.randn(512, 8)
_y = _x @ torch.randn(8, 1) + 0.01 * torch.randn(512, 1)
train_dl = DataLoader(TensorDataset(_x[:384], _y[:384]), batch_size=32, shuffle=True)
valid_dl = DataLoader(TensorDataset(_x[384:], _y[384:]), batch_size=128)


def make(lr, momentum=0.0):
    torch.manual_seed(0)
    return Trainer(nn.Linear(8, 1), train_dl, valid_dl, loss_func=F.mse_loss, lr=lr, default_hooks=False,
                   opt_func=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=momentum))


def lin(n_in: int = 8):
    "The model of the config tests: the registry's model."
    torch.manual_seed(0)
    return nn.Linear(n_in, 1)


def data():
    return train_dl, valid_dl


def mse(preds, targets): return F.mse_loss(preds, targets)


from trainer_nb.registry import register  # noqa: E402

register('model', 'lin')(lin)
register('data', 'lin_data')(data)
register('loss', 'mse')(mse)
