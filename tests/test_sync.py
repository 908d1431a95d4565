"The committed library matches its notebooks: `nbdev_export` would change nothing in trainer_nb/."
import re
import shutil
import subprocess
from pathlib import Path

from conftest import REPO, VENV_BIN


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob('*'))
            if p.is_file() and '__pycache__' not in p.parts and p.suffix != '.pyc'}


def test_nbdev_export_changes_nothing(tmp_path):
    shutil.copy(REPO / 'settings.ini', tmp_path)
    ignore = shutil.ignore_patterns('__pycache__', '.ipynb_checkpoints', '_proc', '*.pyc')
    shutil.copytree(REPO / 'nbs', tmp_path / 'nbs', ignore=ignore)
    shutil.copytree(REPO / 'trainer_nb', tmp_path / 'trainer_nb', ignore=ignore)
    p = subprocess.run([str(VENV_BIN / 'nbdev_export')], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    exported, committed = _files(tmp_path / 'trainer_nb'), _files(REPO / 'trainer_nb')
    differ = sorted(f for f in exported if committed.get(f) != exported[f])
    assert not differ, f"nbdev_export changes these files in trainer_nb/ (run .venv/bin/nbdev_export): {differ}"


def test_every_module_has_its_notebook():
    "A module generated from a notebook that no longer exists is stale."
    stale = []
    for f in sorted((REPO / 'trainer_nb').glob('*.py')):
        m = re.search(r'File to edit: \.\./nbs/(\S+\.ipynb)', f.read_text())
        if m and not (REPO / 'nbs' / m.group(1)).exists(): stale.append(f"{f.name} (from {m.group(1)})")
    assert not stale, f"modules whose notebook is gone: {stale}"
