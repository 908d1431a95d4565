"""A resume that cannot restore everything fails, naming the file and why; errors and warnings a user can trust."""
import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from conftest import flat, regression_ds, small_model

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def make(hooks=(), **kw):
    from trainer_nb.core import Trainer
    torch.manual_seed(0)
    kw.setdefault('loss_func', F.mse_loss)
    return Trainer(small_model(), DataLoader(regression_ds(48), batch_size=8, shuffle=True),
                   DataLoader(regression_ds(16, seed=1), batch_size=8), hooks=list(hooks), default_hooks=False, **kw)


@pytest.fixture
def saved(tmp_path):
    "A run directory whose last checkpoint was taken mid-epoch (step 9 of 12)."
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints
    from trainer_nb.base import CancelFit, Hook
    class Stop(Hook):
        order = 100
        def after_batch(self):
            if self.trainer.state.iteration == 9: raise CancelFit()
    make([Checkpoint(tmp_path / 'run', every_steps=9), Stop()]).fit(2)
    last = list_checkpoints(tmp_path / 'run')[-1]
    assert last.name == 'step-00000009'
    return last


FILES = ['model.safetensors', 'optimizer.bin', 'random_states_0.pkl', 'trainer_state.json', 'rng_0.json',
         'losses_0.safetensors']


class Evil:
    def __reduce__(self): return (os.system, ('true',))


def damage(path, how):
    if how == 'deleted': path.unlink()
    elif how == 'truncated': path.write_bytes(path.read_bytes()[:max(1, path.stat().st_size // 2)])
    elif path.suffix in ('.bin', '.pkl'): torch.save({'state': Evil()}, path)   # would run code if unpickled
    else: path.write_bytes(b'\x80\x04' + path.read_bytes()[2:])                 # not what it claims to be


def resume_error(last, reseal: bool) -> str:
    "The error a fresh trainer's `fit(resume=...)` raises; `reseal`: the manifest forged to match the damage."
    from trainer_nb.checkpoint import Checkpoint, seal
    if reseal:
        (last / 'manifest.json').unlink()
        seal(last, True)
    t = make([Checkpoint(last.parent, every_steps=9)])
    before = flat(t.model)
    with pytest.raises((ValueError, FileNotFoundError)) as e: t.fit(2, resume='last')
    assert torch.equal(flat(t.model), before) and t.state.iteration == 0   # nothing was loaded
    assert not (last.parent / 'LOCK').exists()                              # and the lock was let go
    return str(e.value)


@pytest.mark.parametrize('how', ['deleted', 'truncated', 'replaced'])
@pytest.mark.parametrize('name', FILES)
def test_every_file_damaged_stops_the_resume(saved, name, how):
    "With its manifest intact (it catches the damage) and forged to match (the file's own check catches it)."
    damage(saved / name, how)
    msg = resume_error(saved, reseal=False)
    assert name in msg and ('missing' in msg or 'SHA-256' in msg or 'bytes' in msg), msg
    if how == 'deleted': return   # a forged manifest would simply leave the file out: checked below
    msg = resume_error(saved, reseal=True)
    assert name in msg and 'weights_only=False' not in msg, msg
    if how == 'replaced' and name.endswith(('.bin', '.pkl')):
        assert 'not a plain tensor file: refusing to load it; the checkpoint may be damaged or tampered with' in msg


@pytest.mark.parametrize('name', FILES)
def test_a_file_left_out_of_a_forged_manifest_is_missed(saved, name):
    (saved / name).unlink()
    msg = resume_error(saved, reseal=True)
    assert f"{name} is missing" in msg, msg


def test_a_hook_state_that_does_not_load_names_the_file(saved):
    from trainer_nb.checkpoint import Checkpoint, seal
    st = json.loads((saved / 'trainer_state.json').read_text())
    st['hooks']['Checkpoint'] = {'best': 1}   # not what Checkpoint.load_state_dict reads
    (saved / 'trainer_state.json').write_text(json.dumps(st))
    (saved / 'manifest.json').unlink()
    seal(saved, True)
    t = make([Checkpoint(saved.parent, every_steps=9)])
    with pytest.raises(ValueError, match=r'trainer_state.json does not load into this trainer \(KeyError'):
        t.fit(2, resume='last')


def test_resume_by_index_loads_no_skipped_sample(saved):
    "A mid-epoch resume of a map-style dataset reads only the batches it trains (and its result is the same)."
    from trainer_nb.checkpoint import Checkpoint
    class Counting(torch.utils.data.Dataset):
        def __init__(self, ds): self.ds, self.reads = ds, 0
        def __len__(self): return len(self.ds)
        def __getitem__(self, i):
            self.reads += 1
            return self.ds[i]
    runs = {}
    for replay in (False, True):
        t = make([Checkpoint(saved.parent, every_steps=9, replay_batches=replay)])
        ds = Counting(t.train_dl.dataset)
        t.train_dl = DataLoader(ds, batch_size=8, shuffle=True, generator=t.train_dl.generator)
        t.fit(2, resume=saved)   # (the first run saves the epoch's end: 'last' would be past it)
        runs[replay] = (ds.reads, flat(t.model))
    assert runs[False][0] == 3 * 8 and runs[True][0] == 6 * 8   # batches 3..5 of epoch 1; replay reads 0..5
    assert torch.equal(runs[False][1], runs[True][1])


# ---- errors and warnings ----

def test_model_loss_and_metric_errors_say_where():
    from trainer_nb.core import Trainer
    class Fails(nn.Module):
        def __init__(self, at):
            super().__init__()
            self.lin, self.calls, self.at = nn.Linear(5, 1), 0, at
        def forward(self, x):
            self.calls += 1
            if self.calls == self.at: raise RuntimeError('model failed')
            return self.lin(x)
    dl, vdl = DataLoader(regression_ds(48), batch_size=8), DataLoader(regression_ds(16, seed=1), batch_size=8)
    t = Trainer(Fails(at=9), dl, loss_func=F.mse_loss, default_hooks=False)
    with pytest.raises(RuntimeError, match='model failed') as e: t.fit(2)
    assert e.value.__notes__ == ['raised in fit at epoch 2, batch 3 (iteration 8)']
    def loss(p, y):
        if t2.state.iteration == 4: raise ValueError('loss failed')
        return F.mse_loss(p, y)
    t2 = Trainer(small_model(), dl, loss_func=loss, default_hooks=False)
    with pytest.raises(ValueError, match='loss failed') as e: t2.fit(1)
    assert e.value.__notes__ == ['raised in fit at epoch 1, batch 5 (iteration 4)']
    def bad_metric(p, y): raise ZeroDivisionError('metric failed')
    t3 = Trainer(small_model(), dl, vdl, loss_func=F.mse_loss, metrics=[bad_metric], default_hooks=False)
    with pytest.raises(ZeroDivisionError) as e: t3.fit(1)
    assert "raised by metric 'bad_metric'" in e.value.__notes__[0]
    assert e.value.__notes__[-1] == 'raised in fit while validating after epoch 1'


def test_dict_batches_with_model_loss_are_not_warned_about():
    from trainer_nb.core import Trainer
    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 1)
        def forward(self, x, labels): return {'loss': F.mse_loss(self.lin(x), labels), 'logits': self.lin(x)}
    ds = [{'x': x, 'labels': y} for x, y in regression_ds(32)]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        t = Trainer(HF(), DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=8), default_hooks=False)
        t.fit(1)
    assert t.state.step == 4 and t.evaluate()['valid_loss'] > 0


def test_checkpoint_monitor_without_validation_is_said_once(tmp_path):
    from trainer_nb.checkpoint import Checkpoint
    t = make([Checkpoint(tmp_path, monitor='valid_loss')])
    t.valid_dl = None
    with pytest.warns(UserWarning) as rec:
        t.fit(2)
        t.fit(1)
    msgs = [str(w.message) for w in rec if 'monitors' in str(w.message)]
    assert len(msgs) == 1 and 'no valid_dl' in msgs[0], msgs


def test_optimizer_lr_zero_is_refused_when_made():
    from trainer_nb.core import Trainer
    m = small_model()
    with pytest.raises(ValueError, match='lr=0.0 in its first parameter group'):
        Trainer(m, None, opt_func=torch.optim.SGD(m.parameters(), lr=0.0), loss_func=F.mse_loss)
    # a later group at 0 stays at 0 when the LR is set: the groups keep their ratios
    m = small_model()
    opt = torch.optim.SGD([{'params': m[0].parameters(), 'lr': 0.1}, {'params': m[2].parameters(), 'lr': 0.0}])
    t = Trainer(m, DataLoader(regression_ds(16), batch_size=8), opt_func=opt, loss_func=F.mse_loss,
                default_hooks=False)
    t.fit(1, lr=0.2)
    assert [g['lr'] for g in t.opt.param_groups] == [0.2, 0.0]


def test_a_warning_in_a_notebook_is_one_line_of_text_in_the_cell(tmp_path, monkeypatch):
    """In a real kernel, a resume with a changed config leaves in the saved notebook one stderr text that begins
    `TrainerWarning:` and lists the difference: no library file or source line, no notice printed beside it. A
    warning of any other category keeps Python's display."""
    from conftest import REPO
    from test_browser import run_nbclient
    setup = f"""\
import sys, warnings
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import CancelFit, Hook
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.core import Trainer
x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
def make(*hooks):
    return Trainer(torch.nn.Linear(4, 1), dl, loss_func=F.mse_loss, cpu=True, default_hooks=False,
                   hooks=[Checkpoint({str(tmp_path / 'run')!r}, monitor=None), *hooks])
class Crash(Hook):
    def after_batch(self):
        if self.trainer.state.iteration == 8: raise CancelFit('crash')
make(Crash()).fit(2)"""
    nb = run_nbclient(tmp_path, monkeypatch, [setup, "t = make()\nt.fit(2, resume='last')",
                                              "warnings.warn('from elsewhere', UserWarning)"])
    setup_outs, resume_outs, other_outs = (c.get('outputs', []) for c in nb.cells)
    assert setup_outs == []
    config = tmp_path / 'run' / 'config.json'
    assert [(o['output_type'], o.get('name'), o.get('text')) for o in resume_outs] == [('stream', 'stderr', (
        f"TrainerWarning: Resuming with a changed config (step-00000006: 1 difference; {config} now holds the new "
        'one):\n  trainer.hooks: ["Crash", "Checkpoint"] -> ["Checkpoint"]\n'))]
    [other] = other_outs
    assert other['name'] == 'stderr' and ': UserWarning: from elsewhere\n' in other['text']   # file:line: Category:
