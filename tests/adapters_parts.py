"""A tiny GPT-2 with LoRA (random weights from a config, nothing downloaded), counting data, and a run for the resume
tests of `tests/test_adapters.py` (configured by one JSON argument when run as a script).

Script keys: dir (run directory), out (final weights and a JSON report), epochs, accum, every_steps, ckpt (add a
Checkpoint hook saving the trainable weights), resume (None | 'last'), kill_at (SIGKILL itself before iteration N).
"""
import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader


def tiny_gpt2(seed=0, dropout=0.1):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=42, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                      eos_token_id=1, pad_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout))


def lora(model, **kw):
    from peft import LoraConfig, get_peft_model
    kw.setdefault('lora_dropout', 0.1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=['c_attn'], **kw))


def counting(n, seed, ragged=False):
    "`n` sequences of 16 tokens, each one more than the one before (mod 40); `ragged`: padded ends (-100 labels)."
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, 40, (n, 1), generator=g) + torch.arange(16)) % 40 + 2
    out = []
    for x in ids:
        y = x.clone()
        if ragged: y[int(torch.randint(4, 17, (), generator=g)):] = -100
        out.append({'input_ids': x, 'labels': y})
    return out


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    from trainer_nb.base import Hook
    from trainer_nb.checkpoint import Checkpoint
    from trainer_nb.core import Trainer
    from trainer_nb.recorder import Recorder

    class Kill(Hook):
        def __init__(self): self.batches_run = 0
        def before_batch(self):
            self.batches_run += 1
            if self.trainer.state.iteration == cfg.get('kill_at'): os.kill(os.getpid(), signal.SIGKILL)

    kill = Kill()
    hooks = [Recorder(), kill]
    if cfg.get('ckpt', True):
        hooks.append(Checkpoint(cfg['dir'], every_steps=cfg.get('every_steps', 2), keep_last=2, monitor=None,
                                weights='trainable'))
    torch.manual_seed(1)
    t = Trainer(lora(tiny_gpt2()), DataLoader(counting(96, 0, ragged=True), batch_size=8, shuffle=True),
                DataLoader(counting(16, 1), batch_size=16), grad_accum=cfg.get('accum', 1), cpu=True,
                default_hooks=False, hooks=hooks)
    t.fit_one_cycle(cfg['epochs'], 1e-2, resume=cfg.get('resume'))
    from safetensors.torch import save_file
    save_file({k: v.clone() for k, v in t.unwrapped_model.state_dict().items()}, cfg['out'] + '.safetensors')
    rec = t.get_hook(Recorder)
    with open(cfg['out'] + '.json', 'w') as f:
        json.dump({'batches_run': kill.batches_run, 'state': t.state.state_dict(),
                   'history': rec.history.drop(columns='time').to_dict('list')}, f)
    print('DONE', kill.batches_run, flush=True)


if __name__ == '__main__':
    main()
