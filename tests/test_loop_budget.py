"""The loop's own cost per batch, counted rather than timed: tracers count what the library's Python code does for
each batch of a fixed tiny fit (no hooks, one thread, `(x, y)` batches from a list, `loss_func`, SGD, the CPU), and
each count must stay within the budget below. A change that adds an attribute read or a call to every batch fails
here, saying where the counts grew; one that makes the loop leaner lowers the budget with it.

How it is counted: the fit runs twice, over 10 and over 30 batches, under each tracer; the difference of the two
totals, divided by 20, is the cost of one batch (what a fit costs once, before and after its batches, cancels out),
and it must be a whole number (every batch takes the same path). Counted in the frames of `trainer_nb`'s code only:

- `sys.setprofile`: Python functions called (a function of `trainer_nb`, or any Python function that one calls:
  the model's `__call__`, the loss function, torch's `backward`, the optimizer's `step` and `zero_grad`), and C
  functions called from `trainer_nb`'s code (`len`, `Tensor.item`, `math.isfinite`...);
- `sys.settrace` with opcode events: the lines run, the bytecode instructions run, attribute reads (`LOAD_ATTR`,
  `LOAD_METHOD`) and attribute writes (`STORE_ATTR`).

Such a fit takes the short path (`Loop._short_epoch`); the general path (`_train_batch`, `_pass`, `_forward`,
`_step`), which a hook inside the batch (`before_batch` to `after_backward`) and the other configurations take, has a
budget of its own, counted with one hook at `before_batch` that does nothing. The budgets are the counts reached on
CPython 3.11, whose compiler the instruction counts depend on. History: before the per-fit choices were bound once per
fit (`_Plain`), a batch made 22 Python calls (12 of the library's functions), 14 C calls, 76 lines, 546 bytecode
instructions and 71 attribute reads; with them, 10 calls (5 of the library's), 61 lines, 390 instructions and 52
attribute reads (now the general path's, with its hook's call); the short path, a batch in its own frame
(`_short_batch`): 6 calls (1 of the library's), 38 lines, 269 instructions, 32 attribute reads; the epoch's batches and
the short path in one frame (`_short_epoch`): 5 calls (none of the library's), 36 lines, 230 instructions, 14 attribute
reads. The gradients' check after each backward pass (on by default where each loss is checked at its batch, as
here: a `GradCheck` made once a fit, one fused kernel and one read a batch) adds 2 calls (the check and its list), 2 C
calls, 9 lines, 60 instructions and 8 attribute reads to the short path (9 reads to the general one); it added 3 C
calls, 10 lines, 59 instructions and 9 attribute reads when it was a function that made its flag at each call.
"""
import collections
import dis
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import trainer_nb
from trainer_nb.core import Hook, Trainer

pytestmark = pytest.mark.usefixtures('fresh_accelerate')
PKG = os.path.dirname(trainer_nb.__file__) + os.sep
BUDGET = {'python calls': 7, 'library functions': 2, 'C calls': 7, 'lines': 44, 'instructions': 276,
          'attribute reads': 22, 'attribute writes': 15}
GENERAL_BUDGET = {'python calls': 14, 'library functions': 8, 'C calls': 7, 'lines': 73, 'instructions': 468,
                  'attribute reads': 64, 'attribute writes': 18}
ATTR_READS = {'LOAD_ATTR', 'LOAD_METHOD', 'LOAD_SUPER_ATTR'}


def ours(frame) -> bool: return frame.f_code.co_filename.startswith(PKG)


def profile_counts(counts):
    "A `sys.setprofile` function adding to `counts` the calls made in the library's frames (and of its functions)."
    def prof(frame, event, arg):
        if event == 'call':
            mine, caller = ours(frame), frame.f_back
            if mine: counts['library functions'] += 1
            if mine or (caller is not None and ours(caller)):
                counts['python calls'] += 1
                counts[f'call {frame.f_code.co_name}'] += 1
        elif event == 'c_call' and ours(frame):
            counts['C calls'] += 1
            counts[f'C {getattr(arg, "__qualname__", arg)}'] += 1
    return prof


def trace_counts(counts):
    "A `sys.settrace` function adding to `counts` the lines, instructions and attribute accesses of library frames."
    def local(frame, event, arg):
        if event == 'line':
            counts['lines'] += 1
        elif event == 'opcode':
            op, where = dis.opname[frame.f_code.co_code[frame.f_lasti]], frame.f_code.co_name
            counts['instructions'] += 1
            if op in ATTR_READS:
                counts['attribute reads'] += 1
                counts[f'read in {where}'] += 1
            elif op == 'STORE_ATTR':
                counts['attribute writes'] += 1
        return local
    def trace(frame, event, arg):
        if not ours(frame): return None
        frame.f_trace_opcodes = True
        return local
    return trace


def tiny_trainer(hooks=()):
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)] for _ in range(30)]
    torch.manual_seed(0)
    return Trainer(torch.nn.Linear(8, 2), batches, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.01,
                   cpu=True, default_hooks=False, hooks=list(hooks)), batches


def counted(t, batches, n: int, tracer: str) -> collections.Counter:
    "The counts of a one-epoch fit of `t` over the first `n` batches, under one tracer."
    counts = collections.Counter()
    t.train_dl = batches[:n]
    if tracer == 'profile': sys.setprofile(profile_counts(counts))
    else: sys.settrace(trace_counts(counts))
    try: t.fit(1)
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return counts


class Inner(Hook):
    "A hook inside the batch that does nothing: the fit takes the general path."
    def before_batch(self): pass


def per_batch(hooks=()) -> dict:
    "Each count for one batch: (30 batches - 10 batches) / 20, which must divide evenly."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t, batches = tiny_trainer(hooks)
        t.fit(1)   # warm up (first calls, lazily made objects)
        out = {}
        for tracer in ('profile', 'trace'):
            # a first fit under the tracer, not counted: on CPython 3.12 the first fit traced counted 3 attribute
            # reads fewer in `fit`'s door than the next one did (it ran the same code), and the division failed
            counted(t, batches, 10, tracer)
            short, long = counted(t, batches, 10, tracer), counted(t, batches, 30, tracer)
            for k in long.keys() | short.keys():
                d = long[k] - short[k]
                assert d % 20 == 0, f"{k}: {d} over 20 batches, not the same for each"
                if d: out[k] = d // 20
        return out
    finally: torch.set_num_threads(threads)


@pytest.mark.usefixtures('on_the_cpu')
@pytest.mark.parametrize('path', ['short', 'general'])
def test_the_loop_stays_within_its_budget(path):
    counts = per_batch([] if path == 'short' else [Inner()])
    budget = BUDGET if path == 'short' else GENERAL_BUDGET
    detail = ', '.join(f"{k}: {v}" for k, v in sorted(counts.items()) if k not in budget)
    over = ', '.join(f"{k}: {counts.get(k, 0)} > {b}" for k, b in budget.items() if counts.get(k, 0) > b)
    assert not over, f"the loop's work per batch grew past its budget ({over}); where: {detail}"
    # the tracers do see the loop: a batch calls the model, the loss, backward, the optimizer's step and zero_grad
    assert counts['python calls'] >= 5 and counts['C calls'] >= 1 and counts['attribute reads'] >= 10, counts
    # the path counted: the short one calls none of the library's functions for a batch, the general one `_train_batch`
    assert counts.get('call _train_batch', 0) == (0 if path == 'short' else 1), counts
