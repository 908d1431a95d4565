"""Render nbs/index.ipynb to README.md (Markdown, no Quarto): markdown cells as they are, code cells as Python
blocks followed by their text output and their PNG images (written to docs/images/). Cells marked `#| hide` are left out.
Links to other notebooks (`[tutorial](tutorial.ipynb)`, relative to nbs/ as they work in Jupyter) are made relative
to the repository root (`nbs/tutorial.ipynb`), so that they work on a forge and in a local clone alike.

Usage: python tools/render_readme.py [--check]   (--check: exit 1 if README.md is out of date)
"""
import base64, re, sys
from pathlib import Path
import nbformat

ROOT = Path(__file__).resolve().parent.parent

IMAGES = 'docs/images'   # where the images of cell outputs go, relative to the repository root

_NB_LINK = re.compile(r'\]\((?:\./)?([\w.-]+\.ipynb(?:#[^)\s]*)?)\)')

def _relink(md: str) -> str:
    "Links to notebooks beside index.ipynb, relative to the repository root."
    return _NB_LINK.sub(lambda m: f"](nbs/{m[1]})", md)

def _outputs(cell, stem: str):
    "The cell's outputs as Markdown blocks: text in a fence (consecutive texts together), PNG images as files."
    blocks, text, images = [], [], {}
    def flush():
        if ''.join(text).strip(): blocks.append("```\n" + ''.join(text).rstrip() + "\n```")
        text.clear()
    for o in cell.get('outputs', []):
        if o.output_type == 'stream': text.append(o.text if o.text.endswith('\n') else o.text + '\n'); continue
        if o.output_type not in ('execute_result', 'display_data'): continue
        data = o.get('data', {})
        if 'application/vnd.jupyter.widget-view+json' in data: continue   # a live widget: nothing to show in a file
        if 'image/png' in data:
            flush()
            name = f"{IMAGES}/{stem}-{len(images)}.png"
            images[name] = base64.b64decode(data['image/png'])
            blocks.append(f"![output]({name})")
        elif 'text/markdown' in data: flush(); blocks.append(data['text/markdown'])
        elif 'text/plain' in data: text.append(data['text/plain'] + '\n')
    flush()
    return blocks, images

def render(nb_path: Path = ROOT / 'nbs' / 'index.ipynb') -> tuple[str, dict]:
    "README text, and the images it links to (`{path: bytes}`)."
    nb = nbformat.read(nb_path, as_version=4)
    out, images = [], {}
    for i, c in enumerate(nb.cells):
        src = c.source.strip('\n')
        lines = src.splitlines()
        if any(l.strip().replace(' ', '') in ('#|hide', '#|hide_input') for l in lines[:3]): continue
        if c.cell_type == 'markdown': out.append(_relink(src))
        elif c.cell_type == 'code':
            code = '\n'.join(l for l in lines if not l.startswith('#|'))
            out.append(f"```python\n{code}\n```")
            blocks, imgs = _outputs(c, f"readme-{i}")
            out += blocks; images.update(imgs)
    return '\n\n'.join(out) + '\n', images

def main():
    (text, images), readme = render(), ROOT / 'README.md'
    if '--check' in sys.argv:
        stale = [p for p, b in images.items() if not (ROOT / p).exists() or (ROOT / p).read_bytes() != b]
        if not readme.exists() or readme.read_text() != text or stale:
            print("README.md is out of date with nbs/index.ipynb: run `python tools/render_readme.py`")
            sys.exit(1)
        return
    for old in (ROOT / IMAGES).glob('readme-*.png'): old.unlink()
    for p, b in images.items():
        (ROOT / p).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / p).write_bytes(b)
    readme.write_text(text)

if __name__ == '__main__': main()
