"""A tiny GAN (two optimizers, manual steps) and SAM (two forward/backward passes per step), each with the same
training written as a hand-made PyTorch loop, for `tests/test_manual.py` and `tests/manual_script.py`."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def gan_data(n=64, seed=0) -> TensorDataset:
    "2-d points on a shifted, stretched Gaussian: what the generator learns to draw."
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 2, generator=g) * torch.tensor([2., .5]) + torch.tensor([1., -1.]))


def gan_model(seed=0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({'gen': nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)),
                          'disc': nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))})


def gan_losses(model, real, noise):
    "The discriminator's loss (the fakes detached) and the generator's loss (through a frozen discriminator)."
    gen, disc = model['gen'], model['disc']
    fake = gen(noise)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    d_loss = (F.binary_cross_entropy_with_logits(disc(real), ones)
              + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros))
    return d_loss, fake, ones


def gan_step(batch, trainer):
    "One manual step: the discriminator, then the generator, each with its own optimizer."
    model, (real,) = trainer.model, batch
    noise = torch.randn(len(real), 4)
    d_loss, fake, ones = gan_losses(model, real, noise)
    trainer.backward(d_loss)
    trainer.step('disc')
    model['disc'].requires_grad_(False)   # the generator's loss leaves no gradient in the discriminator
    g_loss = F.binary_cross_entropy_with_logits(model['disc'](fake), ones)
    trainer.backward(g_loss)
    model['disc'].requires_grad_(True)
    trainer.step('gen')
    trainer.log('d_loss', d_loss)
    trainer.log('g_loss', g_loss)
    return {'loss': (d_loss + g_loss).detach()}


def gan_optimizers(lr=2e-3):
    return {'gen': lambda m: torch.optim.Adam(m['gen'].parameters(), lr=lr, betas=(0.5, 0.9)),
            'disc': lambda m: torch.optim.Adam(m['disc'].parameters(), lr=lr, betas=(0.5, 0.9))}


def gan_by_hand(epochs, bs=8, seed=0):
    "The same training in a plain PyTorch loop; returns the model."
    model = gan_model(seed)
    opts = {k: f(model) for k, f in gan_optimizers().items()}
    dl = DataLoader(gan_data(), batch_size=bs)
    for _ in range(epochs):
        for (real,) in dl:
            noise = torch.randn(len(real), 4)
            d_loss, fake, ones = gan_losses(model, real, noise)
            d_loss.backward()
            opts['disc'].step()
            opts['disc'].zero_grad(set_to_none=True)
            model['disc'].requires_grad_(False)
            F.binary_cross_entropy_with_logits(model['disc'](fake), ones).backward()
            model['disc'].requires_grad_(True)
            opts['gen'].step()
            opts['gen'].zero_grad(set_to_none=True)
    return model


def sam_perturb(params, rho):
    "Move each weight by `rho` along its gradient (normalised over all of them); returns the moves."
    with torch.no_grad():
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        moves = [rho * p.grad / (norm + 1e-12) for p in params]
        for p, e in zip(params, moves): p.add_(e)
    return moves


def sam_unperturb(params, moves):
    with torch.no_grad():
        for p, e in zip(params, moves): p.sub_(e)


def sam_step(batch, trainer, rho=0.05):
    "Sharpness-aware minimisation: the gradient at the worst nearby weights, applied at the weights themselves."
    x, y = batch
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = F.mse_loss(trainer.model(x), y)
    trainer.backward(loss)
    moves = sam_perturb(params, rho)
    trainer.zero_grad()
    trainer.backward(F.mse_loss(trainer.model(x), y))
    sam_unperturb(params, moves)
    trainer.step()
    return {'loss': loss.detach()}


def sam_by_hand(model, dl, epochs, lr, rho=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())
    for _ in range(epochs):
        for x, y in dl:
            F.mse_loss(model(x), y).backward()
            moves = sam_perturb(params, rho)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            sam_unperturb(params, moves)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model
