"""Adapters (peft LoRA on a tiny GPT-2 from a config): only the adapters train (fit_one_cycle, lr_find), summary's
counts, gradient checkpointing (the fix applied, or an error before any weight changes), merging in one call,
checkpoints of the adapters alone (their size on disk) that resume bitwise after a SIGKILL."""
import json
import signal
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from torch.utils.checkpoint import checkpoint

from conftest import REPO

pytest.importorskip('peft')
pytestmark = pytest.mark.usefixtures('fresh_accelerate')
from adapters_parts import counting, lora, tiny_gpt2   # noqa: E402

SCRIPT = str(REPO / 'tests' / 'adapters_parts.py')


def weights(model, trainable: bool) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad == trainable}


def trainer(model, **kw):
    from trainer_nb.core import Trainer
    from trainer_nb.recorder import Recorder
    kw.setdefault('default_hooks', False)
    kw['hooks'] = [Recorder(), *kw.get('hooks', ())]
    return Trainer(model, DataLoader(counting(64, 0), batch_size=16, shuffle=True),
                   kw.pop('valid_dl', DataLoader(counting(32, 1), batch_size=32)), cpu=True, **kw)


def test_only_the_adapters_train_with_lr_find_and_fit_one_cycle():
    from trainer_nb.adapters import Adapters
    model = lora(tiny_gpt2(dropout=0.), lora_dropout=0.)
    t = trainer(model)
    assert [h.name for h in t.hooks] == ['Adapters', 'Recorder']   # added for a model with adapters
    s = t.summary()
    assert (s.totals['params'], s.totals['trainable']) == (28864, 1024)   # 2 layers x (A 4x32 + B 96x4)
    assert '28,864 (1,024 trainable: 3.55%, 27,840 frozen)' in repr(s)
    assert set(s.rows[s.rows.trainable > 0].type) == {'Linear'} and s.rows.trainable.sum() == 1024
    base, adapters = weights(model, False), weights(model, True)
    t.lr_find(num_it=20, show=False)
    assert all(torch.equal(p, adapters[n]) for n, p in weights(model, True).items())   # lr_find put them back
    t.fit_one_cycle(2, 3e-2)
    assert all(torch.equal(p, base[n]) for n, p in weights(model, False).items())      # the base: bitwise the same
    assert all(not torch.equal(p, adapters[n]) for n, p in weights(model, True).items())  # every adapter moved
    assert t.history.valid_loss.iloc[-1] < t.history.valid_loss.iloc[0]


def reentrant_gpt2():
    "LoRA on a GPT-2 checkpointed with use_reentrant=True, its embeddings' output not made to require grad."
    m = lora(tiny_gpt2(dropout=0.), lora_dropout=0.)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})
    m.base_model.model.disable_input_require_grads()   # (as transformers < 4.35, or a model not of input_ids)
    return m


def test_reentrant_checkpointing_without_the_fix_trains_nothing():
    "The case is real: without the Adapters hook the loss requires no grad (the head is frozen too)."
    from trainer_nb.adapters import Adapters
    m = reentrant_gpt2()
    t = trainer(m).remove_hooks(Adapters)
    with pytest.raises(RuntimeError, match='does not require grad'), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        t.fit(1, max_steps=1)


@pytest.mark.parametrize('reentrant', [True, False])
def test_checkpointing_with_adapters_trains_from_the_first_step(reentrant):
    m = reentrant_gpt2() if reentrant else lora(tiny_gpt2(dropout=0.), lora_dropout=0.)
    if not reentrant: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    base, adapters = weights(m, False), weights(m, True)
    t = trainer(m)
    t.fit(1, max_steps=1)
    moved = {n for n, p in weights(m, True).items() if not torch.equal(p, adapters[n])}
    assert {n for n in adapters if 'lora_B' in n} <= moved   # (B starts at zero: A's gradient is zero at step 1)
    assert all(torch.equal(p, base[n]) for n, p in weights(m, False).items())
    t.fit(1, max_steps=1)
    assert all(not torch.equal(p, adapters[n]) for n, p in weights(m, True).items())   # A too, from step 2
    emb = m.get_input_embeddings()
    assert not emb._forward_hooks or not reentrant or len(emb._forward_hooks) == 0   # the fix undone after the fit


def test_lr_find_and_find_batch_size_keep_the_fix():
    "Their short fits run without the trainer's hooks, but for those the model needs to train (`in_sweeps`)."
    m = reentrant_gpt2()
    t = trainer(m)
    adapters = weights(m, True)
    res = t.lr_find(num_it=20, show=False)
    assert all(v > 0 for v in res.suggestions.values()) and len(res.lrs) > 10
    assert t.find_batch_size(start=32) == 32
    assert all(torch.equal(p, adapters[n]) for n, p in weights(m, True).items())   # both put everything back


class Blocks(torch.nn.Module):
    "A model of one's own that checkpoints its blocks with use_reentrant=True (no get_input_embeddings)."
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(42, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
                                          for _ in range(2))
        self.head = torch.nn.Linear(32, 42)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for b in self.blocks: h = checkpoint(b, h, use_reentrant=True)
        logits = self.head(h)
        return {'loss': F.cross_entropy(logits.flatten(0, 1), labels.flatten()), 'logits': logits}


@pytest.mark.parametrize('head_trains', [True, False])
def test_adapters_without_gradient_stop_before_any_weight_changes(head_trains):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    m = get_peft_model(Blocks(), LoraConfig(r=4, target_modules=['blocks.0.0', 'blocks.1.0'],
                                            modules_to_save=['head'] if head_trains else None))
    before = {n: p.detach().clone() for n, p in m.state_dict().items()}
    t = trainer(m, valid_dl=None)
    what = ('4 of the 6 trainable weights got no gradient in the first step' if head_trains
            else 'The loss does not require grad')
    with pytest.raises(RuntimeError, match=what) as e, warnings.catch_warnings():
        warnings.simplefilter('ignore')
        t.fit(1)
    assert "use_reentrant=False" in str(e.value) and 'enable_input_require_grads' in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert t.state.step == 0


def test_merge_in_one_call():
    from transformers import GPT2LMHeadModel
    m = lora(tiny_gpt2(dropout=0.), lora_dropout=0.)
    t = trainer(m)
    t.fit(1)
    x = counting(8, 3)[0]['input_ids'][None]
    m.eval()
    with torch.no_grad(): want = m(input_ids=x).logits
    merged = t.merge_adapters()
    assert type(merged) is GPT2LMHeadModel and sum(p.numel() for p in merged.parameters()) == 27840
    assert not any('lora' in n for n in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, want, atol=1e-5)
        assert torch.allclose(t.predict(DataLoader(counting(8, 3), batch_size=8))[0][:1], want, atol=1e-5)


def dir_bytes(p) -> int: return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def test_checkpoint_of_the_adapters_alone(tmp_path):
    "Its model file holds exactly the trainable weights; sizes measured against a whole checkpoint."
    from trainer_nb.checkpoint import Checkpoint, load_weights
    sizes, ckpts = {}, {}
    for w in ('all', 'trainable'):
        m = lora(tiny_gpt2())
        t = trainer(m, hooks=[Checkpoint(tmp_path / w, every_steps=2, monitor=None, weights=w)])
        t.fit(1, max_steps=2)
        ck = ckpts[w] = t.get_hook(Checkpoint).last
        sizes[w] = ((ck / 'model.safetensors').stat().st_size, dir_bytes(ck))
    saved = load_file(ckpts['trainable'] / 'model.safetensors')
    assert set(saved) == {n for n, p in m.named_parameters() if p.requires_grad}
    assert all(torch.equal(saved[n], p) for n, p in m.named_parameters() if n in saved)
    assert sizes['trainable'][0] < 0.05 * sizes['all'][0]   # 4,640 bytes against 119,088 here
    assert sizes['trainable'][1] < 0.5 * sizes['all'][1]    # the whole directory (optimizer, JSON...) too
    # load_weights: the adapters into a model built the same way; its frozen weights left as they are
    fresh = lora(tiny_gpt2())
    res = load_weights(fresh, ckpts['trainable'])
    assert not res.missing_keys and not res.unexpected_keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), m.parameters()))
    # a model whose base trains now: the checkpoint lacks those weights, and says so
    other = lora(tiny_gpt2())
    other.base_model.model.lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match='missing keys.*lm_head.*trainable now'): load_weights(other, ckpts['trainable'])


def run(cfg, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, json.dumps(cfg)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('accum,kill_at', [(1, 17), (2, 11)])
def test_sigkill_then_resume_from_the_adapters_alone_is_bitwise_exact(tmp_path, accum, kill_at):
    "Dropout in the base and in LoRA, shuffled data, fit_one_cycle, ragged labels: the same weights and losses."
    from trainer_nb.checkpoint import list_checkpoints
    cfg = {'epochs': 2, 'accum': accum}
    ref = tmp_path / 'ref'
    p = run({**cfg, 'dir': str(tmp_path / 'ref_run'), 'out': str(ref), 'ckpt': False})
    assert p.returncode == 0, p.stderr
    d, out = tmp_path / 'run', tmp_path / 'out'
    p = run({**cfg, 'dir': str(d), 'out': str(out), 'kill_at': kill_at})
    assert p.returncode == -signal.SIGKILL, p.stderr
    last = list_checkpoints(d)[-1]
    st = json.loads((last / 'trainer_state.json').read_text())
    assert st['weights'] == 'trainable' and 0 < st['state']['iteration'] <= kill_at and st['position'][1] > 0
    p = run({**cfg, 'dir': str(d), 'out': str(out), 'resume': 'last'})
    assert p.returncode == 0, p.stderr
    rb = json.loads(out.with_suffix('.json').read_text())
    assert rb['batches_run'] == 24 - st['state']['iteration']   # it continued from the checkpoint
    wa, wb = load_file(f'{ref}.safetensors'), load_file(f'{out}.safetensors')
    assert wa.keys() == wb.keys()
    for k in wa: assert torch.equal(wa[k], wb[k]), k
    ra = json.loads(ref.with_suffix('.json').read_text())
    assert ra['state'] == rb['state'] and ra['history'] == rb['history']
    assert not torch.equal(wa['base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight'],
                           torch.zeros_like(wa['base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight']))
