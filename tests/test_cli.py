"""The `trainer-nb` command, run for real in subprocesses: help, exit statuses, one-paragraph config errors, describe,
lr-find, train and its run directory, SIGTERM/SIGINT during a fit (saved, then 143/130) and the resume after it."""
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, VENV_BIN

EXE = str(VENV_BIN / 'trainer-nb')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')

CONFIG = """
imports: [cli_parts]
data: {type: regression_data, bs: 8}
model: regression_model
loss: mse_loss
metrics: [mae]
optimizer: {type: SGD, momentum: 0.9}
schedule: one_cycle
fit: {epochs: 3, lr: 0.05}
hooks: [{type: SaveWeights, out: weights}]
run_dir: runs/{name}-{time}
"""


@pytest.fixture
def work(tmp_path):
    "A config and the module it imports in `tmp_path/cfg`; commands run from `tmp_path/work` (another folder)."
    (tmp_path / 'cfg').mkdir()
    (tmp_path / 'work').mkdir()
    (tmp_path / 'cfg' / 'reg.yaml').write_text(CONFIG)
    shutil.copy(REPO / 'tests' / 'cli_parts.py', tmp_path / 'cfg' / 'cli_parts.py')
    return tmp_path


def run(*args, cwd, exe=(EXE,), timeout=240):
    return subprocess.run([*exe, *map(str, args)], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def lines(text): return [l for l in text.splitlines() if l.strip()]


def test_help_and_python_dash_m_agree(tmp_path):
    a = run('--help', cwd=tmp_path)
    b = run('--help', cwd=tmp_path, exe=(sys.executable, '-m', 'trainer_nb'))
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout
    for cmd in ('train', 'lr-find', 'describe', 'demo'): assert cmd in a.stdout
    assert '143' in a.stdout and '130' in a.stdout
    for cmd in ('train', 'lr-find', 'describe', 'demo'):
        r = run(cmd, '--help', cwd=tmp_path)
        assert r.returncode == 0 and 'KEY=VALUE' in r.stdout, r.stdout
    assert run('--version', cwd=tmp_path).stdout.startswith('trainer_nb ')


def test_usage_errors_exit_1(tmp_path):
    for args in ((), ('train',), ('tran', 'x.yaml'), ('demo', '--min-accuracy', 'high')):
        r = run(*args, cwd=tmp_path)
        assert r.returncode == 1, (args, r.stderr)
        assert 'Traceback' not in r.stderr and 'usage: trainer-nb' in r.stderr


def test_help_version_and_usage_errors_answer_without_importing_torch(tmp_path):
    "The commands import the library's parts when they run: the answers that need none come at once."
    code = ("import contextlib, io, sys\nfrom trainer_nb.cli import main\n"
            "for argv in ([], ['--help'], ['train', '--help'], ['search', '--help'], ['--version'],\n"
            "             ['tran', 'x.yaml']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'pandas', 'accelerate', 'matplotlib') if m in sys.modules))")
    r = run('-c', code, cwd=tmp_path, exe=(sys.executable,))
    assert r.returncode == 0 and r.stdout.strip() == '[]', (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize('override, says', [
    ('model.hiden=4', "model.hiden: model 'regression_model' has no argument 'hiden' (did you mean 'hidden'?)"),
    ('fit.epoch=2', "Unknown config field fit.'epoch' (did you mean 'epochs'?)"),
    ('modle.hidden=4', "Unknown config field 'modle' (did you mean 'model'?)"),
    ('loss=mse', "(did you mean 'mse_loss'?)"),
    ('metrics=[mea]', "(did you mean 'mae'?)"),
    ('fit.lr', 'is not of the form key.sub=value'),
])
def test_a_bad_override_is_one_paragraph_and_exit_1(work, override, says):
    r = run('train', work / 'cfg' / 'reg.yaml', override, cwd=work / 'work')
    assert r.returncode == 1
    (line,) = lines(r.stderr)
    assert line.startswith('trainer-nb train: error: ') and says in line
    assert line.endswith('(--debug shows the traceback)')
    assert r.stdout == '' and not (work / 'work' / 'runs').exists()
    d = run('train', work / 'cfg' / 'reg.yaml', override, '--debug', cwd=work / 'work')
    assert d.returncode == 1 and 'Traceback (most recent call last)' in d.stderr and says in lines(d.stderr)[-1]


def test_a_bad_config_file_is_one_paragraph(work):
    bad = work / 'cfg' / 'bad.yaml'
    bad.write_text(CONFIG + 'fit: {epochs: [3\n')
    r = run('describe', bad, cwd=work / 'work')
    (line,) = lines(r.stderr)
    assert r.returncode == 1 and f'{bad} is not valid YAML' in line
    r = run('describe', work / 'cfg' / 'none.yaml', cwd=work / 'work')
    assert r.returncode == 1 and 'No config file' in r.stderr and len(lines(r.stderr)) == 1


def test_describe(work):
    r = run('describe', work / 'cfg' / 'reg.yaml', 'hooks=[{type: EarlyStopping, patience: 2}]', cwd=work / 'work')
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'   # (the config names none: the GPU where there is one)
    assert out[0] == f'Trainer on {device} (1 process)' and '  model:     regression_model (49 parameters)' in out
    assert '  optimizer: SGD momentum=0.9' in out and '  fit:       3 epochs, lr 0.05' in out
    head = next(i for i, l in enumerate(out) if l.startswith('event'))
    row = {l.split()[0]: l.split(None, 1)[1] for l in out[head + 1:]}
    assert list(row) == ['before_fit', 'before_epoch', 'before_batch', 'after_pred', 'after_loss', 'after_backward',
                         'before_step', 'after_step', 'after_batch', 'after_change', 'after_pause', 'before_valid',
                         'after_valid', 'after_epoch', 'after_cancel', 'after_fit']
    assert 'EarlyStopping (82)' in row['after_epoch'] and 'Checkpoint (85)' in row['after_epoch']
    assert row['after_pred'] == '-'
    assert not (work / 'work' / 'runs').exists()     # describing writes nothing


def test_lr_find_prints_suggestions_and_saves_the_plot(work):
    r = run('lr-find', work / 'cfg' / 'reg.yaml', 'run_dir=runs/lr', cwd=work / 'work')
    assert r.returncode == 0, r.stderr
    out = lines(r.stdout)
    assert out[0].startswith('LR finder: valley ')
    assert re.search(r'(; using valley|, fallback [\d.e+-]+; using fallback)$', out[0]), out[0]
    assert out[1] == 'LR finder plot: runs/lr/lr_find.png'
    png = work / 'work' / 'runs' / 'lr' / 'lr_find.png'
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert [p.name for p in png.parent.iterdir()] == ['lr_find.png']          # no checkpoint: nothing was trained
    r = run('lr-find', work / 'cfg' / 'reg.yaml', 'run_dir=null', 'lr_find.suggestion=minimum', '--plot', 'x/f.png',
            cwd=work / 'work')
    assert r.returncode == 0 and lines(r.stdout)[0].endswith('; using minimum') and (work / 'work/x/f.png').is_file()


def test_train_writes_the_run_directory_and_refuses_to_overwrite_it(work):
    r = run('train', work / 'cfg' / 'reg.yaml', 'run_dir=runs/one', cwd=work / 'work')
    assert r.returncode == 0, r.stderr
    out = lines(r.stdout)
    assert out[0] == 'run directory: runs/one'
    assert out[-2].startswith('valid loss: ') and out[-1].startswith('valid mae: ')
    assert 'wrote history.csv, loss_lr.png in runs/one' in out
    run_dir = work / 'work' / 'runs' / 'one'
    assert {'config.json', 'history.csv', 'loss_lr.png', 'metrics.jsonl', 'best.json', 'step-00000024'} <= \
        {p.name for p in run_dir.iterdir()}
    assert len((run_dir / 'history.csv').read_text().splitlines()) == 4       # a header and three epochs
    # the same directory again, for a new run: refused, nothing touched
    before = sorted(p.name for p in run_dir.iterdir())
    r = run('train', work / 'cfg' / 'reg.yaml', 'run_dir=runs/one', cwd=work / 'work')
    assert r.returncode == 1 and 'holds the checkpoints of an earlier run' in r.stderr and len(lines(r.stderr)) == 1
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_an_error_while_training_shows_its_traceback(work):
    r = run('train', work / 'cfg' / 'reg.yaml', 'fit.lr=1e12', 'schedule=null', 'run_dir=null', cwd=work / 'work')
    assert r.returncode == 1
    assert 'Traceback (most recent call last)' in r.stderr and 'NonFiniteError: Non-finite loss' in r.stderr
    assert lines(r.stderr)[-1].startswith('trainer-nb train: error: NonFiniteError: Non-finite loss')


def _stop_mid_fit(work, sig, *overrides):
    "Start a training run, send `sig` once it has taken 5 steps (slowed down from there); returns (process, stdout)."
    p = subprocess.Popen([EXE, 'train', str(work / 'cfg' / 'reg.yaml'), 'hooks.0.out=weights_stopped',
                          'hooks=[{type: SaveWeights, out: weights_stopped}, {type: Pause, at_step: 5, sleep: 0.3}]',
                          *overrides], cwd=work / 'work', env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith('PAUSED'): break
    assert seen and seen[-1].startswith('PAUSED'), ''.join(seen) + p.stderr.read()
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    return p, ''.join(seen) + out, err


@pytest.mark.parametrize('sig, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_then_exits_and_the_run_resumes_exactly(work, sig, status):
    p, out, err = _stop_mid_fit(work, sig, 'run_dir=runs/stopped')
    assert p.returncode == status, out + err
    run_dir = work / 'work' / 'runs' / 'stopped'
    cks = sorted(x.name for x in run_dir.iterdir() if x.name.startswith('step-'))
    assert cks and 5 <= int(cks[-1][5:]) < 24, cks                      # saved mid-fit, where it stopped
    if sig == signal.SIGTERM:
        assert f'stopped by SIGTERM; the run is saved in runs/stopped/{cks[-1]}' in out
    else:
        assert lines(err)[-1] == f'trainer-nb train: interrupted (SIGINT: saved runs/stopped/{cks[-1]} and stopped)'
    stopped = torch.load(work / 'work' / 'weights_stopped' / 'rank0.pt')   # (after_fit runs on a stop too)
    assert stopped['state']['step'] == int(cks[-1][5:])                 # saved at the step where the fit stopped
    # continue it, from the run directory (its config.json), without the pause
    r = run('train', 'runs/stopped', 'fit.resume=last', 'hooks=[{type: SaveWeights, out: weights_resumed}]',
            cwd=work / 'work')
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout)[0] == 'run directory: runs/stopped'
    # the same run, never stopped
    r = run('train', work / 'cfg' / 'reg.yaml', 'run_dir=runs/whole', 'hooks.0.out=weights_whole', cwd=work / 'work')
    assert r.returncode == 0, r.stderr
    resumed, whole = (torch.load(work / 'work' / w / 'rank0.pt') for w in ('weights_resumed', 'weights_whole'))
    assert resumed['state']['step'] == whole['state']['step'] == 24
    for k, v in whole['weights'].items(): assert torch.equal(resumed['weights'][k], v), k


@pytest.mark.parametrize('sig, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_without_checkpoints_still_exits_with_its_status(work, sig, status):
    p, out, err = _stop_mid_fit(work, sig, 'run_dir=null')
    assert p.returncode == status, out + err
    assert 5 <= torch.load(work / 'work' / 'weights_stopped' / 'rank0.pt')['state']['step'] < 24
    assert not (work / 'work' / 'runs').exists()
    if sig == signal.SIGINT:   # the fit ends after its batch; the line says where, and names no call of a notebook's
        assert re.fullmatch(r"trainer-nb train: interrupted: stopped (at epoch \d+ of 3, batch \d+ of 8|before epoch "
                            r"\d+ of 3) \(step \d+ of 24\); with no checkpoint, nothing to continue from",
                            lines(err)[-1]), err
