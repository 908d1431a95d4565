"""The docs site: built from the notebooks, run, with a page per module and the tutorial first, every exported name
documented on its module's page, and nothing that needs the network (widget views, MathJax)."""
import base64, importlib, inspect, json, re
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# (in make test-py's one-process part, with test_docs_site.py: the docs site is built once, in one place)
pytestmark = pytest.mark.serial
MODULES = sorted(p.stem[3:] for p in (ROOT / 'nbs').glob('[0-9][0-9]_*.ipynb'))   # page names
MODULES_IN_ORDER = [p.stem[3:] for p in sorted((ROOT / 'nbs').glob('[0-9][0-9]_*.ipynb'))]


def module_of(page: str) -> str:
    "The module a page's notebook exports (its `#| default_exp`)."
    nb = next((ROOT / 'nbs').glob(f'[0-9][0-9]_{page}.ipynb'))
    return re.search(r'#\| default_exp ([\w.]+)', nb.read_text()).group(1)


class PageText(HTMLParser):
    "The entries of a page (headings, and show_doc's headings, which myst-nb renders as rubrics) and its code texts."
    def __init__(self, html: str):
        super().__init__()
        self.stack, self.entries, self.codes = [], [], []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ('h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'code') or (tag == 'p' and 'rubric' in (a.get('class') or '')):
            self.stack.append([tag, ''])
        elif tag == 'a' and 'headerlink' in (a.get('class') or ''): self.stack.append(['headerlink', ''])

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1][0] not in (tag, 'headerlink' if tag == 'a' else None): return
        kind, text = self.stack.pop()
        if kind == 'headerlink': return
        (self.codes if kind == 'code' else self.entries).append(text.strip())
        if self.stack: self.stack[-1][1] += text

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] != 'headerlink': self.stack[-1][1] += data


def test_docs_site_builds(docs_site):
    for m in MODULES: assert (docs_site / f"{m}.html").exists(), m
    home = (docs_site / 'index.html').read_text()
    for m in MODULES: assert f'href="{m}.html"' in home, f"{m} missing from the navigation"
    core = (docs_site / 'core.html').read_text()
    assert re.search(r'id="trainer">Trainer<', core)                             # show_doc output is there,
    assert re.search(r'id="trainer-describe-hooks">Trainer.describe_hooks<', core)  # methods of its parts included
    assert 'show_doc(' not in core and '#| ' not in core                        # ... without its input cells
    assert (docs_site / 'searchindex.js').exists()


def test_tutorial_is_the_first_page_after_home(docs_site):
    home = (docs_site / 'index.html').read_text()
    nav = re.findall(r'<a class="reference internal" href="([\w-]+\.html)"', home)
    assert nav and nav[0] == 'tutorial.html', nav
    assert nav.index('tutorial.html') < min(nav.index(f"{m}.html") for m in MODULES)
    assert re.search(r'<a class="next-page" href="tutorial.html"', home)   # "Next" from the home page


def test_sidebar_is_grouped(docs_site):
    """The sidebar of every page: Tutorials (the tutorial first), How-to (the `howto_*` notebooks), Reference (the
    modules, in their notebooks' order), and no entry set in bold (a title like `__main__` is text, not markup)."""
    howtos = sorted(p.stem for p in (ROOT / 'nbs').glob('howto_*.ipynb'))
    assert 'howto_write_a_hook' in howtos
    for page in docs_site.glob('*.html'):
        html = page.read_text()
        tree = re.search(r'<div class="sidebar-tree">(.*?)</div>', html, re.S)
        if tree is None: continue
        groups = re.findall(r'<span class="caption-text">([^<]+)</span></p>\s*<ul[^>]*>(.*?)</ul>', tree[1], re.S)
        names = {cap: [re.sub(r'\.html$', '', h) for h in re.findall(r'href="([\w-]+\.html|#)"', ul)]
                 for cap, ul in groups}
        assert list(names) == ['Tutorials', 'How-to', 'Reference'], (page.name, list(names))
        here = page.stem
        names = {cap: [here if n == '#' else n for n in ns] for cap, ns in names.items()}
        assert names['Tutorials'][0] == 'tutorial' and 'own_models' in names['Tutorials'], names
        assert names['How-to'] == howtos and names['Reference'] == MODULES_IN_ORDER, (page.name, names)
        assert '<strong>' not in tree[1] and '<b>' not in tree[1], page.name
        assert re.search(r'href="(main\.html|#)">__main__</a>', tree[1]), page.name


def test_pages_show_what_the_notebooks_draw(docs_site):
    "The notebooks ran: pages hold their images and tables, as static outputs (no widget views, nothing to fetch)."
    def images(page):   # image files, and pictures written into the page (the live plot's, the LR finder's records)
        return re.findall(r'<img [^>]*src="(_images/[^"]+|data:image/png;base64,[^"]+)"', (docs_site / page).read_text())
    def n_images(page): return len(images(page))
    for page in ('tutorial.html', 'lr_find.html', 'liveplot.html', 'recorder.html', 'index.html'):
        assert n_images(page) >= 1, f"no image on {page}"
    tutorial = (docs_site / 'tutorial.html').read_text()
    assert 'epoch' in tutorial and 'valid_loss' in tutorial and 'after_backward' in tutorial   # dashboard, describe_hooks
    assert re.search(r'stopped early \(crash\)', tutorial)                                      # the final dashboard
    for page in docs_site.glob('*.html'):
        html = page.read_text()
        assert 'application/vnd.jupyter.widget' not in html and 'require.js' not in html, page.name
        assert not re.search(r'<(script|link)[^>]+(src|href)="(https?:)?//', html), f"{page.name} loads from the network"
    for png in (docs_site / '_images').glob('*.png'): assert png.read_bytes()[:4] == b'\x89PNG'
    inline = [src for page in docs_site.glob('*.html') for src in images(page.name) if src.startswith('data:')]
    assert inline and all(base64.b64decode(src.split(',', 1)[1])[:4] == b'\x89PNG' for src in inline)


def test_math_is_mathml(docs_site):
    "Formulas are MathML, written at build time: no MathJax script, no LaTeX left in the page."
    html = (docs_site / 'lr_find.html').read_text()
    assert html.count('<math ') >= 5 and not re.search(r'<script[^>]*mathjax', html, re.I)
    assert '\\(' not in html and '\\log_{10}' not in html


def test_code_blocks_have_copy_buttons(docs_site):
    assert 'copybutton.js' in (docs_site / 'tutorial.html').read_text()
    assert (docs_site / '_static' / 'copybutton.js').exists()


def test_every_exported_name_is_documented_on_its_page(docs_site):
    """Each name in a module's `__all__`: a function or class has a docstring and an entry (show_doc) on the module's
    page; a constant is named, as code, in that page's prose."""
    missing, seen = [], set()
    for m in MODULES:
        if m == 'all': continue
        mod = importlib.import_module(f'trainer_nb.{module_of(m)}')
        page = PageText((docs_site / f"{m}.html").read_text())
        for name in mod.__all__:
            seen.add(name)
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                if not (obj.__doc__ or '').strip(): missing.append(f"{m}.{name}: no docstring")
                if name not in page.entries: missing.append(f"{m}.{name}: no entry (show_doc) on {m}.html")
            elif name not in page.codes: missing.append(f"{m}.{name}: a constant not named on {m}.html")
    assert not missing, '\n'.join(missing)
    everything = importlib.import_module('trainer_nb.all')
    assert set(everything.__all__) <= seen, set(everything.__all__) - seen


def test_readme_links_resolve():
    "The README's relative links (to notebooks, images) point at files of the repository."
    text = (ROOT / 'README.md').read_text()
    links = [l.split('#')[0] for l in re.findall(r'\]\(([^)\s]+)\)', text) if not re.match(r'[a-z]+:', l)]
    assert any(l == 'nbs/tutorial.ipynb' for l in links), links
    for l in links: assert (ROOT / l).exists(), l
