"""Taking over the step: overridden backward/optimizer_step/zero_grad, manual optimization (a GAN with two optimizers,
SAM with two backward passes per step) equal to hand-written loops, several optimizers and schedulers resumed
bitwise after a real SIGKILL, and what manual mode refuses."""
import json
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from conftest import REPO, flat, regression_ds, small_model
from manual_parts import gan_by_hand, gan_data, gan_model, gan_optimizers, gan_step, sam_by_hand, sam_step

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
SCRIPT = str(REPO / 'tests' / 'manual_script.py')


@pytest.mark.usefixtures('on_the_cpu')
def test_gan_two_optimizers_equals_a_hand_written_loop():
    from trainer_nb.core import Trainer
    torch.manual_seed(5)
    ref = gan_by_hand(epochs=2)
    torch.manual_seed(5)
    t = Trainer(gan_model(), DataLoader(gan_data(), batch_size=8), train_step=gan_step, manual=True,
                optimizers=gan_optimizers(), default_hooks=False)
    assert list(t.optimizers) == ['gen', 'disc'] and t.opt is t.optimizers['gen']
    t.fit(2)
    assert torch.equal(flat(t.model), flat(ref))
    assert t.state.step == 16 and t.state.iteration == 16   # one step per batch, two optimizers stepped in it
    assert len(t.losses.values) == 16 and torch.isfinite(t.losses.values).all()


@pytest.mark.usefixtures('on_the_cpu')
def test_sam_two_backward_passes_equals_a_hand_written_loop():
    from trainer_nb.core import Trainer
    dl = DataLoader(regression_ds(), batch_size=8)
    ref = sam_by_hand(small_model(), dl, epochs=2, lr=0.1)
    t = Trainer(small_model(), dl, train_step=sam_step, manual=True, opt_func=torch.optim.SGD, lr=0.1,
                default_hooks=False)
    t.fit(2)
    assert torch.equal(flat(t.model), flat(ref))
    plain = Trainer(small_model(), dl, loss_func=F.mse_loss, opt_func=torch.optim.SGD, lr=0.1, default_hooks=False)
    plain.fit(2)
    assert not torch.equal(flat(plain.model), flat(ref))   # SAM's step is not the plain one


@pytest.mark.usefixtures('on_the_cpu')
def test_manual_step_under_accumulation_and_clipping_matches_the_automatic_step():
    "trainer.backward/trainer.step keep Accelerate's division by grad_accum, step once per group, clip once per step."
    from trainer_nb.core import Trainer
    dl = DataLoader(regression_ds(n=40), batch_size=8)   # 5 batches: groups of 2, 2 and a last one of 1
    def manual(batch, t):
        loss = F.mse_loss(t.model(batch[0]), batch[1])
        t.backward(loss)
        t.step()
        return {'loss': loss.detach()}
    kw = dict(opt_func=torch.optim.SGD, lr=0.3, grad_accum=2, max_grad_norm=0.05, default_hooks=False)
    auto = Trainer(small_model(), dl, loss_func=F.mse_loss, **kw)
    auto.fit(2)
    man = Trainer(small_model(), dl, train_step=manual, manual=True, **kw)
    man.fit(2)
    assert man.state.step == auto.state.step == 6
    assert torch.allclose(flat(man.model), flat(auto.model), atol=1e-6, rtol=0)
    assert not torch.allclose(flat(man.model), flat(small_model()))


def test_overridden_parts_are_used_and_the_default_path_is_unchanged():
    from trainer_nb.core import Trainer
    calls = []
    class Mine(Trainer):
        def backward(self, loss):
            calls.append('backward')
            super().backward(loss * 2)   # twice the gradient
        def optimizer_step(self):
            calls.append('step')
            super().optimizer_step()
        def zero_grad(self):
            calls.append('zero')
            super().zero_grad()
    dl = DataLoader(regression_ds(), batch_size=8)
    mine = Mine(small_model(), dl, loss_func=F.mse_loss, opt_func=torch.optim.SGD, lr=0.05, default_hooks=False)
    mine.fit(1)
    assert calls == ['backward', 'step', 'zero'] * 6
    ref = Trainer(small_model(), dl, loss_func=F.mse_loss, opt_func=torch.optim.SGD, lr=0.1, default_hooks=False)
    ref.fit(1)   # SGD: twice the gradient at lr 0.05 is the gradient at lr 0.1
    assert torch.allclose(flat(mine.model), flat(ref.model), atol=1e-6)


def test_optimizer_step_override_that_skips_steps():
    from trainer_nb.core import Trainer
    class EveryOther(Trainer):
        def optimizer_step(self):
            if self.state.iteration % 2 == 0: super().optimizer_step()
    t = EveryOther(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss,
                   opt_func=torch.optim.SGD, lr=0.1, default_hooks=False)
    t.fit(1)
    ref = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss,
                  opt_func=torch.optim.SGD, lr=0.1, default_hooks=False)
    ref.fit(1)
    assert not torch.equal(flat(t.model), flat(ref.model))


def test_after_backward_runs_at_each_manual_backward():
    from trainer_nb.core import Hook, Trainer
    class Count(Hook):
        n = 0
        def after_backward(self): Count.n += 1
    t = Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), train_step=sam_step, manual=True,
                hooks=[Count()], default_hooks=False)
    t.fit(1)
    assert Count.n == 12   # two backward passes in each of 6 steps


def run(cfg, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, json.dumps(cfg)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


@pytest.mark.usefixtures('on_the_cpu')
def test_gan_sigkill_then_resume_is_bitwise_exact(tmp_path):
    "Both optimizers' states, both schedulers and the weights after a kill and a resume equal an uninterrupted run's."
    from trainer_nb.checkpoint import list_checkpoints
    ref = str(tmp_path / 'ref')
    p = run({'dir': str(tmp_path / 'refrun'), 'out': ref, 'epochs': 3, 'ckpt': False})
    assert p.returncode == 0, p.stderr
    d, out = tmp_path / 'run', str(tmp_path / 'out')
    p = run({'dir': str(d), 'out': out, 'epochs': 3, 'kill_at': 14})
    assert p.returncode == -signal.SIGKILL, p.stderr
    last = list_checkpoints(d)[-1]
    st = json.loads((last / 'trainer_state.json').read_text())
    assert st['state']['iteration'] == 12 and st['position'] == [1, 4]   # mid-epoch: 8 batches per epoch
    assert set(st['schedulers']) == {'gen', 'disc'}
    assert (last / 'optimizer.bin').is_file() and (last / 'optimizer_1.bin').is_file()
    p = run({'dir': str(d), 'out': out, 'epochs': 3, 'resume': 'last'})
    assert p.returncode == 0, p.stderr
    wa, wb = load_file(ref + '.safetensors'), load_file(out + '.safetensors')
    assert wa.keys() == wb.keys() and any(k.startswith('disc.') for k in wa) and any(k.startswith('gen.') for k in wa)
    for k in wa: assert torch.equal(wa[k], wb[k]), k
    ra, rb = json.load(open(ref + '.json')), json.load(open(out + '.json'))
    assert rb['batches_run'] == 24 - 12
    for k in ('state', 'losses', 'schedulers', 'lrs', 'logged', 'epoch_results'): assert ra[k] == rb[k], k
    assert len(rb['logged']['d_loss']) == 24 and set(rb['epoch_results']) == {'epoch', 'train_loss', 'd_loss', 'g_loss'}
    assert ra['schedulers'] == {'gen': 24, 'disc': 24}


def test_manual_mode_refusals():
    from trainer_nb.core import Trainer
    dl = DataLoader(gan_data(), batch_size=8)
    with pytest.raises(ValueError, match='Several optimizers need manual=True'):
        Trainer(gan_model(), dl, train_step=gan_step, optimizers=gan_optimizers(), default_hooks=False)
    with pytest.raises(ValueError, match='manual=True needs a train_step'):
        Trainer(small_model(), dl, loss_func=F.mse_loss, manual=True, default_hooks=False)
    with pytest.raises(TypeError, match=r"optimizers\['gen'\] must be a torch.optim.Optimizer"):
        Trainer(gan_model(), dl, train_step=gan_step, manual=True, optimizers={'gen': lambda m: 3}, default_hooks=False)
    t = Trainer(gan_model(), dl, train_step=gan_step, manual=True, optimizers=gan_optimizers(), default_hooks=False)
    with pytest.raises(KeyError, match="'dis' is not one of this trainer's optimizers"): t.zero_grad('dis')
    with pytest.raises(ValueError, match='manual=True.*lr_find'): t.lr_find(show=False)
    with pytest.raises(ValueError, match='pass eval_step='): t.evaluate(dl)
    with pytest.raises(ValueError, match="nan_policy='skip' can't be used with manual=True"):
        Trainer(gan_model(), dl, train_step=gan_step, manual=True, optimizers=gan_optimizers(), nan_policy='skip',
                default_hooks=False).fit(1)
    with pytest.raises(ValueError, match=r"scheduler= names \['critic'\]"):
        Trainer(gan_model(), dl, train_step=gan_step, manual=True, optimizers=gan_optimizers(),
                scheduler={'critic': lambda o, n: None}, default_hooks=False).fit(1)
