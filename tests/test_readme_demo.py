"The README is generated from nbs/index.ipynb, and the demo command it gives works."
import re, subprocess, sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def test_readme_matches_index_notebook():
    r = subprocess.run([sys.executable, 'tools/render_readme.py', '--check'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

def test_readme_gives_the_two_commands():
    text = (ROOT / 'README.md').read_text()
    assert 'make demo' in text and 'make test' in text
    make = (ROOT / 'Makefile').read_text()
    assert re.search(r'^demo:', make, re.M) and re.search(r'^test:', make, re.M)
    # CI runs the README's test command
    assert 'make test' in (ROOT / '.ci' / 'run').read_text()

def test_make_demo_runs_the_trainer_nb_command():
    make = (ROOT / 'Makefile').read_text()
    assert re.search(r'^demo:.*\n\t\$\(BIN\)/trainer-nb demo$', make, re.M)
    # one demo command: the retired one is named nowhere
    for f in [ROOT / 'README.md', ROOT / 'settings.ini', *(ROOT / 'nbs').glob('*.ipynb')]:
        assert 'trainer_nb_demo' not in f.read_text(), f


def test_demo_command_trains_to_high_accuracy(tmp_path):
    exe = Path(sys.executable).parent / 'trainer-nb'
    r = subprocess.run([str(exe), 'demo'], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    m = re.fullmatch(r'valid accuracy: (\d\.\d{4})', lines[-1])
    assert m and float(m.group(1)) >= 0.95, lines[-1]
    acc = float(m.group(1))
    assert lines[-2].startswith('valid loss: ')
    # the run directory it names, with what it wrote
    m = re.fullmatch(r'run directory: (runs/demo-\d{8}-\d{6})', lines[0])
    assert m, lines[0]
    run_dir = tmp_path / m.group(1)
    names = {p.name for p in run_dir.iterdir()}
    assert {'history.csv', 'loss_lr.png', 'lr_find.png', 'config.json', 'metrics.jsonl'} <= names, names
    assert 'step-00000115' in names                        # 5 epochs of 23 steps: the last checkpoint
    for png in ('loss_lr.png', 'lr_find.png'): assert (run_dir / png).read_bytes()[:4] == b'\x89PNG'
    history = (run_dir / 'history.csv').read_text().splitlines()
    assert history[0] == 'epoch,train_loss,valid_loss,accuracy,time' and len(history) == 6
    assert float(history[-1].split(',')[3]) == pytest.approx(acc, abs=1e-4)   # evaluate() agrees with the last epoch
    assert re.match(r'LR finder: valley \d\.\d\de-\d\d, .*(; using valley|, fallback \S+; using fallback)$',
                    lines[1]), lines[1]
    # the progress display's epoch table: a header and one row per epoch
    assert re.search(r'^\s*epoch\s+train_loss\s+valid_loss\s+accuracy\s+time', r.stdout, re.M), r.stdout
    assert len(re.findall(r'^\s*\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d\d:\d\d', r.stdout, re.M)) == 5, r.stdout


def test_demo_exits_1_below_the_accuracy_bar(tmp_path):
    exe = Path(sys.executable).parent / 'trainer-nb'
    r = subprocess.run([str(exe), 'demo', 'fit.epochs=1', 'fit.lr=1e-6', 'run_dir=null'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'is below --min-accuracy 0.95' in r.stderr, r.stderr
    assert r.stdout.splitlines()[-1].startswith('valid accuracy: 0.')


def test_demo_prints_its_config():
    import yaml
    from trainer_nb.demo import demo_config
    exe = Path(sys.executable).parent / 'trainer-nb'
    r = subprocess.run([str(exe), 'demo', '--print-config', 'fit.epochs=2'], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and yaml.safe_load(r.stdout) == {**demo_config(), 'fit': {'epochs': 2, 'lr': 'find'}}


def test_readme_config_is_the_demos_and_describes(tmp_path):
    "The README's YAML example is the demo's config, and `trainer-nb describe` takes it."
    import yaml
    from trainer_nb.demo import demo_config
    block = re.search(r'```yaml\n(# digits.yaml.*?)```', (ROOT / 'README.md').read_text(), re.S).group(1)
    assert yaml.safe_load(block) == demo_config()
    (tmp_path / 'digits.yaml').write_text(block)
    exe = Path(sys.executable).parent / 'trainer-nb'
    r = subprocess.run([str(exe), 'describe', 'digits.yaml', 'fit.epochs=10', 'model.hidden=256'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'digits_model hidden=256' in r.stdout and '10 epochs, lr find' in r.stdout, r.stderr
