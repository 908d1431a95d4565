"""The docs site: built from the notebooks, run, with a page per module and the tutorial first, every exported name
documented on its module's page, and nothing that needs the network (widget views, MathJax).

Then the site as a reader sees it, served on 127.0.0.1 and opened in headless Chromium: every page loads without a
request to any other host and without a broken internal link; the LR finder page and the tutorial show images;
search finds `lr_find`, and gives the tutorial first for 'hook'; math is rendered. Code fits its column at 1400 px
and nothing is cut off at 400 px; every API entry shows its true signature, and the trainer's have parameter tables."""
import base64, functools, http.server, importlib, inspect, re, threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit, unquote

import pytest

from jupyter_lab import needs_browser, shared_browser

ROOT = Path(__file__).resolve().parent.parent
# (one file: under make test-py's pytest-xdist, a file's tests run in one process, so the session's docs build, which
# writes into the checkout, is made once, in one place)
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


# ---- the site in a browser ----


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope='module')
def site(docs_site):
    "`(base_url, folder)`: the built site served on 127.0.0.1 from a thread."
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(_Quiet, directory=str(docs_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try: yield f"http://127.0.0.1:{server.server_address[1]}", docs_site
    finally: server.shutdown(); server.server_close()


@pytest.fixture(scope='module')
def browser(site):
    "A page in headless Chromium, and the list of every URL it requested."
    base, _ = site
    page = shared_browser().new_page(viewport={'width': 1280, 'height': 900})
    try:
        requests = []
        page.on('request', lambda r: requests.append(r.url))
        yield page, requests
    finally: page.close()


def _open(page, url):
    """Open a page of the site and wait for what it is laid out with: the page, its styles, images and fonts (not for
    half a second of no requests, `networkidle`, which the tests that check requests keep: 47 pages a test)."""
    page.goto(url, wait_until='load')
    page.evaluate("() => document.fonts.ready.then(() => true)")


def _outside(urls, base) -> list:
    return [u for u in urls if not (u.startswith(base + '/') or u.split(':')[0] in ('data', 'blob', 'about'))]


_IDS = {}
def _ids(path: Path) -> set:
    if path not in _IDS: _IDS[path] = set(re.findall(r'\b(?:id|name)="([^"]+)"', path.read_text()))
    return _IDS[path]


@needs_browser
def test_every_page_loads_locally_with_working_links(site, browser):
    base, folder = site
    page, requests = browser
    pages = sorted(p.name for p in folder.glob('*.html'))
    assert {'index.html', 'tutorial.html', 'lr_find.html', 'core.html', 'search.html'} <= set(pages)
    broken = []
    for name in pages:
        page.goto(f"{base}/{name}", wait_until='networkidle')
        assert page.title(), name
        for href in page.eval_on_selector_all('a[href]', 'els => els.map(e => e.href)'):
            u = urlsplit(href)
            if f"{u.scheme}://{u.netloc}" != base: continue        # a link elsewhere: not fetched by reading the page
            target = folder / unquote(u.path.lstrip('/'))
            if target.is_dir(): target = target / 'index.html'
            if not target.exists(): broken.append(f"{name}: {href} (no such page)")
            elif u.fragment and target.suffix == '.html' and unquote(u.fragment) not in _ids(target):
                broken.append(f"{name}: {href} (no such anchor)")
    assert not broken, '\n'.join(broken)
    assert len(requests) > len(pages) and not _outside(requests, base), _outside(requests, base)


@needs_browser
@pytest.mark.parametrize('name', ['lr_find.html', 'tutorial.html'])
def test_pages_show_loaded_images(site, browser, name):
    base, _ = site
    page, requests = browser
    page.goto(f"{base}/{name}", wait_until='networkidle')
    sizes = page.evaluate("""async () => {
        const imgs = Array.from(document.querySelectorAll('img'));
        await Promise.all(imgs.map(i => i.decode().catch(() => null)));
        return imgs.map(i => i.naturalWidth); }""")
    assert sum(w > 0 for w in sizes) >= 1, sizes
    assert all(w > 0 for w in sizes), f"an image of {name} did not load: {sizes}"
    assert not _outside(requests, base)


@needs_browser
def test_search_finds_lr_find_and_its_link_opens_it(site, browser):
    base, _ = site
    page, requests = browser
    page.goto(f"{base}/search.html?q=lr_find", wait_until='networkidle')
    page.wait_for_selector('#search-results li a', timeout=30_000)
    links = page.eval_on_selector_all('#search-results li a',
                                      'els => els.map(e => ({text: e.textContent, href: e.href}))')
    hits = [l for l in links if urlsplit(l['href']).path.endswith('/lr_find.html')]
    assert hits, links
    page.click(f"#search-results li a[href*='lr_find.html']")
    page.wait_for_load_state('networkidle')
    assert urlsplit(page.url).path.endswith('/lr_find.html')
    assert page.locator('h1').first.inner_text().startswith('lr_find')
    assert 'lr_find' in page.inner_text('article')
    assert not _outside(requests, base)


@needs_browser
def test_math_is_rendered(site, browser):
    "No LaTeX left in any page's text (code blocks aside); the LR finder's formulas are MathML the browser lays out."
    base, folder = site
    page, _ = browser
    for name in sorted(p.name for p in folder.glob('*.html')):
        _open(page, f"{base}/{name}")
        text = page.evaluate("""() => { const b = document.body.cloneNode(true);
                                        b.querySelectorAll('pre, script, style').forEach(e => e.remove());
                                        return b.innerText; }""")
        for raw in ('\\(', '\\[', '$$', '\\mathrm', '\\log_'): assert raw not in text, f"{raw} in the text of {name}"
    _open(page, f"{base}/lr_find.html")
    boxes = page.evaluate("() => Array.from(document.querySelectorAll('math')).map(m => m.getBoundingClientRect().width)")
    assert len(boxes) >= 5 and all(w > 0 for w in boxes), boxes


@needs_browser
def test_code_blocks_copy_buttons_show_in_the_browser(site, browser):
    base, _ = site
    page, _ = browser
    _open(page, f"{base}/tutorial.html")
    assert page.locator('button.copybtn').count() >= 10


# ---- what a reader of the API pages needs: code that fits, true signatures, parameter tables, a phone ----

def _pages(folder: Path) -> list:
    "The pages with content (not Sphinx's search and index pages)."
    return sorted(p.name for p in folder.glob('*.html') if p.name not in ('search.html', 'genindex.html'))


@pytest.fixture
def viewport(browser):
    "`set(width, height)` for the shared page; the size it had is put back afterwards."
    page, _ = browser
    before = page.viewport_size
    yield lambda w, h: page.set_viewport_size({'width': w, 'height': h})
    page.set_viewport_size(before)


@needs_browser
def test_code_fits_its_column_at_1400px(site, browser, viewport):
    """At 1400 px no code block (source or output) of any page scrolls sideways, and the column holds a 100-character
    line unwrapped (furo's own column holds about 90): code wraps only where a line is longer than that."""
    base, folder = site
    page, _ = browser
    viewport(1400, 900)
    scrolled, narrow = [], []
    for name in _pages(folder):
        _open(page, f"{base}/{name}")
        r = page.evaluate("""() => {
            const pres = Array.from(document.querySelectorAll('article pre'));
            if (!pres.length) return null;
            const probe = document.createElement('span');
            probe.textContent = 'x'.repeat(100);
            pres[0].appendChild(probe);
            const width = probe.getBoundingClientRect().width;
            probe.remove();
            const cs = getComputedStyle(pres[0]);
            return {room: pres[0].clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight),
                    width: width, n: pres.length,
                    scrolled: pres.filter(e => e.scrollWidth > e.clientWidth)
                                  .map(e => e.textContent.split('\\n')[0].slice(0, 60))}; }""")
        if r is None: continue
        scrolled += [f"{name}: {t}" for t in r['scrolled']]
        if r['room'] < r['width']: narrow.append(f"{name}: {r['room']:.0f} px for 100 characters ({r['width']:.0f} px)")
    assert not scrolled, '\n'.join(scrolled)
    assert not narrow, '\n'.join(narrow)


@needs_browser
def test_nothing_is_cut_off_at_phone_width(site, browser, viewport):
    """At 400 px no page scrolls sideways, nor does its column; whatever is wider than the screen (a code line, a
    table) scrolls inside its own box, and images shrink to the screen."""
    base, folder = site
    page, _ = browser
    viewport(400, 800)
    bad = []
    for name in _pages(folder):
        _open(page, f"{base}/{name}")
        r = page.evaluate("""() => {
            const d = document.documentElement, c = document.querySelector('.content'), right = d.clientWidth + 0.5;
            const cut = [];
            for (const el of document.querySelectorAll('article *')) {
                const b = el.getBoundingClientRect();
                if (b.width === 0 || b.right <= right) continue;
                let p = el.parentElement, boxed = false;
                for (; p && p.tagName !== 'ARTICLE'; p = p.parentElement) {
                    const ox = getComputedStyle(p).overflowX;
                    const scrolls = ox === 'auto' || ox === 'scroll';
                    if (scrolls && p.getBoundingClientRect().right <= right) { boxed = true; break; }
                }
                if (!boxed) cut.push(`${el.tagName.toLowerCase()}.${el.className} ends at ${Math.round(b.right)} px`);
            }
            return {page: d.scrollWidth - d.clientWidth, column: c.scrollWidth - c.clientWidth, cut: cut.slice(0, 5),
                    images: Array.from(document.querySelectorAll('article img')).length}; }""")
        if r['page'] > 0 or r['column'] > 0 or r['cut']:
            bad.append(f"{name}: page scrolls {r['page']} px, column {r['column']} px; cut off: {r['cut']}")
    assert not bad, '\n'.join(bad)


def _entries(page) -> list:
    "Each show_doc entry of the page open in `page`: its name, the text of its signature and its parameter table."
    return page.evaluate("""() => Array.from(document.querySelectorAll('article .cell_output p.rubric')).map(h => {
        let sig = null, table = null;
        for (let e = h.nextElementSibling; e && !e.matches('p.rubric'); e = e.nextElementSibling) {
            if (sig === null && e.querySelector('pre')) sig = e.querySelector('pre').textContent;
            const t = e.matches('table') ? e : e.querySelector('table');
            if (t && table === null) table = Array.from(t.querySelectorAll('tr'))
                .map(tr => Array.from(tr.children).map(td => td.textContent.trim()));
        }
        return {name: h.textContent.trim(), sig, table}; })""")


def _documented(page_name: str, name: str):
    "The object an entry of page `page_name` documents (`Trainer.fit`), from its module or the library; else None."
    spaces = [importlib.import_module('trainer_nb.all')]
    try: spaces.insert(0, importlib.import_module(f'trainer_nb.{module_of(page_name)}'))
    except StopIteration: pass   # a guide: no module of its own
    for ns in spaces:
        obj = ns
        try:
            for part in name.split('.'): obj = getattr(obj, part)
            return obj
        except AttributeError: continue
    return None


def _parameters(obj, name: str) -> list:
    "What a caller passes to `obj`, as `inspect.signature` has it (`self` left out of `Class.method`)."
    ps = list(inspect.signature(obj).parameters.values())
    if '.' in name and ps and ps[0].name == 'self': ps = ps[1:]
    return ps


TABLES = ['Trainer', 'Trainer.fit', 'Trainer.fit_one_cycle', 'Trainer.fit_cosine', 'Trainer.fit_constant',
          'Trainer.lr_find']


@needs_browser
def test_signatures_are_the_true_ones(site, browser):
    """Every entry's signature names the parameters `inspect.signature` gives, in order, with their annotations, and
    no others: no `*args, **kwargs` standing in for a class's real ones, no type guessed from a default."""
    base, folder = site
    page, _ = browser
    wrong, checked = [], 0
    for name in _pages(folder):
        _open(page, f"{base}/{name}")
        for e in _entries(page):
            obj = _documented(name[:-5], e['name'])
            try: ps = _parameters(obj, e['name'])
            except (TypeError, ValueError): continue   # no signature to compare with (an exception class)
            sig, at = ' '.join(e['sig'].split()), 0
            checked += 1
            for p in ps:
                star = '*' if p.kind is p.VAR_POSITIONAL else '**' if p.kind is p.VAR_KEYWORD else ''
                anno = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)
                want = f"{star}{p.name}" + (f": {anno}" if p.annotation is not p.empty else '')
                found = re.search(rf"(?<![\w.*]){re.escape(want)}(?![\w])", sig[at:])
                if not found: wrong.append(f"{name} {e['name']}: no `{want}` in order in {sig!r}"); break
                at += found.end()
            has_star = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps)
            if not has_star and re.search(r'\*args|\*\*kwargs', sig): wrong.append(f"{name} {e['name']}: {sig!r}")
            if 'NoneType' in sig: wrong.append(f"{name} {e['name']}: a type guessed from a default: {sig!r}")
    assert checked >= 100, checked
    assert not wrong, '\n'.join(wrong)
    _open(page, f"{base}/core.html")
    fit = next(e['sig'] for e in _entries(page) if e['name'] == 'Trainer.fit')
    assert 'resume: str | os.PathLike | None = None' in fit, fit
    assert all(k in fit for k in ('limit_batches', 'overfit_batches', 'fast_dev_run')), fit
    _open(page, f"{base}/base.html")
    hook = next(e['sig'] for e in _entries(page) if e['name'] == 'Hook')
    assert hook.strip() == 'Hook()', hook        # Hook has no __init__: it takes no argument


@needs_browser
def test_parameter_tables_of_the_trainer(site, browser):
    """`Trainer`, `fit`, the `fit_*` shortcuts and `lr_find` have a table of their parameters: one row per parameter,
    in the signature's order, with its type, default and a meaning read from the docstrings."""
    base, _ = site
    page, _ = browser
    _open(page, f"{base}/core.html")
    entries = {e['name']: e for e in _entries(page)}
    for name in TABLES:
        table = entries[name]['table']
        assert table and table[0] == ['Parameter', 'Type', 'Default', 'Meaning'], (name, table)
        ps = _parameters(_documented('core', name), name)
        stars = ['**' if p.kind is p.VAR_KEYWORD else '*' if p.kind is p.VAR_POSITIONAL else '' for p in ps]
        assert [r[0] for r in table[1:]] == [s + p.name for s, p in zip(stars, ps)], (name, table)
        for p, (_, kind, default, meaning) in zip(ps, table[1:]):
            assert meaning, f"{name}({p.name}): no meaning"
            if p.annotation is not p.empty: assert kind == p.annotation, (name, p.name, kind)
            if p.default is not p.empty and not inspect.isclass(p.default): assert default == repr(p.default)
    lr = dict((r[0], r) for r in entries['Trainer.fit']['table'][1:])['resume']
    assert lr[1] == 'str | os.PathLike | None' and lr[2] == 'None' and 'checkpoint' in lr[3], lr


@needs_browser
def test_search_gives_the_tutorial_first_for_hook(site, browser):
    "Searching the site for 'hook' (Sphinx's own search, in the browser) lists the tutorial first."
    base, _ = site
    page, _ = browser
    page.goto(f"{base}/search.html?q=hook", wait_until='networkidle')
    page.wait_for_function("() => (document.querySelector('#search-results p.search-summary') || {}).textContent"
                           "?.startsWith('Search finished')", timeout=30_000)
    links = page.eval_on_selector_all('#search-results li a', 'els => els.map(e => e.getAttribute("href"))')
    pages = [l.split('#')[0].split('?')[0] for l in links]
    assert pages and pages[0] == 'tutorial.html', links[:5]
    assert sum(l.startswith('tutorial.html#index') for l in links) == 1, links   # its keywords: one result, not one each
    assert any(l.startswith('howto_write_a_hook.html') for l in links), links


@needs_browser
def test_write_a_hook_shows_its_code(site, browser):
    "The how-to page shows the code of its hooks, and the core page the code of PrintMetrics ('a complete example')."
    base, _ = site
    page, _ = browser
    _open(page, f"{base}/howto_write_a_hook.html")
    code = '\n'.join(page.eval_on_selector_all('article pre', 'els => els.map(e => e.textContent)'))
    assert 'class EpochLine(MainProcessHook):' in code and 'def after_epoch(self):' in code
    assert 'raise CancelFit()' in code and 'def state_dict(self)' in code
    _open(page, f"{base}/core.html")
    code = '\n'.join(page.eval_on_selector_all('article pre', 'els => els.map(e => e.textContent)'))
    assert 'class PrintMetrics(MainProcessHook):' in code
