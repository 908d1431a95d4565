"""Build the docs site into _docs/: nbdev processes the notebooks (show_doc output, hidden cells, directives) into
_proc/, then Sphinx with myst-nb and the furo theme renders them to HTML with navigation and search.

Usage: python tools/build_docs.py [--strict]   (--strict: warnings are errors)
"""
import json, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def add_toctree(index: Path, names: list[str]):
    "Append a hidden table of contents to the processed home page (not to its source: that is also the README)."
    nb = json.loads(index.read_text())
    body = '\n'.join([':hidden:', ':maxdepth: 1', '', *names])
    nb['cells'].append({'cell_type': 'markdown', 'metadata': {}, 'source': f"```{{toctree}}\n{body}\n```"})
    index.write_text(json.dumps(nb, indent=1))

def _text(x): return ''.join(x) if isinstance(x, list) else x

def tidy(proc: Path, doc_host: str) -> list[str]:
    """Make nbdev's processed notebooks Sphinx pages: front matter (a raw YAML cell, for Quarto) becomes a title and
    a lead line, pages take the name nbdev gave their HTML file, links to symbols become relative, and show_doc
    output loses its leading rule and its link to a source host. Returns the page names in order."""
    import re, yaml
    names = []
    for src in sorted(proc.glob('*.ipynb')):
        nb = json.loads(src.read_text())
        cells, fm = nb['cells'], {}
        if cells and cells[0]['cell_type'] == 'raw' and _text(cells[0]['source']).startswith('---'):
            fm = yaml.safe_load(_text(cells[0]['source']).strip().strip('-')) or {}
            title = str(fm.get('title', src.stem)).lstrip('# ').strip()
            lead = f"\n\n> {fm['description']}" if fm.get('description') else ''
            cells[0] = {'cell_type': 'markdown', 'metadata': {}, 'source': f"# {title}{lead}"}
        for c in cells:
            if c['cell_type'] == 'markdown': c['source'] = _text(c['source']).replace(doc_host, '')
            if c['cell_type'] == 'code':   # Quarto's cell directives, as myst-nb tags
                lines = _text(c['source']).splitlines()
                if any(l.replace(' ', '') == '#|echo:false' for l in lines):
                    c.setdefault('metadata', {}).setdefault('tags', []).append('remove-input')
                c['source'] = '\n'.join(l for l in lines if not l.startswith('#|'))
            for o in c.get('outputs', []):
                md = o.get('data', {}).get('text/markdown')
                if md is None: continue
                md = re.sub(r'^\s*---\s*\n', '', _text(md))
                md = re.sub(r'\[source\]\([^)]*\)\{[^}]*\}\s*', '', md)
                o['data']['text/markdown'] = md.replace(doc_host, '')
        keep = {'cell_type', 'id', 'metadata', 'source', 'outputs', 'execution_count', 'attachments'}
        for i, c in enumerate(cells):   # only the fields the notebook format allows
            for k in set(c) - keep: del c[k]
            c.setdefault('id', f"c{i:04d}")
            if c['cell_type'] != 'code': c.pop('outputs', None); c.pop('execution_count', None)
        name = Path(fm.get('output-file', src.stem + '.html')).stem
        src.unlink()
        (proc / f"{name}.ipynb").write_text(json.dumps(nb, indent=1))
        if src.stem != 'index': names.append(name)
    return names

def main():
    from nbdev.serve import proc_nbs
    import os
    os.chdir(ROOT)
    shutil.rmtree(ROOT / '_proc', ignore_errors=True)
    proc = Path(proc_nbs(force=True, n_workers=1))
    from nbdev.config import get_config
    cfg = get_config()
    add_toctree(proc / 'index.ipynb', tidy(proc, cfg.doc_host.rstrip('/') + cfg.doc_baseurl))
    out = ROOT / '_docs'
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, '-m', 'sphinx', '-b', 'html', '-q', '-c', str(ROOT / 'docs'), str(proc), str(out)]
    if '--strict' in sys.argv: cmd.insert(3, '-W')
    subprocess.run(cmd, check=True)
    print(f"docs site: {out / 'index.html'}")

if __name__ == '__main__': main()
