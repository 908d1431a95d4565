"""Render nbs/index.ipynb to README.md (Markdown, no Quarto): markdown cells as they are, code cells as Python
blocks followed by their text output. Cells marked `#| hide` are left out.

Usage: python tools/render_readme.py [--check]   (--check: exit 1 if README.md is out of date)
"""
import sys
from pathlib import Path
import nbformat

ROOT = Path(__file__).resolve().parent.parent

def _output_text(cell) -> str:
    parts = []
    for o in cell.get('outputs', []):
        if o.output_type == 'stream': parts.append(o.text)
        elif o.output_type in ('execute_result', 'display_data'):
            data = o.get('data', {})
            if 'text/markdown' in data: parts.append(data['text/markdown'])
            elif 'text/plain' in data: parts.append(data['text/plain'])
    return ''.join(p if p.endswith('\n') else p + '\n' for p in parts)

def render(nb_path: Path = ROOT / 'nbs' / 'index.ipynb') -> str:
    nb = nbformat.read(nb_path, as_version=4)
    out = []
    for c in nb.cells:
        src = c.source.strip('\n')
        lines = src.splitlines()
        if any(l.strip().replace(' ', '') in ('#|hide', '#|hide_input') for l in lines[:3]): continue
        if c.cell_type == 'markdown': out.append(src)
        elif c.cell_type == 'code':
            code = '\n'.join(l for l in lines if not l.startswith('#|'))
            out.append(f"```python\n{code}\n```")
            text = _output_text(c)
            if text.strip(): out.append(f"```\n{text.rstrip()}\n```")
    return '\n\n'.join(out) + '\n'

def main():
    text, readme = render(), ROOT / 'README.md'
    if '--check' in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            print("README.md is out of date with nbs/index.ipynb: run `python tools/render_readme.py`")
            sys.exit(1)
        return
    readme.write_text(text)

if __name__ == '__main__': main()
