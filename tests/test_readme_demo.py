"The README is generated from nbs/index.ipynb, and the demo command it gives works."
import re, subprocess, sys
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

def test_demo_command_trains_to_high_accuracy():
    exe = Path(sys.executable).parent / 'trainer_nb_demo'
    r = subprocess.run([str(exe), '--epochs', '4', '--cpu'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r'digits: valid_loss ([\d.]+), accuracy ([\d.]+) \((\d+) validation images', r.stdout)
    assert m, r.stdout
    assert float(m.group(2)) > 0.9 and int(m.group(3)) == 359
    # the progress display's epoch table: a header and one row per epoch
    assert re.search(r'^\s*epoch\s+train_loss\s+valid_loss\s+accuracy\s+time', r.stdout, re.M), r.stdout
    assert len(re.findall(r'^\s*\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d\d:\d\d', r.stdout, re.M)) == 4, r.stdout

def test_demo_exits_nonzero_below_the_accuracy_bar():
    exe = Path(sys.executable).parent / 'trainer_nb_demo'
    r = subprocess.run([str(exe), '--epochs', '1', '--lr', '1e-6', '--cpu'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'below --min-accuracy' in r.stderr
