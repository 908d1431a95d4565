"""`launch`: several processes from a notebook, for real. Two CPU processes (gloo) forked from a Jupyter kernel: the
same weights as one process on the same global batch, rank 0's result and its live display brought back to the cell
(nbclient for the saved outputs, JupyterLab in headless Chromium for the live updates), a failing worker named in the
cell's error with no process left behind, and the stop button ending the workers. The CUDA checks run on a GPU only."""
import base64, os, subprocess, sys, time

import pytest
import torch

from conftest import REPO
from jupyter_lab import KERNEL, jupyter_env, lab_server, needs_browser, notebook_page, run_all_cells, write_notebook
from test_browser import JS_STATE, run_nbclient

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason="forks worker processes (Linux)")


def setup_cell(pid_dir):
    "Imports, and `train(bs, ...)`: each process writes its PID to `pid_dir/pid{rank}_{pid}`, then trains a regression."
    return f"""\
import os, sys, time
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook
from trainer_nb.core import Trainer
from trainer_nb.recorder import Recorder
from trainer_nb.progress import Progress
from trainer_nb.liveplot import LivePlot
from trainer_nb.launch import launch, WorkerError
PIDS = {str(pid_dir)!r}

class Slow(Hook):
    "Sleeps `s` after each step, and writes the iteration reached to PIDS/at<rank>."
    def __init__(self, s): self.s = s
    def after_step(self):
        time.sleep(self.s)
        with open(os.path.join(PIDS, 'at' + os.environ.get('RANK', '0')), 'w') as f:
            f.write(str(self.trainer.state.iteration))

class Fail(Hook):
    def __init__(self, at): self.at = at
    def after_step(self):
        if self.trainer.state.iteration == self.at: raise ValueError('bad batch at ' + str(self.at))

def train(bs, epochs=2, sleep=0.0, fail_rank=None, n=192, often=False):
    rank = int(os.environ.get('RANK', 0))
    tmp = os.path.join(PIDS, f'.tmp{{os.getpid()}}')   # written whole, then named: the test never reads it half-written
    with open(tmp, 'w') as f: f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(PIDS, f'pid{{rank}}_{{os.getpid()}}'))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + 64, 4, generator=g)
    y = x @ torch.tensor([[1.], [-2.], [3.], [.5]]) + 0.1
    dl = DataLoader(TensorDataset(x[:n], y[:n]), batch_size=bs)
    vdl = DataLoader(TensorDataset(x[n:], y[n:]), batch_size=16)
    torch.manual_seed(0)
    hooks = [Slow(sleep)] + ([Fail(3)] if fail_rank == rank else [])
    if often: hooks += [Recorder(), Progress(every=0.2), LivePlot(every=0.3)]   # redraw often
    t = Trainer(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), dl, vdl, loss_func=F.mse_loss,
                lr=0.05, cpu=True, hooks=hooks, default_hooks=not often)
    t.fit(epochs)
    return dict(history=t.history, n=t.accelerator.num_processes, rank=rank,
                weights={{k: v.detach().clone() for k, v in t.unwrapped_model.state_dict().items()}})
"""


def worker_pids(pid_dir):
    return {int(p.read_text()) for p in pid_dir.glob('pid*')}


def iterations_reached(pid_dir) -> list:
    "The last iteration each rank's `Slow` hook wrote."
    return sorted(int(p.read_text() or 0) for p in pid_dir.glob('at*'))


def alive(pid) -> bool:
    "Is `pid` a running process (not a zombie)?"
    try: return (open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]) != 'Z'
    except (FileNotFoundError, ProcessLookupError, IndexError): return False


@pytest.fixture
def pid_dir(tmp_path):
    d = tmp_path / 'pids'
    d.mkdir()
    return d


def outputs(cell): return cell.get('outputs', [])


def test_two_processes_same_weights_result_and_saved_display(tmp_path, monkeypatch, pid_dir):
    out = tmp_path / 'out.pt'
    nb = run_nbclient(tmp_path, monkeypatch, [
        setup_cell(pid_dir),
        "r2 = launch(train, 8, num_processes=2)",
        "r1 = launch(train, 16, num_processes=1)   # one process, the same global batch, in the kernel",
        f"torch.save(dict(r2=r2, r1=r1, kernel=os.getpid()), {str(out)!r})"])
    res = torch.load(out, weights_only=False)
    r2, r1 = res['r2'], res['r1']
    assert (r2['n'], r2['rank'], r1['n']) == (2, 0, 1)          # rank 0's return value came back
    for k, v in r1['weights'].items(): torch.testing.assert_close(r2['weights'][k], v, atol=1e-5, rtol=0)
    h2, h1 = r2['history'], r1['history']
    assert list(h2.index) == [1, 2] and list(h2.columns) == list(h1.columns)
    assert abs(h2['valid_loss'].iloc[-1] - h1['valid_loss'].iloc[-1]) < 1e-4 * max(1, h1['valid_loss'].iloc[-1])
    # two worker processes ran, other than the kernel, and none is left
    pids = worker_pids(pid_dir) - {res['kernel']}   # the one-process run wrote the kernel's
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    # the launch cell keeps what a one-process fit leaves: the static PNG and the final table (no live widget)
    outs = outputs(nb.cells[1])
    pngs = [base64.b64decode(o['data']['image/png']) for o in outs if 'image/png' in o.get('data', {})]
    html = [o['data']['text/html'] for o in outs if 'text/html' in o.get('data', {})]
    assert len(pngs) == 1 and pngs[0][:8] == b'\x89PNG\r\n\x1a\n' and len(pngs[0]) > 2000
    done = [h for h in html if 'trainer-nb-progress-done' in h]
    assert len(done) == 1 and 'done' in done[0] and 'valid_loss' in done[0]
    assert done[0].count('<tr>') == 2   # a row per epoch
    assert not [o for o in outs if 'application/vnd.jupyter.widget-view+json' in o.get('data', {})]
    # the one-process cell shows the same kind of record
    assert any('image/png' in o.get('data', {}) for o in outputs(nb.cells[2]))


def test_failing_worker_names_its_rank_and_leaves_no_process(tmp_path, monkeypatch, pid_dir):
    nb = run_nbclient(tmp_path, monkeypatch, [
        setup_cell(pid_dir),
        "launch(train, 8, epochs=20, sleep=0.01, fail_rank=1, num_processes=2)",
        "import psutil\nprint('children', len(psutil.Process().children(recursive=True)))",
        "r = launch(train, 8, num_processes=2)\nprint('again', r['n'])"], allow_errors=True)
    err = [o for o in outputs(nb.cells[1]) if o['output_type'] == 'error']
    assert len(err) == 1 and err[0]['ename'] == 'WorkerError', outputs(nb.cells[1])
    assert err[0]['evalue'].startswith('rank 1 failed: ValueError: bad batch at 3'), err[0]['evalue']
    assert 'Fail' in err[0]['evalue'] and 'after_step' in err[0]['evalue']   # the worker's traceback text
    text = ''.join(o.get('text', '') for o in outputs(nb.cells[2]))
    assert 'children 0' in text, text
    assert 'again 2' in ''.join(o.get('text', '') for o in outputs(nb.cells[3]))   # the kernel still launches
    assert not any(alive(p) for p in worker_pids(pid_dir))


def test_interrupt_ends_the_workers_and_the_kernel_launches_again(tmp_path, monkeypatch, pid_dir):
    from jupyter_client.manager import start_new_kernel
    env = jupyter_env(tmp_path)
    for k in ('JUPYTER_PATH', 'JUPYTER_CONFIG_DIR', 'JUPYTER_RUNTIME_DIR', 'JUPYTER_DATA_DIR', 'IPYTHONDIR'):
        monkeypatch.setenv(k, env[k])
    km, kc = start_new_kernel(kernel_name=KERNEL, env=env, cwd=str(tmp_path))
    try:
        reply = kc.execute_interactive(setup_cell(pid_dir), timeout=120)
        assert reply['content']['status'] == 'ok', reply
        # stop_on_error=False: the interrupted cell's error does not make the kernel abort the requests that follow
        # (with True, ipykernel aborts those that reach it before it has finished handling the error: a race)
        msg_id = kc.execute("launch(train, 8, epochs=100, sleep=0.02, num_processes=2)", stop_on_error=False)
        end = time.time() + 120
        while len(worker_pids(pid_dir)) < 2 and time.time() < end: time.sleep(0.2)
        pids = worker_pids(pid_dir)
        assert len(pids) == 2
        while len(iterations_reached(pid_dir)) < 2 and time.time() < end: time.sleep(0.2)   # both have trained a step
        assert all(alive(p) for p in pids)
        km.interrupt_kernel()
        t0 = time.monotonic()
        while True:
            reply = kc.get_shell_msg(timeout=60)
            if reply['parent_header'].get('msg_id') == msg_id: break
        took = time.monotonic() - t0
        assert reply['content']['status'] == 'error' and reply['content']['ename'] == 'KeyboardInterrupt', reply
        assert not any(alive(p) for p in pids)        # gone by the time the cell returned
        # ended by the stop, not at the fit's end (100 epochs of 24 batches): the cell did not wait for the training
        reached = iterations_reached(pid_dir)
        assert len(reached) == 2 and max(reached) < 100 * 24, (reached, f"returned {took:.1f} s after the interrupt")
        # and no thread that launch started is left in the kernel (it may end just after the cell: 30 s); the names
        # come back in the reply (user_expressions), which does not depend on the stream's messages
        reply = kc.execute_interactive("import threading\n"
                                       "[t.join(30) for t in threading.enumerate() if t.name == 'trainer-nb-launch']",
                                       user_expressions={'threads': "sorted(t.name for t in threading.enumerate())"},
                                       timeout=60, output_hook=lambda m: None)
        assert reply['content']['status'] == 'ok', reply
        names = reply['content']['user_expressions']['threads']
        assert names['status'] == 'ok' and 'trainer-nb-launch' not in names['data']['text/plain'], names
        for p in pid_dir.glob('pid*'): p.unlink()
        reply = kc.execute_interactive("r = launch(train, 8, num_processes=2)",
                                       user_expressions={'again': "(r['n'], r['rank'])"},
                                       timeout=120, output_hook=lambda m: None)
        assert reply['content']['status'] == 'ok', reply
        assert reply['content']['user_expressions']['again']['data']['text/plain'] == '(2, 0)', reply['content']
        assert not any(alive(p) for p in worker_pids(pid_dir))
        seen = []
        kc.execute_interactive("print('THREADS', sorted(t.name for t in threading.enumerate()))", timeout=60,
                               output_hook=seen.append)
        text = ''.join(m['content'].get('text', '') for m in seen if m['msg_type'] == 'stream')
        assert 'THREADS' in text and 'trainer-nb-launch' not in text, text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@needs_browser
def test_jupyterlab_shows_rank0_live(tmp_path, pid_dir):
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root/run.ipynb', [
            setup_cell(pid_dir), "r = launch(train, 8, epochs=3, sleep=0.02, n=960, often=True, num_processes=2)",
            "print('ALL', 'DONE', r['n'])"])
        with notebook_page(server, 'run.ipynb') as page:
            run_all_cells(page)
            progress, srcs = [], []
            end = time.time() + 180
            while time.time() < end:
                st = page.evaluate(JS_STATE)
                if st['progress'] and (not progress or progress[-1] != st['progress']): progress.append(st['progress'])
                if st['live'] and (not srcs or srcs[-1] != st['live']): srcs.append(st['live'])
                if 'ALL DONE' in st['text'] or 'Error' in st['text']: break
                time.sleep(0.1)
            time.sleep(0.5)
            st = page.evaluate(JS_STATE)
            page.screenshot(path=str(tmp_path / 'launch_done.png'), full_page=True)
    assert 'ALL DONE 2' in st['text'], st['text'][-3000:]
    # while the workers trained, the kernel's dashboard and plot (fed by rank 0) changed several times
    assert len(progress) >= 3 and any('/60' in p for p in progress), progress   # 960 / (8 x 2): 60 batches a process
    assert len(srcs) >= 3, f"the live plot changed {len(srcs) - 1} times"
    assert st['progress'] is None and st['live'] is None
    assert any(s.startswith('data:image/png') for s in st['static_imgs']), st['static_imgs']
    assert st['done_html'] and st['done_html'][0].startswith('done') and 'valid_loss' in st['done_html'][0]


def run_py(code, env=None):
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, **(env or {})))


def test_import_touches_no_cuda_and_makes_no_accelerator():
    # a CUDA initialisation goes through torch.cuda._lazy_init: make it fail loudly during the import
    p = run_py("""import torch, torch.cuda
def no(*a, **k): raise AssertionError('CUDA initialised at import')
torch.cuda._lazy_init = no
torch.cuda.init = no
import trainer_nb.all
from trainer_nb.launch import check_kernel_untouched
from accelerate.state import AcceleratorState, PartialState
assert not torch.cuda.is_initialized() and not AcceleratorState._shared_state and not PartialState._shared_state
check_kernel_untouched()
print('ok')""")
    assert p.returncode == 0 and 'ok' in p.stdout, p.stderr[-3000:]


def test_an_accelerator_in_the_kernel_is_refused_before_launching():
    p = run_py(f"""import sys
sys.path.insert(0, {str(REPO)!r})
import torch
from trainer_nb.core import Trainer
from trainer_nb.launch import launch
Trainer(torch.nn.Linear(2, 1), cpu=True)
try: launch(print, num_processes=2)
except RuntimeError as e: print('refused:', e)""")
    assert 'refused: An Accelerator was already made in this kernel' in p.stdout, p.stdout + p.stderr[-3000:]
    assert 'Restart the kernel' in p.stdout


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_cuda_initialised_in_the_kernel_is_refused():
    p = run_py(f"""import sys
sys.path.insert(0, {str(REPO)!r})
import torch
from trainer_nb.launch import launch
torch.zeros(1).cuda()
try: launch(print, num_processes=2)
except RuntimeError as e: print('refused:', e)""")
    assert 'refused: CUDA is already initialised in this kernel' in p.stdout, p.stdout + p.stderr[-3000:]
    assert 'Restart the kernel' in p.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpus_from_a_launch():
    n = torch.cuda.device_count()
    p = run_py(f"""import sys, torch
sys.path.insert(0, {str(REPO)!r})
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
from trainer_nb.launch import launch
def train():
    x = torch.randn(256, 4)
    t = Trainer(torch.nn.Linear(4, 1), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16),
                loss_func=F.mse_loss)
    t.fit(1)
    return str(t.accelerator.device), t.accelerator.num_processes
print('result', launch(train, num_processes={n}))
print('cuda in the parent', torch.cuda.is_initialized())""")
    assert f"result ('cuda:0', {n})" in p.stdout, p.stdout + p.stderr[-3000:]
    assert 'cuda in the parent False' in p.stdout
