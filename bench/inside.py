"""What looking inside costs a fit on the CPU: the non-finite checks of `nan_policy='raise'`, and `LayerStats`.

Run: `.venv/bin/python bench/inside.py [--steps 400] [--reps 15] [--every 25 50 100]`. Two MLPs fed batches from a
list (no DataLoader noise): the tiny one of `bench/overhead.py` (32-64-10, where fixed costs per step loom largest) and
a wider one (784-512-512-10). Contenders run interleaved, each repetition starting at the next one; a line is
`MODEL CONTENDER: median x (quartiles Q1-Q3, best/best B)`, the ratio of its steps/s to the reference's in the same
repetition (the median over repetitions, and its quartiles), and B the ratio of the best steps/s of each.

- `grad check`: the default fit (`nan_policy='raise'`: each loss checked before its backward pass, free on the CPU
  where the loop holds it as a number already, and the gradients after it, one fused pass over them) against the same
  fit with the gradients' check taken out (`ref`: the losses only).
- `grad check, max_grad_norm`: with `max_grad_norm=1`, where the check reads the norm that clipping computes, against
  the same clipped fit without that check.
- `Timing`: the fit with the `Timing` hook (its own hook calls, and every hook's methods timed) against the same fit
  without it.
- `LayerStats every=N`: the fit with the hook (sampling every N optimizer steps) against the same fit without it.

`--check-share`: the gradients' check (the loop's `GradCheck`) timed alone, beside the step it guards (forward,
backward and SGD's step, or AdamW's, of the same model and batch), interleaved, in blocks of 50 calls: the medians over
the repetitions, their range, and the check's share of a step.
"""
import argparse, statistics, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F

warnings.filterwarnings('ignore')
torch.set_num_threads(1)   # (the fit's own speed, not the machine's other work, decides)

MODELS = {'tiny': (32, (64,), 10, 64), 'wide': (784, (512, 512), 10, 64)}   # in, hidden, out, batch size

def make(kind, steps):
    d, hidden, out, bs = MODELS[kind]
    g = torch.Generator().manual_seed(0)
    distinct = [(torch.randn(bs, d, generator=g), torch.randint(0, out, (bs,), generator=g)) for _ in range(16)]
    torch.manual_seed(0)
    layers, w = [], d
    for h in hidden: layers += [nn.Linear(w, h), nn.ReLU()]; w = h
    return nn.Sequential(*layers, nn.Linear(w, out)), [distinct[i % 16] for i in range(steps)]

def no_grad_check(on: bool):
    "Take the gradients' check out of the fits that follow (`on`), or put it back: the loop's choices, made per fit."
    import trainer_nb.loop as loop
    init = getattr(loop._Plain, '_checked_init', loop._Plain.__init__)
    def unchecked(self, t):
        init(self, t)
        self.grads, self.norm_check = None, False
    loop._Plain._checked_init = init
    loop._Plain.__init__ = unchecked if on else init

def fit(kind, steps, every=None, nan_policy='raise', timing=False, grad_check=True, max_grad_norm=None):
    """Steps/s of a fit of `steps` steps, with `LayerStats(every=every)` unless None, under `nan_policy`, timed or not,
    the gradients checked or not."""
    from trainer_nb.core import Trainer
    from trainer_nb.hooks import Timing
    from trainer_nb.inside import LayerStats
    model, batches = make(kind, steps)
    hooks = ([] if every is None else [LayerStats(every=every, report=False)]) + ([Timing()] if timing else [])
    tr = Trainer(model, batches, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01, cpu=True,
                 default_hooks=False, hooks=hooks, nan_policy=nan_policy, max_grad_norm=max_grad_norm)
    no_grad_check(not grad_check)
    try:
        t = time.perf_counter()
        tr.fit(1)
        return steps / (time.perf_counter() - t)
    finally: no_grad_check(False)

def compare(kind, contenders, steps, reps):
    "`{name: (median ratio, q1, q3, best ratio)}` against contender 'ref', run interleaved."
    names = list(contenders)
    for n in names: contenders[n](kind, 30)   # warm up
    runs = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]: runs[n].append(contenders[n](kind, steps))
    out = {}
    for n in names[1:]:
        ratios = sorted(a / b for a, b in zip(runs[n], runs['ref']))
        q = statistics.quantiles(ratios, n=4)
        out[n] = (statistics.median(ratios), q[0], q[2], max(runs[n]) / max(runs['ref']))
    return out

def check_share(kind, reps, block=50):
    """Per call, in us, medians and ranges over `reps` interleaved blocks: the step (forward, backward and the step of
    SGD, and of AdamW: the trainer's default), and the check of its gradients as the loop makes it (a `GradCheck` made
    once; on a tree from before it, `grads_finite` called each time)."""
    model, batches = make(kind, 1)
    x, y = batches[0]
    params = list(model.parameters())
    try:
        from trainer_nb.inside import GradCheck
        check = GradCheck(params)
    except ImportError:
        from trainer_nb.inside import grads_finite
        check = lambda: grads_finite(params)
    def stepper(opt):
        def step():
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step
    parts = {'SGD step': stepper(torch.optim.SGD(params, lr=0.01)),
             'AdamW step': stepper(torch.optim.AdamW(params, lr=1e-4)), 'check': check}
    times = {n: [] for n in parts}
    for f in parts.values(): f()   # warm up
    for r in range(reps):
        for n, f in parts.items():
            t = time.perf_counter()
            for _ in range(block): f()
            times[n].append((time.perf_counter() - t) / block * 1e6)
    ts = times['check']
    print(f"{kind} the gradients' check: {statistics.median(ts):.1f} us ({min(ts):.1f}-{max(ts):.1f})")
    for n in ('SGD step', 'AdamW step'):
        st = times[n]
        shares = sorted(c / s * 100 for c, s in zip(ts, st))
        print(f"{kind} {n}: {statistics.median(st):.0f} us ({min(st):.0f}-{max(st):.0f}); the check "
              f"{statistics.median(shares):.2f}% of it ({shares[0]:.2f}-{shares[-1]:.2f}% by repetition)", flush=True)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=400)
    ap.add_argument('--reps', type=int, default=15)
    ap.add_argument('--every', type=int, nargs='+', default=[50, 100, 200])
    ap.add_argument('--only-grad-check', action='store_true', help="the gradients' check only (no Timing, LayerStats)")
    ap.add_argument('--models', nargs='+', default=list(MODELS), choices=list(MODELS))
    ap.add_argument('--check-share', action='store_true', help="the gradients' check timed alone, beside a step")
    a = ap.parse_args()
    if a.check_share:
        for kind in a.models: check_share(kind, a.reps)
        return
    for kind in a.models:
        c = {'ref': lambda k, s: fit(k, s, grad_check=False), 'grad check': lambda k, s: fit(k, s),
             'Timing': lambda k, s: fit(k, s, timing=True, grad_check=False)}
        if a.only_grad_check: del c['Timing']
        else: c.update({f'LayerStats every={e}': (lambda k, s, e=e: fit(k, s, every=e, grad_check=False))
                        for e in a.every})
        clipped = {'ref': lambda k, s: fit(k, s, grad_check=False, max_grad_norm=1.),
                   'grad check, max_grad_norm': lambda k, s: fit(k, s, max_grad_norm=1.)}
        for cs in (c, clipped):
            for n, (med, q1, q3, best) in compare(kind, cs, a.steps, a.reps).items():
                print(f"{kind} {n}: {med:.3f} x (quartiles {q1:.3f}-{q3:.3f}, best/best {best:.3f})", flush=True)

if __name__ == '__main__': main()
