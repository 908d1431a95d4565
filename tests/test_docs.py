"The docs site builds from the notebooks, with a page per module, the API entries and working navigation."
import re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def test_docs_site_builds():
    r = subprocess.run([sys.executable, 'tools/build_docs.py', '--strict'], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    site = ROOT / '_docs'
    modules = sorted(p.stem[3:] for p in (ROOT / 'nbs').glob('[0-9][0-9]_*.ipynb'))
    for m in modules: assert (site / f"{m}.html").exists(), m
    home = (site / 'index.html').read_text()
    for m in modules: assert f'href="{m}.html"' in home, f"{m} missing from the navigation"
    core = (site / 'core.html').read_text()
    assert re.search(r'id="trainer">Trainer<', core)                             # show_doc output is there,
    assert re.search(r'id="trainer-describe-hooks">Trainer.describe_hooks<', core)  # methods of its parts included
    assert 'show_doc(' not in core and '#| ' not in core                        # ... without its input cells
    assert (site / 'searchindex.js').exists()
