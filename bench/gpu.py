"""Speed on a GPU: trainer_nb beside a raw PyTorch loop, Hugging Face's Trainer and Lightning, on four workloads.

Run: `.venv/bin/python bench/gpu.py [--tiny] [--budget 420] [--reps 5] [--only lm,mlp] [--contenders raw,bare,hf]
[--out bench/results]`. Meant for one NVIDIA H200; it runs on CUDA when there is one, else on the CPU. `--tiny` shrinks
every workload, and its runs (16 steps at most for the LM, 12 for the CNN, 200 for the MLP), so that the whole run
takes a minute or two on a CPU. The table goes to `--out` as JSON and Markdown (`gpu-YYYYMMDD-HHMM[-tiny].json/.md`,
with the machine, the versions and the date) and is printed.

Workloads (random weights built from configs, synthetic data: nothing is downloaded):
- `lm`: a causal LM of GPT-2 124M's shape (transformers' GPT2LMHeadModel built from a GPT2Config: 12 layers, 768
  wide, 12 heads, sequences of 1024 tokens, no dropout), in bf16 autocast; tokens/s and peak memory.
- `cnn`: a ResNet-18-like CNN (written here) on synthetic 224 px uint8 images, cropped and flipped in the workers of
  a DataLoader (pinned memory on CUDA), in bf16 autocast; images/s.
- `mlp`: a small MLP whose steps are short (bound by launching kernels on a GPU, by Python on a CPU), in float32;
  steps/s.
- `lm_compile`: `lm` with the model under torch.compile, each contender asking for it its own way. On the CPU with
  `--tiny` it is skipped unless `--only` names it (compiling takes 10-60 s a contender there).

Contenders, each with AdamW (fused on CUDA, weight decay 0.01), a constant LR and no gradient clipping, from the
same weights and the same batches:
- `raw`: the hand-written loop every other is measured against (pinned memory, non_blocking copies, no `.item()`
  in the loop, `zero_grad(set_to_none=True)`).
- `trainer_nb bare`: `Trainer(..., default_hooks=False)` and `fit(1)`.
- `trainer_nb defaults`: the default hooks as a notebook has them (Recorder, Progress and LivePlot as widgets, with
  no frontend to show them, and RunRecorder); the picture LivePlot draws after the fit is waited for outside the
  timing.
- `trainer_nb background`: bare, through `fit(1, background=True)` then `wait()`.
- `hf`: transformers.Trainer with minimal TrainingArguments (no evaluation, saving or logging, report_to=[]); the
  CNN and the MLP wrapped so that they return their loss.
- `lightning`: lightning.Trainer on a LightningModule (no logger, checkpointing, progress bar or model summary); a
  new Trainer for each run (made outside the timing), the module and its optimizer kept.
- `fastai`: no runner here; reported as skipped.
A contender whose package is missing, or that fails, is reported (skipped or failed, with the reason): the run goes
on without it.

Timing: each contender is built once per workload and warmed up (a first run: compilation, the kernels' tuning, the
optimizer's state; then a timed run that sizes the rest). Then the repetitions: in each, every contender trains the
same number of steps, one whole call of its own (`fit`, `train`, the raw loop) over a fresh DataLoader of that many
batches (the start of its workers counts, for every contender), contenders interleaved, the order rotated at each
repetition. A contender's ratio is its throughput over the raw loop's in the same repetition: the table gives the
median and the range (min-max) over the repetitions, and how many each cell got. `--budget` seconds bound the whole
run (counted once torch is imported): each workload gets a share of what is left; before each repetition the steps of
a run are sized, from the warm-up's sizing runs and then from the last repetition, for the repetitions left to fit;
they stop when the next would not fit, and one that runs past the deadline stops before its next contender (the
first always runs whole, so that every cell has a ratio). Peak memory: over the contender's build and warm-up, above
what was allocated before it (CUDA's allocated bytes; on the CPU the process's resident memory, sampled).
"""
import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import io
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

T0 = time.monotonic()   # the budget counts from here
REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ('lm', 'cnn', 'mlp', 'lm_compile')
SHARE = {'lm': 1.0, 'cnn': 1.0, 'mlp': 0.6, 'lm_compile': 2.4}   # each workload's weight in the budget (compiling)
CONTENDERS = ('raw', 'trainer_nb bare', 'trainer_nb defaults', 'trainer_nb background', 'hf', 'lightning', 'fastai')
ALIASES = {'bare': 'trainer_nb bare', 'defaults': 'trainer_nb defaults', 'background': 'trainer_nb background',
           'transformers': 'hf'}
NEEDS = {'trainer_nb bare': 'trainer_nb', 'trainer_nb defaults': 'trainer_nb', 'trainer_nb background': 'trainer_nb',
         'hf': 'transformers', 'lightning': 'lightning', 'fastai': 'fastai'}
WHY_MISSING = {'fastai': 'its torchvision fails beside the pinned torch'}
RESERVE = 3.   # seconds kept at the end of the budget to write the results
QUIET_LOGGERS = ('lightning', 'lightning.pytorch', 'lightning.fabric', 'pytorch_lightning', 'accelerate',
                 'transformers')


# ---- data ----

class Batches(Dataset):
    "`n` items, each a whole batch taken in turn from `bank` (for a DataLoader with batch_size=None: no collation)."
    def __init__(self, bank: list, n: int): self.bank, self.n = bank, n
    def __len__(self): return self.n
    def __getitem__(self, i): return self.bank[i % len(self.bank)]


class Images(Dataset):
    """`n` uint8 images of `size` px with their labels: crops of a bank of random pictures, one in two flipped (the
    work a DataLoader's workers do)."""
    def __init__(self, bank: torch.Tensor, labels: torch.Tensor, size: int, n: int):
        self.bank, self.labels, self.size, self.n = bank, labels, size, n

    def __len__(self): return self.n

    def __getitem__(self, i):
        k, room = i % len(self.bank), self.bank.shape[-1] - self.size
        top, left = (i * 7) % (room + 1), (i * 13) % (room + 1)
        img = self.bank[k, :, top:top + self.size, left:left + self.size]
        return (img.flip(-1) if i % 2 else img).contiguous(), self.labels[k]


def first_item(items: list) -> dict:
    "Hugging Face's DataLoader (batches of one item of `Batches`): the batch itself, as the dict its Trainer wants."
    b = items[0]
    return b if isinstance(b, dict) else {'inputs': b[0], 'labels': b[1]}


def image_dicts(items: list) -> dict:
    "Hugging Face's DataLoader over `Images`: the batch collated, as a dict."
    x, y = default_collate(items)
    return {'inputs': x, 'labels': y}


# ---- models ----

class Block(nn.Module):
    "A ResNet basic block: two 3x3 convolutions, batch norm, and the shortcut (a 1x1 convolution where shapes change)."
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x): return F.relu(self.body(x) + self.short(x), inplace=True)


class ResNet(nn.Module):
    """ResNet-18's shape (with `widths` (64, 128, 256, 512) and `blocks` (2, 2, 2, 2)) on uint8 images, scaled on the
    device; a small stem (3x3, no pooling) for images under 64 px."""
    def __init__(self, widths, blocks, classes: int, size: int):
        super().__init__()
        w0 = widths[0]
        self.stem = (nn.Sequential(nn.Conv2d(3, w0, 7, 2, 3, bias=False), nn.BatchNorm2d(w0), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(3, 2, 1)) if size >= 64 else
                     nn.Sequential(nn.Conv2d(3, w0, 3, 1, 1, bias=False), nn.BatchNorm2d(w0), nn.ReLU(inplace=True)))
        layers, cin = [], w0
        for i, (w, n) in enumerate(zip(widths, blocks)):
            layers += [Block(cin if j == 0 else w, w, 2 if i and j == 0 else 1) for j in range(n)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = (x.float() / 255 - 0.5) / 0.25
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def mlp(d_in: int, width: int, depth: int, classes: int) -> nn.Module:
    sizes = [d_in] + [width] * depth
    layers = [m for a, b in itertools.pairwise(sizes) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class WithLoss(nn.Module):
    "A classifier that returns its cross-entropy loss with its logits (Hugging Face's Trainer reads the loss off it)."
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, inputs, labels):
        logits = self.net(inputs)
        return {'loss': F.cross_entropy(logits, labels), 'logits': logits}


# ---- workloads ----

class Precision:
    """The dtypes the first linear or convolution layer of a contender's model computes in during its warm-up (the
    hook is then removed): bf16 where the workload asks for autocast, else float32, as in the raw loop."""
    def __init__(self): self.seen, self.hooks = set(), []

    def watch(self, model: nn.Module):
        layer = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
        self.hooks.append(layer.register_forward_hook(lambda m, args, out: self.seen.add(out.dtype)))

    def check(self, w: 'Workload') -> str | None:
        "None where the model computed as the raw loop's does, else what differs."
        for h in self.hooks: h.remove()
        want = torch.bfloat16 if w.bf16 else torch.float32
        if self.seen == {want}: return None
        return f"its model computed in {', '.join(map(str, self.seen)) or 'nothing seen'}, not {want} as the raw loop's"


@dataclasses.dataclass
class Workload:
    name: str
    unit: str                          # what its throughput counts, a second
    per_step: int                      # units a step: tokens or images a batch (1: steps)
    about: str                         # its shape, for the table
    make_model: Callable[[], nn.Module]
    dataset: Callable[[int], Dataset]  # the data of `n` steps
    batch_size: int | None             # None: the dataset's items are whole batches
    workers: int = 0
    bf16: bool = False
    compile: bool = False
    lm: bool = False                   # dict batches, the model computes its own loss; else (x, y), cross entropy
    lr: float = 1e-3
    warm: int = 3                      # steps of the warm-up run, and of the sizing run
    min_steps: int = 5
    max_steps: int = 20_000
    probe: Precision | None = None     # watches the models built during a contender's warm-up


def lm_workload(tiny: bool, compiled: bool = False) -> Workload:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    layers, width, heads, seq, vocab, bs = (2, 64, 2, 64, 1024, 4) if tiny else (12, 768, 12, 1024, 50257, 16)
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads, resid_pdrop=0.,
                     embd_pdrop=0., attn_pdrop=0., use_cache=False, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    g = torch.Generator().manual_seed(0)
    bank = [{'input_ids': ids, 'labels': ids} for ids in torch.randint(0, vocab, (8, bs, seq), generator=g)]
    about = (f"GPT2LMHeadModel from a config: {layers} layers, {width} wide, {heads} heads, vocabulary {vocab}; "
             f"batches of {bs} x {seq} tokens; bf16 autocast" + ("; torch.compile" if compiled else ""))
    def model():
        m = GPT2LMHeadModel(cfg)
        m.loss_type = 'ForCausalLM'   # the loss it picks, named: else each forward warns, a break in a compiled graph
        return m
    return Workload('lm_compile' if compiled else 'lm', 'tokens/s', bs * seq, about, model,
                    functools.partial(Batches, bank), None, bf16=True, compile=compiled, lm=True, lr=3e-4,
                    warm=2 if tiny or compiled else 3, min_steps=4 if tiny else 5, max_steps=16 if tiny else 20_000)


def cnn_workload(tiny: bool) -> Workload:
    size, widths, blocks, classes, bs = ((32, (8, 16, 32, 64), (1, 1, 1, 1), 10, 16) if tiny else
                                         (224, (64, 128, 256, 512), (2, 2, 2, 2), 1000, 256))
    workers = 2 if tiny else max(2, min(8, (os.cpu_count() or 4) // 2))
    g = torch.Generator().manual_seed(0)
    bank = torch.randint(0, 256, (64, 3, size + size // 8, size + size // 8), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (64,), generator=g)
    about = (f"ResNet-like CNN, widths {widths}, blocks {blocks}, {classes} classes; batches of {bs} uint8 images of "
             f"{size} px (crops, flips) from {workers} DataLoader workers; bf16 autocast")
    return Workload('cnn', 'images/s', bs, about, lambda: ResNet(widths, blocks, classes, size),
                    lambda n: Images(bank, labels, size, n * bs), bs, workers=workers, bf16=True, lr=1e-3,
                    warm=2 if tiny else 3, min_steps=4 if tiny else 5, max_steps=12 if tiny else 20_000)


def mlp_workload(tiny: bool) -> Workload:
    d_in, width, depth, classes, bs = (32, 64, 2, 10, 32) if tiny else (256, 512, 3, 10, 128)
    g = torch.Generator().manual_seed(0)
    bank = [(torch.randn(bs, d_in, generator=g), torch.randint(0, classes, (bs,), generator=g)) for _ in range(8)]
    about = f"MLP {d_in}-" + '-'.join([str(width)] * depth) + f"-{classes}; batches of {bs}; float32"
    return Workload('mlp', 'steps/s', 1, about, lambda: mlp(d_in, width, depth, classes),
                    functools.partial(Batches, bank), None, lr=1e-3, warm=10 if tiny else 30,
                    min_steps=20 if tiny else 50, max_steps=200 if tiny else 50_000)


def make_workload(name: str, tiny: bool) -> Workload:
    if name == 'lm': return lm_workload(tiny)
    if name == 'lm_compile': return lm_workload(tiny, compiled=True)
    return cnn_workload(tiny) if name == 'cnn' else mlp_workload(tiny)


# ---- what every contender shares ----

def seeded(w: Workload) -> nn.Module:
    "The workload's model, with the same weights for every contender."
    torch.manual_seed(0)
    model = w.make_model()
    if w.probe is not None: w.probe.watch(model)
    return model


def loader(w: Workload, n: int, dev: torch.device) -> DataLoader:
    "A DataLoader of `n` batches of `w`, as the contenders that take one get it (shuffled; pinned memory on CUDA)."
    return DataLoader(w.dataset(n), batch_size=w.batch_size, shuffle=True, num_workers=w.workers,
                      pin_memory=dev.type == 'cuda', drop_last=w.batch_size is not None)


def step_loss(w: Workload, model, batch) -> torch.Tensor:
    if w.lm: return model(**batch).loss
    x, y = batch
    return F.cross_entropy(model(x), y)


def to_device(batch, dev: torch.device):
    if isinstance(batch, dict): return {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
    return [t.to(dev, non_blocking=True) for t in batch]


def clock(dev: torch.device) -> float:
    "The time, once the device has done what was queued."
    if dev.type == 'cuda': torch.cuda.synchronize(dev)
    return time.perf_counter()


def adamw(dev: torch.device):
    return functools.partial(torch.optim.AdamW, weight_decay=0.01, fused=dev.type == 'cuda')


# ---- the contenders: each `build(w, dev)` returns `run(n) -> seconds` for a run of `n` steps ----

def build_raw(w: Workload, dev: torch.device):
    model = seeded(w).to(dev)
    forward = torch.compile(model) if w.compile else model
    opt = adamw(dev)(model.parameters(), lr=w.lr)

    def run(n):
        dl = loader(w, n, dev)
        t = clock(dev)
        for batch in dl:
            batch = to_device(batch, dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=w.bf16):
                loss = step_loss(w, forward, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return clock(dev) - t
    return run


def notebook_hooks() -> list:
    "The Trainer's default hooks as a notebook has them: the dashboard and the plot as widgets."
    from trainer_nb.liveplot import LivePlot
    from trainer_nb.progress import Progress
    from trainer_nb.recorder import Recorder
    from trainer_nb.runs import RunRecorder
    return [Recorder(), Progress(mode='widget'), LivePlot(mode='widget'), RunRecorder()]


def build_trainer_nb(w: Workload, dev: torch.device, defaults: bool = False, background: bool = False):
    from trainer_nb.core import Trainer
    hooks = notebook_hooks() if defaults else []
    tr = Trainer(seeded(w), loader(w, w.warm, dev), loss_func=None if w.lm else F.cross_entropy, opt_func=adamw(dev),
                 lr=w.lr, mixed_precision='bf16' if w.bf16 else 'no', compile=w.compile, default_hooks=False,
                 hooks=hooks)
    plot = hooks[2] if defaults else None

    def run(n):
        tr.train_dl = loader(w, n, dev)
        t = clock(dev)
        if background:
            tr.fit(1, background=True)
            tr.wait()
        else: tr.fit(1)
        seconds = clock(dev) - t
        if plot is not None: plot.wait()   # the picture left behind, drawn on its own thread: not timed
        return seconds
    return run


def build_hf(w: Workload, dev: torch.device):
    import transformers
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments
    transformers.logging.set_verbosity_error()
    cuda, tmp = dev.type == 'cuda', tempfile.TemporaryDirectory(prefix='bench-gpu-hf-')   # (nothing is saved in it)
    args = TrainingArguments(
        output_dir=tmp.name, per_device_train_batch_size=w.batch_size or 1,
        num_train_epochs=1, learning_rate=w.lr, weight_decay=0.01, lr_scheduler_type='constant', max_grad_norm=0.,
        optim='adamw_torch_fused' if cuda else 'adamw_torch', bf16=w.bf16, torch_compile=w.compile,
        eval_strategy='no', save_strategy='no', logging_strategy='no', report_to=[], disable_tqdm=True,
        dataloader_num_workers=w.workers, dataloader_pin_memory=cuda, dataloader_drop_last=True,
        remove_unused_columns=False, use_cpu=not cuda, seed=0)
    model = seeded(w) if w.lm else WithLoss(seeded(w))
    tr = HFTrainer(model=model, args=args, train_dataset=w.dataset(w.warm),
                   data_collator=first_item if w.batch_size is None else image_dicts)

    def run(n):
        tr.train_dataset = w.dataset(n)   # (the model, its optimizer and Accelerate's wrapping: the first call's)
        t = clock(dev)
        tr.train()
        return clock(dev) - t
    run.tmp = tmp   # (removed with the runner)
    return run


def build_lightning(w: Workload, dev: torch.device):
    import lightning as L
    cuda = dev.type == 'cuda'
    net = seeded(w).to(dev)
    forward = torch.compile(net) if w.compile else net
    opt = adamw(dev)(net.parameters(), lr=w.lr)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, i): return step_loss(w, forward, batch)
        def configure_optimizers(self): return opt

    module = Module()

    def run(n):
        trainer = L.Trainer(accelerator='gpu' if cuda else 'cpu', devices=1, max_epochs=1,
                            precision='bf16-mixed' if w.bf16 else '32-true', logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        dl = loader(w, n, dev)
        t = clock(dev)
        trainer.fit(module, dl)
        return clock(dev) - t
    return run


BUILDERS = {'raw': build_raw, 'trainer_nb bare': build_trainer_nb,
            'trainer_nb defaults': functools.partial(build_trainer_nb, defaults=True),
            'trainer_nb background': functools.partial(build_trainer_nb, background=True),
            'hf': build_hf, 'lightning': build_lightning}


def skip_reason(name: str) -> str | None:
    "Why contender `name` does not run here (None: it does)."
    pkg = NEEDS.get(name)
    if pkg is not None and importlib.util.find_spec(pkg) is None:
        return 'not installed' + (f": {WHY_MISSING[pkg]}" if pkg in WHY_MISSING else f" (pip install {pkg})")
    if name not in BUILDERS: return f"{pkg} is installed, but this benchmark has no runner for it"
    return None


# ---- measuring ----

@contextlib.contextmanager
def quiet():
    "What the contenders print (progress, logs) kept off the terminal."
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class PeakMemory:
    """Peak memory in MiB over the block, above what was allocated when it began: CUDA's allocated bytes, or on the
    CPU the process's resident memory sampled every 5 ms (None without psutil)."""
    def __init__(self, dev: torch.device): self.dev, self.mb = dev, None

    def __enter__(self):
        if self.dev.type == 'cuda':
            torch.cuda.synchronize(self.dev)
            self.base = torch.cuda.memory_allocated(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            return self
        try:
            import psutil
        except ImportError: return self
        proc, self.done = psutil.Process(), threading.Event()
        self.base = self.peak = proc.memory_info().rss
        def sample():
            while not self.done.wait(0.005): self.peak = max(self.peak, proc.memory_info().rss)
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.dev.type == 'cuda':
            torch.cuda.synchronize(self.dev)
            self.mb = (torch.cuda.max_memory_allocated(self.dev) - self.base) / 2**20
        elif hasattr(self, 'thread'):
            self.done.set()
            self.thread.join()
            self.mb = (self.peak - self.base) / 2**20


@dataclasses.dataclass
class Cell:
    "One contender on one workload: its runs' times and ratios, or why it has none."
    workload: str
    contender: str
    status: str = 'ok'      # 'ok', 'skipped' or 'failed'
    reason: str | None = None
    error: str | None = None   # the traceback's end, where it failed
    steps: list = dataclasses.field(default_factory=list)        # each repetition's steps
    seconds: list = dataclasses.field(default_factory=list)      # each repetition's timed run
    throughputs: list = dataclasses.field(default_factory=list)  # units a second
    ratios: list = dataclasses.field(default_factory=list)       # over the raw loop's, the same repetition
    peak_mb: float | None = None
    warmup_s: float | None = None

    def skip(self, reason: str): self.status, self.reason = 'skipped', reason

    def fail(self, e: BaseException, when: str):
        "Failed `when` with `e` (called where it is caught: the traceback is kept)."
        msg = str(e).strip()
        self.status, self.error = 'failed', traceback.format_exc()[-3000:]
        self.reason = f"{when}: {type(e).__name__}" + (f": {msg.splitlines()[0][:300]}" if msg else '')

    def row(self, unit: str) -> dict:
        r = sorted(self.ratios)
        return {'workload': self.workload, 'contender': self.contender, 'status': self.status, 'reason': self.reason,
                'ratio': statistics.median(r) if r else None, 'ratio_min': r[0] if r else None,
                'ratio_max': r[-1] if r else None, 'reps': len(r), 'unit': unit,
                'throughput': statistics.median(self.throughputs) if self.throughputs else None,
                'peak_mem_mb': self.peak_mb, 'warmup_s': self.warmup_s, 'steps': self.steps, 'seconds': self.seconds,
                'throughputs': self.throughputs, 'ratios': self.ratios, 'error': self.error}


def free_memory(dev: torch.device):
    gc.collect()
    if dev.type == 'cuda': torch.cuda.empty_cache()


def fresh_accelerate():
    "Accelerate's process-wide state made anew: a workload's precision may differ from the last one's."
    with contextlib.suppress(ImportError):
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def warm_up(w: Workload, cells: dict, dev: torch.device) -> dict:
    "Build each contender and warm it up: `{name: (run, seconds a step)}` of those that run."
    runs = {}
    for name, cell in cells.items():
        why = skip_reason(name)
        if why is not None:
            cell.skip(why)
            continue
        say(f"{w.name}: warming up {name}")
        t, w.probe = time.monotonic(), None if w.compile else Precision()   # (a hook would change a compiled graph)
        try:
            with PeakMemory(dev) as mem, quiet():
                run = BUILDERS[name](w, dev)
                run(w.warm)   # compilation, the kernels' tuning, the optimizer's state
            with quiet(): per_step = run(w.warm) / w.warm
        except Exception as e:   # noqa: BLE001 (out of memory included) the run goes on without it
            cell.fail(e, 'warm-up')
            free_memory(dev)
            continue
        finally: probe, w.probe = w.probe, None
        cell.peak_mb, cell.warmup_s = mem.mb, round(time.monotonic() - t, 2)
        if probe is not None and (why := probe.check(w)) is not None:
            cell.status, cell.reason = 'failed', why
            continue
        runs[name] = (run, per_step)
    return runs


def steps_for(w: Workload, seconds_a_step: float, left: float, reps: int) -> int:
    "Steps a run, for `reps` repetitions to fit in `left` seconds at `seconds_a_step` for all the contenders."
    return max(w.min_steps, min(w.max_steps, int(max(left, 0) / reps / max(seconds_a_step, 1e-9))))


def repeat(w: Workload, cells: dict, runs: dict, deadline: float, reps: int, dev: torch.device):
    """The repetitions: every contender `n` steps, interleaved, the order rotated. `n` is sized before each one, from
    the last (at first, the warm-up's sizing runs), for the repetitions left to fit; they stop when the next would not
    fit, and a repetition past the deadline stops before its next contender (the first always runs whole)."""
    names = list(runs)
    a_step = sum(s for _, s in runs.values())   # seconds a step, every contender's together
    for r in range(reps):
        left = deadline - time.monotonic()
        n = steps_for(w, a_step, left, reps - r)
        if r and a_step * n > left: break
        say(f"{w.name}: repetition {r + 1}, {n} steps a run")
        t0, secs = time.monotonic(), {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            if r and time.monotonic() > deadline: break
            try:
                with quiet(): secs[name] = runs[name][0](n)
            except Exception as e:   # noqa: BLE001 (as in the warm-up)
                cells[name].fail(e, f"repetition {r + 1}")
                free_memory(dev)
        names = [c for c in names if cells[c].status == 'ok']
        if 'raw' not in secs: break
        for name, s in secs.items():
            record(cells[name], n, s, secs['raw'], w.per_step)
        a_step = (time.monotonic() - t0) / n * len(names) / max(len(secs), 1)


def record(c: Cell, n: int, seconds: float, raw_seconds: float, per_step: int):
    "A run of `n` steps in `seconds`, beside the raw loop's `raw_seconds` in the same repetition."
    c.steps.append(n)
    c.seconds.append(round(seconds, 4))
    c.throughputs.append(n * per_step / seconds)
    c.ratios.append(raw_seconds / seconds)


def run_workload(name: str, names: list, a, dev: torch.device, deadline: float) -> tuple[dict, dict]:
    "`({contender: Cell}, the workload's description)` of workload `name`."
    cells = {c: Cell(name, c) for c in names}
    why = workload_skip(name, a, dev)
    if why is not None:
        for c in cells.values(): c.skip(why)
        return cells, {'name': name, 'status': 'skipped', 'reason': why}
    w = make_workload(name, a.tiny)
    if w.compile: raise_recompile_limit()
    fresh_accelerate()
    t = time.monotonic()
    runs = warm_up(w, cells, dev)
    if 'raw' in runs: repeat(w, cells, runs, deadline, a.reps, dev)
    if cells['raw'].status != 'ok' or not cells['raw'].ratios:
        why = f"no ratio: the raw loop {cells['raw'].reason or 'ran no repetition'}"
        for c in cells.values():
            if c.status == 'ok' and c.contender != 'raw': c.status, c.reason = 'failed', why
    del runs
    free_memory(dev)
    about = {'name': name, 'status': 'ok', 'unit': w.unit, 'per_step': w.per_step, 'about': w.about,
             'seconds': round(time.monotonic() - t, 1), 'steps_a_run': sorted({s for c in cells.values()
                                                                               for s in c.steps})}
    return cells, about


def workload_skip(name: str, a, dev: torch.device) -> str | None:
    if name.startswith('lm') and importlib.util.find_spec('transformers') is None:
        return "transformers is not installed (the LM is its GPT2LMHeadModel)"
    if name == 'lm_compile' and a.tiny and dev.type == 'cpu' and 'lm_compile' not in (a.only or ''):
        return "not run on the CPU with --tiny: compiling takes 10-60 s a contender there (--only lm_compile runs it)"
    return None


def raise_recompile_limit():
    "Every contender compiles its own model: more than torch's default of 8 versions of a frame are kept."
    cfg = torch._dynamo.config
    for k in ('recompile_limit', 'cache_size_limit'):
        if hasattr(cfg, k): setattr(cfg, k, max(getattr(cfg, k), 64))


# ---- the report ----

def say(msg: str):
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", file=sys.__stderr__, flush=True)


def version(pkg: str) -> str | None:
    try: return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError: return None


def machine(dev: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        info = Path('/proc/cpuinfo').read_text().splitlines()
        cpu = next((ln.split(':', 1)[1].strip() for ln in info if ln.startswith('model name')), cpu)
    m = {'cpu': cpu, 'cores': os.cpu_count(), 'platform': platform.platform(), 'device': dev.type, 'gpu': None}
    if dev.type == 'cuda':
        p = torch.cuda.get_device_properties(dev)
        m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return m


def versions() -> dict:
    v = {'python': platform.python_version()}
    v.update({p: version(p) for p in ('torch', 'accelerate', 'transformers', 'lightning', 'trainer_nb', 'fastai')})
    out = subprocess.run(['git', 'describe', '--always', '--dirty'], cwd=REPO, capture_output=True, text=True,
                         check=False)
    v['trainer_nb_commit'] = out.stdout.strip() or None
    return v


def cell_text(row: dict, notes: dict) -> str:
    "A cell of the table: the ratio and its range, the raw loop's throughput, or why there is none (a note's number)."
    if row['status'] != 'ok':
        return f"{row['status']} [{notes.setdefault(row['reason'].replace('|', '/'), len(notes) + 1)}]"
    if row['contender'] == 'raw': return f"1.00x: {row['throughput']:,.0f} {row['unit']} ({row['reps']})"
    return f"{row['ratio']:.2f}x [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}] ({row['reps']})"


def table(rep: dict, cell) -> list[str]:
    "A Markdown table, a contender a row, a workload a column: `cell(row)` in each."
    wls = [w['name'] for w in rep['workloads']]
    rows = {(r['workload'], r['contender']): r for r in rep['rows']}
    return (['| contender | ' + ' | '.join(wls) + ' |', '|---' * (len(wls) + 1) + '|'] +
            ['| ' + ' | '.join([c] + [cell(rows[w, c]) for w in wls]) + ' |' for c in rep['contenders']])


def markdown(rep: dict) -> str:
    m, v, notes = rep['machine'], rep['versions'], {}
    out = [f"# trainer_nb beside a raw PyTorch loop and other trainers{' (--tiny)' if rep['tiny'] else ''}", '',
           (f"{rep['date']}; {m['device']}: {m['gpu'] or 'no GPU'}; CPU: {m['cpu']}, {m['cores']} cores; "
            + ', '.join(f"{k} {x}" for k, x in v.items() if x) + '.'), '',
           (f"Budget {rep['budget_s']:.0f} s, used {rep['elapsed_s']:.0f} s. Each cell: the contender's throughput "
            "over the raw loop's in the same repetition, median [min-max] over the repetitions (their number); the "
            "raw loop's row gives its own throughput (median)."), '']
    out += table(rep, lambda r: cell_text(r, notes))
    out += [''] + [f"[{k}] {reason}" for reason, k in notes.items()]
    mem = lambda r: '-' if r['peak_mem_mb'] is None else f"{r['peak_mem_mb']:,.0f}"
    out += ['', ('Peak memory (MiB, over the build and the warm-up, above what was allocated before; on the CPU the '
                 "resident memory's growth, sampled):"), '', *table(rep, mem)]
    out += ['', 'Workloads:', '']
    for w in rep['workloads']:
        if w['status'] != 'ok': out.append(f"- `{w['name']}`: skipped: {w['reason']}")
        else: out.append(f"- `{w['name']}` ({w['unit']}): {w['about']}; steps a run: "
                         f"{', '.join(map(str, w['steps_a_run'])) or '-'}; {w['seconds']:.0f} s")
    return '\n'.join(out) + '\n'


def write(rep: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    now, tail = datetime.datetime.now(), '-tiny' if rep['tiny'] else ''
    stem = f"gpu-{now:%Y%m%d-%H%M}{tail}"
    if (out_dir / f"{stem}.json").exists(): stem = f"gpu-{now:%Y%m%d-%H%M%S}{tail}"   # (two runs in a minute)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(rep, indent=1) + '\n')
    md.write_text(markdown(rep))
    return js, md


# ---- main ----

def names_of(arg: str | None, known: tuple, aliases: dict | None = None) -> list:
    if not arg: return list(known)
    got = [(aliases or {}).get(s.strip(), s.strip()) for s in arg.split(',') if s.strip()]
    bad = [s for s in got if s not in known]
    if bad: raise SystemExit(f"unknown: {', '.join(bad)} (known: {', '.join(known)})")
    return [k for k in known if k in got]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--tiny', action='store_true', help='every workload shrunk to run in a minute or two on a CPU')
    ap.add_argument('--budget', type=float, default=420., help='seconds the whole run may take (default 420)')
    ap.add_argument('--reps', type=int, default=5, help='repetitions wanted (fewer where the budget is short)')
    ap.add_argument('--only', help=f"workloads, a comma list of {', '.join(WORKLOADS)}")
    ap.add_argument('--contenders', help=f"a comma list of {', '.join(CONTENDERS)} (or bare, defaults, background); "
                    "raw always runs")
    ap.add_argument('--out', type=Path, default=REPO / 'bench' / 'results', help='where the JSON and Markdown go')
    a = ap.parse_args(argv)
    a.workloads = names_of(a.only, WORKLOADS)
    a.names = names_of(('raw,' + a.contenders) if a.contenders else None, CONTENDERS, ALIASES)
    if a.reps < 1: raise SystemExit("--reps must be at least 1")
    return a


def setup(dev: torch.device):
    warnings.filterwarnings('ignore')
    for name in QUIET_LOGGERS: logging.getLogger(name).setLevel(logging.ERROR)
    if dev.type == 'cuda':   # what a hand-tuned loop sets, for every contender alike
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision('high')


def main(argv=None):
    a = parse(argv)
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    setup(dev)
    if dev.type == 'cpu' and not a.tiny: say("no GPU: the real sizes on the CPU are slow (--tiny shrinks them)")
    end = T0 + a.budget - RESERVE
    cells, about = {}, []
    for i, name in enumerate(a.workloads):
        left = sum(SHARE[w] for w in a.workloads[i:])
        deadline = time.monotonic() + max(end - time.monotonic(), 0) * SHARE[name] / left
        got, info = run_workload(name, a.names, a, dev, deadline)
        cells.update({(name, c): cell for c, cell in got.items()})
        about.append(info)
    units = {w['name']: w.get('unit') for w in about}
    rep = {'date': datetime.datetime.now().astimezone().isoformat(timespec='seconds'), 'tiny': a.tiny,
           'budget_s': a.budget, 'elapsed_s': round(time.monotonic() - T0, 1), 'reps_wanted': a.reps,
           'machine': machine(dev), 'versions': versions(), 'contenders': a.names, 'workloads': about,
           'float32_matmul_precision': torch.get_float32_matmul_precision(),
           'rows': [cells[w, c].row(units[w]) for w in a.workloads for c in a.names]}
    js, md = write(rep, a.out)
    print(markdown(rep))
    say(f"written: {js}, {md}")


if __name__ == '__main__':
    main()
