"""Loop overhead: steps/s of a hand-written PyTorch loop vs the Trainer, on a tiny MLP on the CPU.

Run: `.venv/bin/python bench/overhead.py [--steps 1500] [--reps 9] [--cpu-time]`. Contenders run interleaved, each
repetition starting at the next contender (so none always runs right after another); each line is
`NAME: S steps/s, R x REF` (best of N; REF: the raw loop fed the same way), then the median and the range of the
N ratios, each taken against the reference's run of the same repetition. Four contenders take pre-collated batches
from a list instead of a DataLoader, so that the loop's own cost per step (printed in microseconds, best of N and
median with its range) stands above the DataLoader's noise; among them the trainer with the default hooks a script
run in a terminal has (Recorder, a text progress bar, LivePlot and RunRecorder drawing nothing), which runs with the
DataLoader too. `--cpu-time` times them by the thread's CPU time instead of the wall clock (on a machine whose cores
other work shares). The run of `--redraw-steps` steps then shows where the notebook defaults' time goes: the
steady-state ratio against a raw loop of the same length, the share spent sending frames and redrawing the dashboard,
and the time of the picture left behind (drawn on its own thread after `fit` returns, as in a notebook: the benchmark
waits for it outside the timing).

Whole fits timed one after another differ by more than the loop's own cost (the best and median above move by 5-10 us
a step from run to run). The paired measurement (`--paired-reps`, `_Paired`) times it batch by batch instead: a raw
step on a copy of the model runs beside each of the contender's batches, just before it or just after it in turn, and
the difference is taken per batch, so that what drifts on the machine is common to both; a raw loop fed the same way
is its control (its own cost, about 0-1 us, is the measurement's zero).

With `--cuda` (needs a CUDA GPU): the same three contenders on the GPU with a larger MLP (batches already on the
device), then two checks of host-device syncs: the training loop with the Recorder runs under
`torch.cuda.set_sync_debug_mode('error')`, where any sync raises, and the notebook defaults run under 'warn', counting
the syncs their redraws make.
"""
import argparse, contextlib, io, statistics, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings('ignore')
clock, clock_ns = time.perf_counter, time.perf_counter_ns   # `--cpu-time`: this thread's CPU time (see `main`)

def make(steps, bs=64):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(steps * bs, 32, generator=g), torch.randint(0, 10, (steps * bs,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, DataLoader(ds, batch_size=bs)

def _raw(model, batches, steps):
    "Steps/s of the hand-written loop over `batches` (a DataLoader or a list)."
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = clock()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return steps / (clock() - t)

def raw_loop(steps): return _raw(*make(steps), steps)

def make_list(steps, bs=64):
    "The same model, and the batches pre-collated in a list: no DataLoader, so the loop's own cost shows."
    model, dl = make(steps, bs)
    return model, list(dl)

def raw_list(steps): return _raw(*make_list(steps), steps)

def trainer_list(steps):
    from trainer_nb.core import Trainer
    model, batches = make_list(steps)
    tr = Trainer(model, batches, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True,
                 default_hooks=False)
    t = clock()
    tr.fit(1)
    return steps / (clock() - t)

def _terminal_fit(model, batches, steps):
    """Steps/s of the trainer with its default hooks, as a script run in a terminal has them (what they print goes to
    a buffer here, so as not to mix with the figures)."""
    from trainer_nb.core import Trainer
    tr = Trainer(model, batches, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        t = clock()
        tr.fit(1)
        return steps / (clock() - t)

def trainer_list_terminal(steps): return _terminal_fit(*make_list(steps), steps)
def trainer_terminal(steps): return _terminal_fit(*make(steps), steps)

def trainer_no_hooks(steps):
    from trainer_nb.core import Trainer
    model, dl = make(steps)
    tr = Trainer(model, dl, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True, default_hooks=False)
    t = clock()
    tr.fit(1)
    return steps / (clock() - t)

def _notebook_trainer(steps):
    "The Trainer with Recorder, Progress and LivePlot, drawing as in a notebook (widgets with no frontend to show them)."
    from trainer_nb.core import Trainer
    from trainer_nb.recorder import Recorder
    from trainer_nb.progress import Progress
    from trainer_nb.liveplot import LivePlot
    model, dl = make(steps)
    hooks = [Recorder(), Progress(mode='widget'), LivePlot(mode='widget')]
    return Trainer(model, dl, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True,
                   default_hooks=False, hooks=hooks), hooks

def trainer_notebook(steps):
    tr, (_, _, plot) = _notebook_trainer(steps)
    t = clock()
    tr.fit(1)
    rate = steps / (clock() - t)
    plot.wait()   # the picture left behind is drawn on a thread of its own once `fit` returned: wait for it here, out
    return rate   # of the timing, so that it does not run beside the next contender


def redraw_share(steps=20_000):
    "Share of a long run's wall time spent redrawing the dashboard and the plot, with the notebook defaults."
    raw = raw_loop(steps)
    tr, (_, prog, plot) = _notebook_trainer(steps)
    t = time.perf_counter()
    tr.fit(1)
    wall = time.perf_counter() - t
    plot.wait()
    print(f"trainer (notebook defaults, {steps} steps): {steps / wall:.0f} steps/s, {steps / wall / raw:.3f} x raw "
          f"({raw:.0f} steps/s, one run each)")
    print(f"redraw share ({steps} steps, notebook defaults): {(prog.draw_time + plot.draw_time) / wall:.2%} of "
          f"{wall:.1f} s wall (plot: {plot.n_draws} frames sent, {plot.draw_time:.3f} s; dashboard: {prog.n_draws} "
          f"redraws, {prog.draw_time:.3f} s); the picture left behind: {plot.picture_time:.3f} s on its own thread, "
          f"after fit returned")

def trainer_list_profiler(steps):
    "The trainer fed from a list, with the Profiler hook (samples/s, step time, data wait, peak memory)."
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Profiler
    model, batches = make_list(steps)
    tr = Trainer(model, batches, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True,
                 default_hooks=False, hooks=[Profiler()])
    t = clock()
    tr.fit(1)
    return steps / (clock() - t)

CONTENDERS = {'raw loop': raw_loop, 'trainer (no hooks)': trainer_no_hooks,
              'trainer (terminal defaults)': trainer_terminal, 'trainer (notebook defaults)': trainer_notebook,
              'raw loop (batches in a list)': raw_list, 'trainer (batches in a list, no hooks)': trainer_list,
              'trainer (batches in a list, terminal defaults)': trainer_list_terminal}
try:
    import trainer_nb.hooks   # (a checkout from before the Profiler runs without this contender)
    CONTENDERS['trainer (batches in a list, Profiler)'] = trainer_list_profiler
except ImportError: pass

# ---- paired, batch by batch ----

class _Paired:
    """Batches from a list, each paired with a raw loop's step on the same batch (a copy of the model, its own
    optimizer), timed: the time from handing a batch out to being asked for the next is the contender's step of that
    batch. The raw step runs just before it at even batches and just after it at odd ones (the second of two steps
    runs faster, on warm caches: alternated, neither side has it). The difference, batch by batch, is the contender's
    own cost with what drifts on the machine (other work, the clock's frequency) shared by both of the pair."""
    def __init__(self, batches, model):
        self.batches, self.model, self.opt = batches, model, torch.optim.SGD(model.parameters(), lr=0.01)
        self.raw, self.other = [], []   # ns per batch: the raw step, the contender's

    def __len__(self): return len(self.batches)

    def _raw_step(self, x, y):
        t = clock_ns()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.raw.append(clock_ns() - t)

    def __iter__(self):
        for i, (x, y) in enumerate(self.batches):
            if not i % 2: self._raw_step(x, y)
            t = clock_ns()
            yield x, y
            self.other.append(clock_ns() - t)
            if i % 2: self._raw_step(x, y)

def _paired_raw(batches, steps):
    "The control: a raw loop fed by `_Paired` (its own cost is the measurement's zero)."
    _raw(make_list(1)[0], batches, steps)   # (the model only: the same weights as `make_list(steps)`'s)

def _paired_trainer(batches, steps, default_hooks):
    from trainer_nb.core import Trainer
    tr = Trainer(make_list(1)[0], batches, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True,
                 default_hooks=default_hooks)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()): tr.fit(1)

PAIRED = {'raw loop (the control)': _paired_raw,
          'trainer (no hooks)': lambda b, n: _paired_trainer(b, n, False),
          'trainer (terminal defaults)': lambda b, n: _paired_trainer(b, n, True)}

def paired(steps, reps):
    """Each contender's own cost per batch over the raw step paired with it (`_Paired`), in `reps` fits of `steps`
    batches from a list, contenders alternated: per fit, the median batch's (a typical batch) and the mean (every
    batch, the periodic work of some included); then the median and range of those over the fits, and the ratio of
    the raw step's mean time to the contender's."""
    runs = {n: [] for n in PAIRED}
    names = list(PAIRED)
    for r in range(reps + 1):   # (the first round warms up, and is left out)
        for n in names[r % len(names):] + names[:r % len(names)]:
            model, batches = make_list(steps)
            b = _Paired(batches, model)
            PAIRED[n](b, steps)
            d = [(o - w) / 1e3 for o, w in zip(b.other[5:], b.raw[5:])]   # (the first batches warm up)
            if r: runs[n].append((statistics.median(d), statistics.mean(d), statistics.mean(b.raw[5:]) / 1e3))
    print(f"paired, batch by batch ({reps} fits of {steps} batches from a list, each batch beside a raw step):")
    span = lambda v: f"{statistics.median(v):.1f} us [{min(v):.1f} to {max(v):.1f}]"
    for n, v in runs.items():
        med, mean, raw = zip(*v)
        ratio = sorted(w / (w + m) for _, m, w in v)
        print(f"  {n}: own cost of the median batch {span(med)}, mean {span(mean)}; {statistics.median(ratio):.3f} x "
              f"raw [{ratio[0]:.3f}-{ratio[-1]:.3f}] (raw step {statistics.median(raw):.1f} us)")

# ---- on a GPU ----

def make_gpu(steps, device='cuda', bs=256, d_in=512, width=2048, n_distinct=16):
    "An MLP of 3 hidden layers of `width`, and `steps` batches already on `device` (`n_distinct` of them, repeated)."
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(bs, d_in, generator=g).to(device), torch.randint(0, 10, (bs,), generator=g).to(device))
          for _ in range(n_distinct)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)).to(device)
    return model, [xs[i % n_distinct] for i in range(steps)]

def _sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize()

def gpu_raw_loop(steps, device='cuda'):
    model, data = make_gpu(steps, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _sync(device); t = time.perf_counter()
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    return steps / (time.perf_counter() - t)

def _gpu_trainer(steps, hooks, device='cuda', **kw):
    from trainer_nb.core import Trainer
    model, data = make_gpu(steps, device)
    return Trainer(model, data, loss_func=F.cross_entropy, opt_func=torch.optim.AdamW, lr=1e-3, default_hooks=False,
                   hooks=hooks, cpu=torch.device(device).type == 'cpu', **kw)

def _timed_fit(tr, device):
    _sync(device); t = time.perf_counter()
    tr.fit(1)
    _sync(device)
    return time.perf_counter() - t

def gpu_trainer_no_hooks(steps, device='cuda'): return steps / _timed_fit(_gpu_trainer(steps, [], device), device)

def _notebook_hooks():
    from trainer_nb.recorder import Recorder
    from trainer_nb.progress import Progress
    from trainer_nb.liveplot import LivePlot
    return [Recorder(), Progress(mode='widget'), LivePlot(mode='widget')]

def gpu_trainer_notebook(steps, device='cuda'):
    return steps / _timed_fit(_gpu_trainer(steps, _notebook_hooks(), device), device)

GPU_CONTENDERS = {'raw loop (cuda)': gpu_raw_loop, 'trainer (cuda, no hooks)': gpu_trainer_no_hooks,
                  'trainer (cuda, notebook defaults)': gpu_trainer_notebook}

def sync_check(steps, device='cuda') -> str:
    """Train `steps` steps with the Recorder, the losses kept on the device for the whole epoch, with torch's sync
    debug mode at 'error' from the second step to the last but one: a host-device sync in any of them raises."""
    from trainer_nb.core import Hook
    from trainer_nb.recorder import Recorder
    class Guard(Hook):
        order = 1000   # after every other hook's after_batch
        def after_batch(self):
            it = self.trainer.state.iteration
            if it == 1: torch.cuda.set_sync_debug_mode('error')
            elif it == steps - 1: torch.cuda.set_sync_debug_mode('default')   # the epoch's end syncs, once
    tr = _gpu_trainer(steps, [Recorder(), Guard()], device, sync_every=10 * steps)
    try: tr.fit(1)
    except RuntimeError as e:
        return f"sync check FAILED: a host-device sync at iteration {tr.state.iteration}: {str(e).splitlines()[0]}"
    finally: torch.cuda.set_sync_debug_mode('default')
    n = len(tr.get_hook(Recorder).steps)
    assert n == steps, n
    return f"sync check: no host-device sync in steps 2..{steps - 1} (trainer + Recorder, set_sync_debug_mode('error'))"

def sync_count(steps, device='cuda') -> str:
    "The host-device syncs of a fit with the notebook defaults (sync debug mode 'warn': one warning per sync)."
    tr = _gpu_trainer(steps, _notebook_hooks(), device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try: wall = _timed_fit(tr, device)
        finally: torch.cuda.set_sync_debug_mode('default')
    n = sum('synchroniz' in str(w.message) for w in caught)
    prog, plot = tr.hooks[1], tr.hooks[2]
    return (f"syncs with the notebook defaults: {n} in {steps} steps, {wall:.1f} s (loss transfers every "
            f"{tr.sync_every} batches, dashboard redraws {prog.n_draws}, plot redraws {plot.n_draws}, end of epoch)")

def run_gpu(a):
    if not torch.cuda.is_available(): raise SystemExit("--cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    print(f"GPU: {torch.cuda.get_device_name()}, MLP 512-2048-2048-2048-10, batch 256, AdamW")
    for f in GPU_CONTENDERS.values(): f(50)   # warm up (CUDA context, kernels, cuBLAS handles)
    best, names = {n: 0.0 for n in GPU_CONTENDERS}, list(GPU_CONTENDERS)
    for r in range(a.reps):
        for n in names[r % len(names):] + names[:r % len(names)]: best[n] = max(best[n], GPU_CONTENDERS[n](a.steps))
    for n, v in best.items(): print(f"{n}: {v:.0f} steps/s, {v / best['raw loop (cuda)']:.3f} x raw")
    print(sync_check(a.steps))
    print(sync_count(a.steps))

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--steps', type=int, default=1500)
    ap.add_argument('--reps', type=int, default=9)
    ap.add_argument('--redraw-steps', type=int, default=20_000, help='steps of the redraw-share run (0: skip it)')
    ap.add_argument('--paired-reps', type=int, default=7, help='fits of the paired measurement (0: skip it)')
    ap.add_argument('--cuda', action='store_true', help='on the GPU, with a larger MLP, and the sync checks')
    ap.add_argument('--cpu-time', action='store_true', help="time the contenders by this thread's CPU time, not the "
                    "wall clock: on a machine shared with other work, the time others' processes take the core from "
                    "this one is left out (the redraw-share run keeps the wall clock)")
    a = ap.parse_args()
    if a.cuda: return run_gpu(a)
    if a.cpu_time:
        global clock, clock_ns
        clock, clock_ns = time.thread_time, time.thread_time_ns
        print("timed by the thread's CPU time (time.thread_time)")
    torch.set_num_threads(1)
    for f in CONTENDERS.values(): f(100)   # warm up
    runs = {n: [] for n in CONTENDERS}   # steps/s of each repetition
    names = list(CONTENDERS)
    for r in range(a.reps):
        for n in names[r % len(names):] + names[:r % len(names)]: runs[n].append(CONTENDERS[n](a.steps))
    ref_of = lambda n: 'raw loop (batches in a list)' if 'list' in n else 'raw loop'
    for n, v in runs.items():
        ref = runs[ref_of(n)]
        ratios = sorted(x / y for x, y in zip(v, ref))   # each against the reference's run of the same repetition
        print(f"{n}: {max(v):.0f} steps/s, {max(v) / max(ref):.3f} x {ref_of(n)}; median of {a.reps} ratios "
              f"{statistics.median(ratios):.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    raw, tr = runs['raw loop (batches in a list)'], runs['trainer (batches in a list, no hooks)']
    cost = sorted(1e6 / t - 1e6 / r for t, r in zip(tr, raw))
    print(f"the loop's own cost (batches in a list, no hooks): {1e6 / max(tr) - 1e6 / max(raw):.1f} us per step over "
          f"the raw loop ({1e6 / max(raw):.1f} us), best of {a.reps}; median of the repetitions "
          f"{statistics.median(cost):.1f} us [{cost[0]:.1f} to {cost[-1]:.1f}]")
    if a.paired_reps: paired(a.steps, a.paired_reps)
    if a.redraw_steps: redraw_share(a.redraw_steps)

if __name__ == '__main__': main()
