"""The docs site as a reader sees it: served on 127.0.0.1 and opened in headless Chromium. Every page loads without a
request to any other host and without a broken internal link; the LR finder page and the tutorial show images;
search finds `lr_find`, and gives the tutorial first for 'hook'; math is rendered. Code fits its column at 1400 px
and nothing is cut off at 400 px; every API entry shows its true signature, and the trainer's have parameter tables."""
import functools, http.server, importlib, inspect, re, threading
from pathlib import Path
from urllib.parse import urlsplit, unquote

import pytest

from jupyter_lab import CHROMIUM, needs_browser, sync_playwright
from test_docs import module_of

ROOT = Path(__file__).resolve().parent.parent
# (in make test-py's one-process part, with test_docs.py: the docs site is built once, in one place)
pytestmark = pytest.mark.serial

ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
        '--disable-background-networking', '--disable-component-update', '--disable-sync',
        '--disable-default-apps', '--disable-extensions']


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
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = b.new_page(viewport={'width': 1280, 'height': 900})
            requests = []
            page.on('request', lambda r: requests.append(r.url))
            yield page, requests
        finally: b.close()


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
        page.goto(f"{base}/{name}", wait_until='networkidle')
        text = page.evaluate("""() => { const b = document.body.cloneNode(true);
                                        b.querySelectorAll('pre, script, style').forEach(e => e.remove());
                                        return b.innerText; }""")
        for raw in ('\\(', '\\[', '$$', '\\mathrm', '\\log_'): assert raw not in text, f"{raw} in the text of {name}"
    page.goto(f"{base}/lr_find.html", wait_until='networkidle')
    boxes = page.evaluate("() => Array.from(document.querySelectorAll('math')).map(m => m.getBoundingClientRect().width)")
    assert len(boxes) >= 5 and all(w > 0 for w in boxes), boxes


@needs_browser
def test_code_blocks_have_copy_buttons(site, browser):
    base, _ = site
    page, _ = browser
    page.goto(f"{base}/tutorial.html", wait_until='networkidle')
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
        page.goto(f"{base}/{name}", wait_until='networkidle')
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
        page.goto(f"{base}/{name}", wait_until='networkidle')
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
        page.goto(f"{base}/{name}", wait_until='networkidle')
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
    page.goto(f"{base}/core.html", wait_until='networkidle')
    fit = next(e['sig'] for e in _entries(page) if e['name'] == 'Trainer.fit')
    assert 'resume: str | os.PathLike | None = None' in fit, fit
    assert all(k in fit for k in ('limit_batches', 'overfit_batches', 'fast_dev_run')), fit
    page.goto(f"{base}/base.html", wait_until='networkidle')
    hook = next(e['sig'] for e in _entries(page) if e['name'] == 'Hook')
    assert hook.strip() == 'Hook()', hook        # Hook has no __init__: it takes no argument


@needs_browser
def test_parameter_tables_of_the_trainer(site, browser):
    """`Trainer`, `fit`, the `fit_*` shortcuts and `lr_find` have a table of their parameters: one row per parameter,
    in the signature's order, with its type, default and a meaning read from the docstrings."""
    base, _ = site
    page, _ = browser
    page.goto(f"{base}/core.html", wait_until='networkidle')
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
    page.goto(f"{base}/howto_write_a_hook.html", wait_until='networkidle')
    code = '\n'.join(page.eval_on_selector_all('article pre', 'els => els.map(e => e.textContent)'))
    assert 'class EpochLine(MainProcessHook):' in code and 'def after_epoch(self):' in code
    assert 'raise CancelFit()' in code and 'def state_dict(self)' in code
    page.goto(f"{base}/core.html", wait_until='networkidle')
    code = '\n'.join(page.eval_on_selector_all('article pre', 'els => els.map(e => e.textContent)'))
    assert 'class PrintMetrics(MainProcessHook):' in code
