"""The docs site as a reader sees it: served on 127.0.0.1 and opened in headless Chromium. Every page loads without a
request to any other host and without a broken internal link; the LR finder page and the tutorial show images;
search finds `lr_find`; math is rendered."""
import functools, http.server, re, threading
from pathlib import Path
from urllib.parse import urlsplit, unquote

import pytest

from jupyter_lab import CHROMIUM, needs_browser, sync_playwright

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
