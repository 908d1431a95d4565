"""A GAN trained by hand (two optimizers, a one-cycle schedule each) for the kill test of `tests/test_manual.py`,
configured by one JSON argument. Keys: dir (run directory), out (final weights and optimizer states, a JSON report),
epochs, ckpt (add a Checkpoint hook), resume (None | 'last'), kill_at (SIGKILL itself before training iteration N)."""
import json
import sys

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from ckpt_script import Control
from manual_parts import gan_data, gan_model, gan_optimizers, gan_step
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.core import Trainer
from trainer_nb.schedule import one_cycle


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ctl = Control(cfg)
    hooks = [ctl] + ([Checkpoint(cfg['dir'], every_steps=3, keep_last=2)] if cfg.get('ckpt', True) else [])
    t = Trainer(gan_model(), DataLoader(gan_data(), batch_size=8, shuffle=True), train_step=gan_step, manual=True,
                optimizers=gan_optimizers(), scheduler=one_cycle(), hooks=hooks, default_hooks=False)
    t.fit(cfg['epochs'], resume=cfg.get('resume'))
    tensors = {f'model.{k}': v.contiguous() for k, v in t.unwrapped_model.state_dict().items()}
    for name, o in t.optimizers.items():
        for i, st in o.state_dict()['state'].items():
            tensors.update({f'{name}.{i}.{k}': v.reshape(-1).contiguous() for k, v in st.items()})
    save_file(tensors, cfg['out'] + '.safetensors')
    report = {'state': t.state.state_dict(), 'batches_run': ctl.batches_run, 'losses': t.losses.values.tolist(),
              'schedulers': {k: s.state_dict()['last_epoch'] for k, s in t.schedulers.items()},
              'logged': {k: lg.values.tolist() for k, lg in t.logged.items()},
              'epoch_results': {k: v for k, v in t.epoch_results.items() if k != 'time'},
              'lrs': {k: [g['lr'] for g in o.param_groups] for k, o in t.optimizers.items()}}
    with open(cfg['out'] + '.json', 'w') as f: json.dump(report, f)


if __name__ == '__main__':
    main()
