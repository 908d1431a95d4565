"""What LayerStats' heat maps add to a live-view frame: the time to make and pack a frame (`LivePlot.frame` and `pack`,
the fit thread's part of a redraw, 4 a second by default) and its bytes, with `LayerStats` full (`keep` samples of L
layers) against the same fit without it. A frame carries the samples when they changed (a new sample every `every`
steps) or 2 s after it last did; the others leave them out (`same`).

Run: `.venv/bin/python bench/layer_panel.py [--layers 8 32] [--keep 512] [--reps 200]`. A line is
`L layers, K samples: frame X ms (without LayerStats Y ms), Z kB with the samples, S kB without them (W kB)`, medians
over `reps` frames.
"""
import argparse, os, statistics, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F

warnings.filterwarnings('ignore')
torch.set_num_threads(1)

def trainer(layers: int, keep: int, stats: bool):
    "A fit of an MLP with `layers` Linear layers, `keep` samples taken (every step), with or without LayerStats."
    from trainer_nb.core import Trainer
    from trainer_nb.inside import LayerStats
    from trainer_nb.liveplot import LivePlot
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(layers - 1) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 1))
    batches = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(keep)]
    hooks = [LayerStats(every=1, keep=keep, report=False)] if stats else []
    t = Trainer(net, batches, loss_func=F.mse_loss, cpu=True, hooks=hooks)
    t.remove_hooks(LivePlot).add_hooks(LivePlot(mode='text', path=os.devnull))   # (a file: it reads the hooks)
    t.fit(1)
    return t.get_hook(LivePlot)

def cost(plot, reps: int) -> tuple[float, int, int]:
    "Median ms to make and pack a frame, its bytes, and those of a frame whose heat-map samples did not change."
    from trainer_nb.liveplot import pack
    times, size = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        spec, data = pack(plot.frame())
        times.append(time.perf_counter() - t0)
        size = len(data)
    f = plot.frame()
    if 'layers' in f: plot._heat_once(f, time.perf_counter())   # (sent once: the next frame leaves them out)
    same = len(pack(plot._heat_once(f, time.perf_counter()) if 'layers' in f else f)[1])
    return 1000 * statistics.median(times), size, same

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--layers', type=int, nargs='+', default=[8, 32])
    ap.add_argument('--keep', type=int, default=512)
    ap.add_argument('--reps', type=int, default=200)
    a = ap.parse_args()
    for n in a.layers:
        with_, without = trainer(n, a.keep, True), trainer(n, a.keep, False)
        (ms, b, same), (ms0, b0, _) = cost(with_, a.reps), cost(without, a.reps)
        k = len(with_._stats.series()[0])
        print(f"{n} layers, {k} samples: frame {ms:.2f} ms (without LayerStats {ms0:.2f} ms), {b / 1e3:.0f} kB with the "
              f"samples, {same / 1e3:.0f} kB without them ({b0 / 1e3:.0f} kB)")
