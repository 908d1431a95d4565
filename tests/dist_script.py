"""Trains a small regression model under `accelerate launch` (or alone) and saves what each process saw.

A second run trains on an uneven set (`N_UNEVEN` samples: the last batch is padded over the processes) holding one
NaN sample that only process 0 sees, with `nan_policy='skip'`.

Usage: `accelerate launch ... tests/dist_script.py OUT_DIR [PER_PROCESS_BATCH]`. Each process writes
`OUT_DIR/rank{R}.pt`; `tests/test_distributed.py` compares them with a single-process run.
"""
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_nb.core import Hook, MainProcessHook, PrintMetrics, Trainer

N_TRAIN, N_VALID, EPOCHS, LR = 64, 101, 2, 0.1
N_UNEVEN, NAN_ROW = 61, 20   # 61 = 3 x 16 + 13; row 20 is in the third batch of 8, which process 0 gets


def make_data():
    "Deterministic train (64 samples) and validation (101 samples: uneven over 2 processes) sets."
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 1, generator=g)
    xt, xv = torch.randn(N_TRAIN, 4, generator=g), torch.randn(N_VALID, 4, generator=g)
    return TensorDataset(xt, xt @ w + 0.1), TensorDataset(xv, xv @ w + 0.1)


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def mae(preds, targets): return (preds - targets).abs().mean()


class CountEverywhere(Hook):
    def __init__(self): self.calls = 0
    def after_batch(self): self.calls += 1


class CountOnMain(MainProcessHook):
    def __init__(self): self.calls = 0
    def after_batch(self): self.calls += 1


def make_trainer(batch_size, hooks=()):
    train_ds, valid_ds = make_data()
    return Trainer(make_model(), DataLoader(train_ds, batch_size=batch_size, shuffle=False),
                   DataLoader(valid_ds, batch_size=10), loss_func=F.mse_loss, opt_func=torch.optim.SGD, lr=LR,
                   metrics=[mae], hooks=[PrintMetrics(), *hooks], default_hooks=False)


def uneven_run(batch_size: int) -> dict:
    "Train on the first `N_UNEVEN` samples, row `NAN_ROW` made NaN, skipping non-finite losses."
    x, y = make_data()[0].tensors
    x = x[:N_UNEVEN].clone(); x[NAN_ROW] = float('nan')
    t = Trainer(make_model(), DataLoader(TensorDataset(x, y[:N_UNEVEN]), batch_size=batch_size, shuffle=False),
                loss_func=F.mse_loss, opt_func=torch.optim.SGD, lr=LR, nan_policy='skip', default_hooks=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        t.fit(EPOCHS)
    return {'state': t.state.state_dict(),
            'weights': {k: v.detach().cpu() for k, v in t.unwrapped_model.state_dict().items()},
            'skipped': [str(w.message) for w in caught if 'Skipped batch' in str(w.message)],
            'losses': t.losses.values.tolist()}


def named_run(batch_size: int) -> dict:
    "Validation on two named loaders of uneven sizes (101 and 7 samples): each one's results under its name."
    train_ds, valid_ds = make_data()
    few = torch.utils.data.Subset(valid_ds, range(7))
    t = Trainer(make_model(), DataLoader(train_ds, batch_size=batch_size, shuffle=False),
                {'all': DataLoader(valid_ds, batch_size=10), 'few': DataLoader(few, batch_size=3)},
                loss_func=F.mse_loss, opt_func=torch.optim.SGD, lr=LR, metrics=[mae], default_hooks=False)
    t.fit(1)
    return dict(t.epoch_results)


def background_refused(t) -> str:
    "What `fit(background=True)` says on several processes (each would run its own thread: refused)."
    try: t.fit(1, background=True)
    except RuntimeError as e: return str(e)
    return 'not refused'


def main(out_dir: Path, batch_size: int):
    everywhere, on_main = CountEverywhere(), CountOnMain()
    t = make_trainer(batch_size, hooks=[everywhere, on_main])
    t.fit(EPOCHS)
    fit_eval_samples = t.eval_samples
    preds, targets = t.predict(t.valid_dl)
    res = {
        'rank': t.accelerator.process_index, 'num_processes': t.accelerator.num_processes,
        'weights': {k: v.detach().cpu() for k, v in t.unwrapped_model.state_dict().items()},
        'state': t.state.state_dict(), 'fit_eval_samples': fit_eval_samples,
        'valid_results': t.valid_results, 'epoch_results': t.epoch_results,
        'preds_rows': len(preds), 'targets_rows': len(targets),
        'preds': preds, 'targets': targets,
        'calls_everywhere': everywhere.calls, 'calls_on_main': on_main.calls,
        'describe': t.describe_hooks().to_dict(),
        'uneven': uneven_run(batch_size),
        'named': named_run(batch_size),
        'background': background_refused(t),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(res, out_dir / f"rank{res['rank']}.pt")
    t.accelerator.wait_for_everyone()


if __name__ == '__main__':
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8)
