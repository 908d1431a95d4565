"The library's code as the notebooks export it: export cells of one idea, lines that fit, nothing unused."
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CELL = 80   # lines of an export cell
RULES = 'E501,E702,E703,F401,F811,F821'   # long lines, ';'-chained statements, unused imports, redefined or unknown names


def export_cells():
    for nb in sorted((ROOT / 'nbs').glob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and src.split('\n', 1)[0].strip().replace(' ', '') in ('#|export', '#|exporti'):
                yield nb.name, c.get('id'), src


def test_export_cells_are_short():
    cells = list(export_cells())
    assert len(cells) > 50   # the notebooks were found
    long = [f"{nb} cell {cid}: {len(src.splitlines())} lines" for nb, cid, src in cells
            if len(src.splitlines()) > MAX_CELL]
    assert not long, f"export cells over {MAX_CELL} lines (split them by idea):\n" + '\n'.join(long)


def all_block(path: Path) -> range:
    "The lines of the `__all__ = [...]` that nbdev writes (on lines as long as it likes)."
    lines = path.read_text().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('__all__')), None)
    if start is None: return range(0)
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(']'))
    return range(start + 1, end + 2)   # 1-based line numbers


def test_library_passes_ruff():
    out = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--select', RULES, '--line-length', '120',
                          '--output-format', 'json', '--exclude', 'trainer_nb/_modidx.py', 'trainer_nb'],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr   # 1: violations found, reported below
    found = [v for v in json.loads(out.stdout)
             if not (v['code'] == 'E501' and v['location']['row'] in all_block(Path(v['filename'])))]
    assert not found, '\n'.join(f"{Path(v['filename']).name}:{v['location']['row']}: {v['code']} {v['message']}"
                                for v in found)
