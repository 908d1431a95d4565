"""Shared fixtures: small data sets and models, and a fresh Accelerate state for every test.

With `TRAINER_NB_FAILURES=path` in the environment, each failed test's report is appended to `path` as it happens, so
that a run stopped at a time limit (where pytest's summary never prints) still tells why each test failed.

Under pytest-xdist (`make test-py` runs `-n 2 --dist loadfile -m 'not serial'`, then `-m serial` alone): each file's
tests go to one worker, so that a module-scoped fixture (a distributed run's results) is made once, and the docs
tests (one file) share one docs build, which writes into the checkout. A test that loads the machine itself and counts
frames per second is marked `serial`: left to the second, one-process run. The longest files start first. Each worker
and what it starts use their part of the cores for PyTorch's threads (`share_the_cores`)."""
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


FAILURES = os.environ.get('TRAINER_NB_FAILURES')
_WORKER = False


def pytest_configure(config):
    global _WORKER
    config.addinivalue_line('markers', 'slow: long (a minute or more here), or one of several variants of a long test: '
                                       'left out of make test-quick, run by make test')
    config.addinivalue_line('markers', 'browser: drives headless Chromium (jupyter_lab.needs_browser): the Chromium '
                                       'shared by such tests stays open until a test without the mark')
    config.addinivalue_line('markers', 'serial: must not share the machine with other tests (make test-py runs it '
                                       'after the parallel part, alone)')
    _WORKER = hasattr(config, 'workerinput')   # (under pytest-xdist the controller writes what its workers report)
    if _WORKER: share_the_cores(config.workerinput['workercount'])


def share_the_cores(workers: int):
    """Each of `workers` parallel test processes gets its part of the cores for PyTorch's threads, and so do the
    kernels, servers and scripts it starts (`OMP_NUM_THREADS`, unless the environment sets it). With every process's
    team as large as the machine, OpenMP's threads wait for each other spinning while another process's threads hold
    the cores: two browser test files took 219 s on 2 cores, 131 s with one thread a process."""
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.setdefault('OMP_NUM_THREADS', str(threads))
    torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))


# the files whose tests take longest, longest first (seconds of a quiet `make test`, 2 workers): started first, so that
# the parallel run does not end with one worker busy on a long file while the other waits. (pytest-xdist would put the
# files with most tests first instead: make test-py passes --no-loadscope-reorder, which keeps this order)
FIRST = ('test_docs.py',                 # 130 (the docs build, 52, in its set-up)
         'test_checkpoint.py',           # 140
         'test_cli_distributed.py',      # 129
         'test_cli.py',                  # 115
         'test_browser_live.py',         # 104
         'test_metrics.py',              # 91
         'test_browser.py',              # 90
         'test_browser_background.py',   # 87
         'test_launch.py',               # 76
         'test_lr_find.py',              # 69
         'test_browser_lr_find.py',      # 67
         'test_browser_reopen.py',       # 66
         'test_bench_gpu.py',            # 59 (one test)
         'test_search.py',               # 59
         'test_adapters.py',             # 52
         'test_checkpoint_dist.py',      # 49 (one set-up)
         'test_browser_stop.py',         # 47
         'test_recorder.py',             # 45
         'test_browser_search.py')       # 43


def pytest_collection_modifyitems(config, items):
    "The longest files first (stable: the order within a file is kept)."
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(FIRST)))


def pytest_runtest_setup(item):
    "A test not marked `browser` closes the Chromium the tests before it shared (see jupyter_lab.shared_browser)."
    if item.get_closest_marker('browser') is None and 'jupyter_lab' in sys.modules:
        sys.modules['jupyter_lab'].close_browser()


def pytest_runtest_logreport(report):
    if FAILURES and report.failed and not _WORKER:
        with open(FAILURES, 'a') as f: f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps process-wide singletons (mixed precision, accumulation steps): start the test from none,
    and leave none behind. Use it with `pytestmark = pytest.mark.usefixtures('fresh_accelerate')`."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True); GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True); GradientState._reset_state()


@pytest.fixture
def on_the_cpu(fresh_accelerate, monkeypatch):
    """The test's trainers (and the processes it starts) on the CPU where a GPU is visible: for tests that compare with
    a loop written by hand on the CPU, bitwise, or that assert the CPU's semantics (each loss checked at its batch).
    tests/test_gpu.py holds the GPU's own checks."""
    monkeypatch.setenv('ACCELERATE_USE_CPU', '1')   # (read by Accelerate when the trainer makes its accelerator)


def regression_ds(n=48, d=5, seed=0) -> TensorDataset:
    "`n` samples of a noisy linear target, deterministic."
    w = torch.randn(d, 1, generator=torch.Generator().manual_seed(1234))   # the same target for every seed
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def small_model(d=5, seed=1) -> torch.nn.Module:
    "A tiny MLP, with the same weights every time for the same `seed`."
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class LoggingModel(torch.nn.Module):
    "`small_model()` that logs the mean of its output as `out_mean` from its forward, through `log_scalar`."
    def __init__(self):
        super().__init__()
        self.net = small_model()
    def forward(self, x):
        from trainer_nb.core import log_scalar
        out = self.net(x)
        log_scalar('out_mean', out.mean())
        return out


def flat(model) -> torch.Tensor:
    "All parameters of `model` as one detached vector (a copy)."
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture
def make_trainer(fresh_accelerate):
    "`make_trainer(n=48, bs=8, valid=None, **kw)`: a Trainer on `regression_ds` with MSE, no default hooks."
    from trainer_nb.core import Trainer
    def _make(n=48, bs=8, valid=None, model=None, **kw):
        kw.setdefault('loss_func', F.mse_loss)
        kw.setdefault('default_hooks', False)
        valid_dl = DataLoader(regression_ds(valid, seed=1), batch_size=bs) if valid else None
        return Trainer(model if model is not None else small_model(), DataLoader(regression_ds(n), batch_size=bs),
                       valid_dl, **kw)
    return _make


@pytest.fixture(scope='session')
def docs_site() -> Path:
    """The docs site, built once per test session with `tools/build_docs.py --strict` (Sphinx warnings are errors):
    the notebooks run in a kernel (unchanged ones are reused from _exec/), then the site goes to _docs/; its path."""
    import subprocess
    r = subprocess.run([sys.executable, 'tools/build_docs.py', '--strict'], cwd=REPO, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return REPO / '_docs'
