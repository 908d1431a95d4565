"""Stop and continue, as a notebook user does it: a real kernel interrupt (the stop button) during a fit ends it after
its batch with the record and one line saying how to go on, a "run all" stops there, and `trainer.resume()` in the
next cell ends with the weights of an uninterrupted fit. Once in a kernel driven by nbclient, once in JupyterLab in
headless Chromium, pressing the toolbar's stop button."""
import asyncio, time

from conftest import REPO
from jupyter_lab import (KERNEL, jupyter_env, lab_server, needs_browser, notebook_page, output_texts, run_all_cells,
                         run_cell, wait_for_text, write_notebook)


def cells(ready):
    """The notebook: set-up; a fit whose hook, at iteration 60, creates the file `ready` and waits for the stop button
    (`trainer.stopping`); the resume, checked against the same fit run uninterrupted."""
    setup = f"""\
import sys, time
sys.path.insert(0, {str(REPO)!r})
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.base import Hook
from trainer_nb.core import Trainer

class WaitForStop(Hook):
    "At iteration 60, tell the test (a file) and wait until the stop button was pressed."
    def after_batch(self):
        if self.trainer.state.iteration == 60:
            open({str(ready)!r}, 'w').close()
            while not self.trainer.stopping: time.sleep(0.005)

def make(*hooks):
    torch.manual_seed(0)
    x = torch.randn(480, 8); y = x @ torch.randn(8, 1) + 0.1 * torch.randn(480, 1)
    dl = DataLoader(TensorDataset(x[:400], y[:400]), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    return Trainer(model, dl, DataLoader(TensorDataset(x[400:], y[400:]), batch_size=40), loss_func=F.mse_loss,
                   cpu=True, hooks=hooks)"""
    fit = "tr = make(WaitForStop())\ntr.fit_one_cycle(3, lr_max=1e-2)"
    resume = """\
tr.resume()
ref = make()
ref.fit_one_cycle(3, lr_max=1e-2)
same = all(torch.equal(a, b) for a, b in zip(tr.model.parameters(), ref.model.parameters()))
print('RESUMED', tr.state.iteration, same)"""
    return [setup, fit, resume]


JS_CELL_DONE = """(i) => /\\[\\d+\\]/.test(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')[i].innerText)"""

LINE = "FitStopped: Stopped at epoch 2 of 3, batch 10 of 50 (step 60 of 150). trainer.resume() continues this fit."


def run_interrupted(tmp_path, monkeypatch, sources, presses):
    """Run the three cells `sources` in a kernel driven by nbclient; while the second one runs, interrupt the kernel
    (what the stop button sends: SIGINT) once each file of `presses` exists, in order. Returns the notebook."""
    import nbformat
    from nbclient import NotebookClient
    env = jupyter_env(tmp_path)
    for k in ('JUPYTER_PATH', 'JUPYTER_CONFIG_DIR', 'JUPYTER_RUNTIME_DIR', 'JUPYTER_DATA_DIR', 'IPYTHONDIR',
              'MPLBACKEND'):
        monkeypatch.setenv(k, env[k])
    path = tmp_path / 'run.ipynb'
    write_notebook(path, sources)
    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name=KERNEL, allow_errors=True,
                            resources={'metadata': {'path': str(tmp_path)}})

    async def press():
        for f in presses:
            while not f.exists(): await asyncio.sleep(0.02)   # (waits for the file: no timing assumed)
            await client.km.interrupt_kernel()

    async def run():
        async with client.async_setup_kernel():
            await client.async_execute_cell(nb.cells[0], 0)
            presser = asyncio.ensure_future(press())
            await client.async_execute_cell(nb.cells[1], 1)
            await presser
            await client.async_execute_cell(nb.cells[2], 2)
    asyncio.run(run())
    return nb


def test_nbclient_real_interrupt_then_resume(tmp_path, monkeypatch):
    ready = tmp_path / 'ready'
    nb = run_interrupted(tmp_path, monkeypatch, cells(ready), [ready])
    outs = nb.cells[1].outputs
    errors = [o for o in outs if o.output_type == 'error']
    assert len(errors) == 1 and errors[0].ename == 'FitStopped', outs
    # the traceback shown is the one line, not the loop's frames
    assert len(errors[0].traceback) == 1 and errors[0].traceback[0].endswith(LINE.split(': ', 1)[1])
    assert '\x1b[0;31mFitStopped\x1b[0m: ' in errors[0].traceback[0]
    # the record the fit leaves: its first epoch's results, and the status line saying how to go on
    htmls = [o['data']['text/html'] for o in outs if 'text/html' in o.get('data', {})]
    done = [h for h in htmls if 'trainer-nb-progress-done' in h]
    assert len(done) == 1 and 'stopped (trainer.resume() continues)' in done[0] and 'valid_loss' in done[0], outs
    text = ''.join(o.get('text', '') for o in nb.cells[2].outputs)
    assert 'RESUMED 150 True' in text, nb.cells[2].outputs


JS_ERROR_LINES = """() => [...document.querySelectorAll('.jp-CodeCell')].map(c =>
    [...c.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
        .map(o => o.innerText).join('\\n'))"""


@needs_browser
def test_jupyterlab_stop_button_then_resume(tmp_path):
    ready = tmp_path / 'ready'
    with lab_server(tmp_path) as server:
        write_notebook(tmp_path / 'root/stop.ipynb', cells(ready))
        with notebook_page(server, 'stop.ipynb', viewport=(1400, 1000)) as page:
            run_all_cells(page)
            end = time.time() + 120
            while not ready.exists():
                assert time.time() < end, f"the fit did not reach iteration 60:\n{output_texts(page)}"
                time.sleep(0.05)
            page.click('jp-button[data-command="notebook:interrupt-kernel"]')   # the toolbar's stop button
            outs = wait_for_text(page, 'trainer.resume() continues this fit.', timeout=60, cell=1)
            # the fit's cell is done when its prompt has its number (the kernel may say 'idle' before: a widget's
            # messages go through a subshell, which reports its own idle while the cell still ends)
            page.wait_for_function(JS_CELL_DONE, arg=1, timeout=60_000)
            shot = tmp_path / 'jupyterlab_stopped.png'
            page.screenshot(path=str(shot))
            errors = page.evaluate(JS_ERROR_LINES)
            outs = output_texts(page)
            assert outs[2] == '', "the run-all went on past the stopped fit"
            assert errors[1].strip() == LINE, errors
            assert 'Traceback' not in outs[1] and 'stopped (trainer.resume() continues)' in outs[1], outs[1]
            run_cell(page, 2)
            outs = wait_for_text(page, 'RESUMED', timeout=120, cell=2)
            page.wait_for_function("""() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel
                                          .status === 'idle'""", timeout=30_000)
            outs = output_texts(page)
            page.evaluate("() => document.querySelectorAll('.jp-CodeCell')[2].scrollIntoView()")
            shot2 = tmp_path / 'jupyterlab_resumed.png'
            page.screenshot(path=str(shot2))
            print(f"\nscreenshots: {shot} {shot2}")
    assert 'RESUMED 150 True' in outs[2], outs[2]


def test_nbclient_second_interrupt_stops_inside_the_batch(tmp_path, monkeypatch):
    "Two real interrupts: the second one ends the fit inside the batch it waits in; resume() then refuses, saying why."
    first, second = tmp_path / 'first', tmp_path / 'second'
    setup = cells(tmp_path / 'unused')[0]
    fit = f"""\
class Stuck(Hook):
    "In batch 31, waits for the stop button; then, still in that batch, for a second press."
    def after_loss(self):
        if self.trainer.state.iteration == 30:
            open({str(first)!r}, 'w').close()
            while not self.trainer.stopping: time.sleep(0.005)
            open({str(second)!r}, 'w').close()
            while True: time.sleep(0.005)

tr = make(Stuck())
tr.fit_one_cycle(3, lr_max=1e-2)"""
    after = """\
print('ITERATION', tr.state.iteration, 'LOSSES', len(tr.losses))
try: tr.resume()
except RuntimeError as e: print('REFUSED', e)"""
    nb = run_interrupted(tmp_path, monkeypatch, [setup, fit, after], [first, second])

    errors = [o for o in nb.cells[1].outputs if o.output_type == 'error']
    assert len(errors) == 1 and errors[0].ename == 'FitStopped' and len(errors[0].traceback) == 1, errors
    assert 'Interrupted inside batch 31 of epoch 1 (the stop button pressed twice)' in errors[0].traceback[0]
    text = ''.join(o.get('text', '') for o in nb.cells[2].outputs)
    assert 'ITERATION 30 LOSSES 30' in text, text          # the cut batch is not counted, nor its loss kept
    assert 'REFUSED Nothing to resume: the last fit was interrupted inside a batch' in text, text
