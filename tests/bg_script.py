"""A run for tests/test_background.py, configured by one JSON argument: a fit with a Checkpoint (at each epoch's end
only), its LR changed by `trainer.set` at iteration `change_at` (from the fit's own thread, as a control does), killed
with SIGKILL at iteration `kill_at`, run in the background (`background`) or not, resumed from its run directory
(`resume`). Writes the final weights and the trainer's changes to `out`."""
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.base import Hook
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.monitor import MetricsLog
from trainer_nb.core import Trainer


class Control(Hook):
    def __init__(self, cfg): self.cfg = cfg
    def after_batch(self):
        it, c = self.trainer.state.iteration, self.cfg
        if it == c.get('change_at'): self.trainer.set(lr=c['to'])
        if it == c.get('kill_at'): os.kill(os.getpid(), signal.SIGKILL)


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(96, 6)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(96, 1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    t = Trainer(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), loss_func=F.mse_loss,
                default_hooks=False, hooks=[Checkpoint(cfg['dir'], monitor=None), MetricsLog(cfg['dir'], every_steps=None),
                                            Control(cfg)])
    t.fit_one_cycle(3, 1e-2, resume=cfg.get('resume'), background=cfg.get('background', False))
    if cfg.get('background'): t.wait()
    save_file({f'p{i}': p.detach().contiguous() for i, p in enumerate(t.model.parameters())}, cfg['out'] + '.st')
    with open(cfg['out'] + '.json', 'w') as f: json.dump({'changes': t.changes}, f)


if __name__ == '__main__':
    main()
