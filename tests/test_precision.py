"""Mixed precision per trainer, not per kernel: float32, bf16, an fp16-on-CPU refusal and float32 again, made one after
another in one process, each trains (and evaluates) in its own precision, the earlier ones too."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def make(mixed_precision):
    "A trainer, and what it saw: the first layer's output dtypes, whether autocast was on in the evaluation loss."
    from trainer_nb.core import Hook, Trainer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    seen = {'dtypes': set(), 'autocast': set(), 'state': set()}
    model[0].register_forward_hook(lambda m, i, o: seen['dtypes'].add(o.dtype))
    def loss(p, y):
        if not model.training: seen['autocast'].add(torch.is_autocast_enabled('cpu'))   # (evaluating)
        return F.mse_loss(p.float(), y)
    class State(Hook):
        def before_fit(self): seen['state'].add(self.trainer.accelerator.mixed_precision)
    t = Trainer(model, DataLoader(TensorDataset(x, y), batch_size=16), DataLoader(TensorDataset(x, y), batch_size=32),
                loss_func=loss, lr=1e-2, cpu=True, mixed_precision=mixed_precision, default_hooks=False,
                hooks=[State()])
    return t, seen


def fit(t, seen):
    for v in seen.values(): v.clear()
    before = t.evaluate()['valid_loss']
    t.fit(2)
    assert t.valid_results['valid_loss'] < before and t.state.step % 8 == 0
    return seen['dtypes'], seen['autocast'], seen['state']


def test_each_trainer_trains_in_its_own_precision():
    from accelerate.state import AcceleratorState
    f32, s32 = make('no')
    assert fit(f32, s32) == ({torch.float32}, {False}, {'no'})
    bf16, sbf = make('bf16')   # (Accelerate alone: "AcceleratorState has already been initialized...")
    assert fit(bf16, sbf) == ({torch.bfloat16}, {True}, {'bf16'})
    with pytest.raises(ValueError, match="mixed_precision='fp16' needs a GPU.*pass mixed_precision='bf16'"):
        make('fp16')
    assert AcceleratorState().mixed_precision == 'bf16'   # the refusal left the state as it was
    again, sag = make('no')
    assert fit(again, sag) == ({torch.float32}, {False}, {'no'})
    assert fit(bf16, sbf) == ({torch.bfloat16}, {True}, {'bf16'})   # the earlier trainers keep their own
    assert fit(f32, s32) == ({torch.float32}, {False}, {'no'})
    assert bf16.mixed_precision == 'bf16' and f32.mixed_precision == again.mixed_precision == 'no'


def test_a_trainer_after_a_cpu_one_gets_the_default_device():
    """Accelerate keeps the device of the first state in the process: a trainer made after a `cpu=True` one would stay
    on the CPU where there is a GPU. The state is made anew for it (the default device), and the `cpu=True` trainer
    keeps its own (tests/test_gpu.py checks both on a GPU)."""
    from accelerate.state import PartialState
    from trainer_nb.core import Trainer
    cpu_one, seen = make('no')
    assert PartialState()._cpu
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    other = Trainer(torch.nn.Linear(8, 1), [(x, x[:, :1])], loss_func=F.mse_loss, default_hooks=False)
    assert not PartialState()._cpu   # made for the default device: a GPU where there is one
    default = 'cuda' if torch.cuda.is_available() else 'cpu'
    assert other.device.type == default and cpu_one.device.type == 'cpu'
    assert fit(cpu_one, seen) == ({torch.float32}, {False}, {'no'})
    assert all(p.device.type == 'cpu' for p in cpu_one.model.parameters())
    before = other.evaluate([(x, x[:, :1])])['valid_loss']
    other.fit(3)
    assert other.evaluate([(x, x[:, :1])])['valid_loss'] < before and other.device.type == default
