"""Build the docs site into _docs/.

1. Run: every notebook of nbs/ is executed in a Jupyter kernel, as a reader running it in JupyterLab would, into
   _exec/ (the committed notebooks carry no outputs: see nbs/index.ipynb). A notebook is run again only when it or
   the library changed since its last run (`--no-cache` runs them all).
2. Process: nbdev turns the executed notebooks into pages (show_doc output, hidden cells, directives) in _proc/.
3. Tidy: the pages become Sphinx pages; widgets, which need JavaScript from the network, give way to the static
   form each output carries (a PNG, HTML), and links between notebooks become links between pages. Each show_doc
   entry gets the true signature (`inspect.signature`) and a table of its parameters (name, type, default and the
   meaning its docments comment or numpy-style "Parameters" section gives).
4. Render: Sphinx with myst-nb and the furo theme, with navigation and search, into _docs/.

Usage: python tools/build_docs.py [--strict] [--no-cache] [--run-only]
  --strict: Sphinx warnings are errors.
  --run-only: step 1 alone, every notebook run again (`make test-nbs`: a notebook that fails to run fails the
  tests); the runs stay in _exec/, where the next build finds them up to date instead of running them again.
"""
import hashlib, importlib, inspect, json, os, re, shutil, subprocess, sys, tempfile, time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXEC = ROOT / '_exec'      # executed copies of the notebooks (a cache: not committed)
WIDGET = 'application/vnd.jupyter.widget-view+json'
STATIC = ('image/png', 'image/jpeg', 'image/svg+xml', 'text/html', 'text/markdown', 'text/latex')
SIG_WIDTH = 88             # signatures are wrapped to lines this long (code blocks fit the page without a scroll)
SKIP_FLAGS = ('notest', 'slow')   # cells nbdev_test skips (settings.ini's tst_flags) are not run for the docs either

def _text(x): return ''.join(x) if isinstance(x, list) else x

# ---- 1. run ----

RUN_VERSION = '1'   # change it when the way notebooks are run changes: every cached run is then stale

def _library_digest() -> str:
    "A digest of the library's code (and of `RUN_VERSION`): a change runs every notebook again."
    h = hashlib.sha256(RUN_VERSION.encode())
    for p in sorted((ROOT / 'trainer_nb').glob('*.py')): h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()

def _key(nb: dict, lib: str) -> str:
    "Cache key of a notebook: its cells' sources and the library."
    h = hashlib.sha256(lib.encode())
    for c in nb['cells']: h.update(c['cell_type'].encode() + _text(c['source']).encode() + b'\0')
    return h.hexdigest()

def _directives(src: str) -> set:
    return {l[3:].strip().split(':')[0].split()[0] for l in src.splitlines() if l.startswith('#| ') and l[3:].strip()}

def _run_one(src: str, dest: str, cwd: str, key: str, timeout: int, threads: int = 0) -> float:
    "Execute notebook `src` in a fresh kernel started in `cwd`; write it, outputs included, to `dest`."
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(src, as_version=4)
    nb.metadata.pop('widgets', None)   # a saved widget state: the pages show outputs, and nbdev can't read every state
    for c in nb.cells:
        if c.cell_type == 'code' and _directives(c.source) & set(SKIP_FLAGS):
            c.metadata.setdefault('tags', []).append('skip-execution')
    with tempfile.TemporaryDirectory() as ipdir:
        # the kernel draws with the inline backend (as in JupyterLab), in no one's IPython profile
        env = dict(os.environ, MPLBACKEND='module://matplotlib_inline.backend_inline', IPYTHONDIR=ipdir,
                   PYTHONWARNINGS='ignore')
        if threads: env.setdefault('OMP_NUM_THREADS', str(threads))
        client = NotebookClient(nb, timeout=timeout, kernel_name='python3', store_widget_state=False,
                                record_timing=False, resources={'metadata': {'path': cwd}})
        t0 = time.perf_counter()
        with open(Path(ipdir) / 'kernel.log', 'w+') as log:   # the kernel's own messages: shown if it fails
            try: client.execute(cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
            except Exception as e:
                log.seek(0)
                raise RuntimeError(f"{e}\n(kernel log:)\n{log.read()[-3000:]}") from None
    nb.metadata['trainer_nb_docs'] = {'key': key}
    nbformat.write(nb, dest)
    return time.perf_counter() - t0

# the notebooks that take longest to run, with their seconds (two kernels at a time on 2 cores, quiet)
LONGEST = {'howto_search_hyperparameters.ipynb': 49, 'tutorial.ipynb': 25, '22_hyperparameter_search.ipynb': 19,
           '04_liveplot.ipynb': 17, 'own_models.ipynb': 17, '00_core.ipynb': 16, '12_launch.ipynb': 16,
           '10_cli.ipynb': 15, 'index.ipynb': 15, '15_workflow.ipynb': 15}

def execute(src: Path, dest: Path, workers: int = 2, cache: bool = True, timeout: int = 600) -> dict:
    """Execute the notebooks of `src` into `dest` (other files are copied), `workers` kernels at a time; a notebook
    whose cached run in `dest` is up to date is kept. Returns `{name: seconds}` of those that ran.
    The kernels share the cores: each gets its part of them for PyTorch's threads (`OMP_NUM_THREADS`, unless the
    environment sets it). With every kernel's team as large as the machine, two kernels on 2 cores took 84 s for
    00_core and the tutorial together, against 32 s with one thread each: OpenMP's threads wait for each other
    spinning, and the other kernel's threads hold the cores they wait for."""
    dest.mkdir(exist_ok=True)
    for p in dest.iterdir():     # what is no longer in the source goes
        if not (src / p.name).exists(): shutil.rmtree(p) if p.is_dir() else p.unlink()
    lib, todo = _library_digest(), []
    for p in sorted(src.iterdir()):
        if p.name.startswith('.'): continue
        if p.suffix != '.ipynb':
            if p.is_dir(): shutil.copytree(p, dest / p.name, dirs_exist_ok=True)
            else: shutil.copy2(p, dest / p.name)
            continue
        key, out = _key(json.loads(p.read_text()), lib), dest / p.name
        if cache and out.exists():
            meta = json.loads(out.read_text()).get('metadata', {})
            if meta.get('trainer_nb_docs', {}).get('key') == key: continue
        out.unlink(missing_ok=True)
        todo.append((str(p), str(out), str(dest), key, timeout))
    # the longest first (a quiet run's seconds), then the others by size: the last to start are short
    todo.sort(key=lambda a: (-LONGEST.get(Path(a[0]).name, 0), -Path(a[0]).stat().st_size))
    times = {}
    if not todo: return times
    n = min(workers, len(todo))
    threads = max(1, len(os.sched_getaffinity(0)) // n)
    with ProcessPoolExecutor(n, mp_context=get_context('spawn')) as ex:
        futs = {Path(a[0]).name: ex.submit(_run_one, *a, threads) for a in todo}
        errors = []
        for name, f in futs.items():
            try: times[name] = f.result()
            except Exception as e: errors.append(f"{name}: {e}")
    if errors: raise RuntimeError("Notebooks failed to run for the docs:\n" + '\n'.join(errors))
    return times

# ---- 2. process ----

def _mixed(cell) -> bool:
    "A cell that is not exported and holds imports beside other code (an example that imports what it uses)."
    import ast
    if cell.cell_type != 'code' or {'export', 'exports'} & set(cell.directives_): return False
    try: body = ast.parse('\n'.join(l for l in cell.source.splitlines() if not l.lstrip().startswith(('%', '!'))))
    except SyntaxError: return False
    imports = [isinstance(n, (ast.Import, ast.ImportFrom)) for n in body.body]
    return any(imports) and not all(imports)

def process(src: Path, dest: Path) -> Path:
    """nbdev's processing of the notebooks that ran (`src`) for their pages, into `dest` (other files are copied):
    front matter, `show_doc` cells (those written, and those nbdev adds for exported names without one) shown as their
    output, hidden cells and directives, links to symbols. nbdev runs each notebook's imports, exported code and
    `show_doc` cells in a shell of its own for their output; it runs the cells that import beside other code too
    (examples, which train): those are left out here (they ran in the notebook's kernel, and define no name that a
    `show_doc` shows: a `show_doc` of a name they defined fails the build). In this process, not in processes started
    for it: 5 s, against 45 s for nbdev's `proc_nbs`."""
    from execnb.nbio import read_nb, write_nb
    from nbdev.processors import FilterDefaults, exec_show_docs

    class ShowDocs(exec_show_docs):
        def __call__(self, cell):
            if not _mixed(cell): super().__call__(cell)

    class Filters(FilterDefaults):
        def base_procs(self): return [ShowDocs if p is exec_show_docs else p for p in super().base_procs()]

    shutil.rmtree(dest, ignore_errors=True)
    for p in sorted(src.rglob('*')):
        rel = p.relative_to(src)
        if not p.is_file() or any(part.startswith('.') for part in rel.parts): continue
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix != '.ipynb': shutil.copy2(p, out); continue
        nb = read_nb(p)
        Filters()(nb)
        write_nb(nb, out)
    return dest

# ---- 3. tidy ----

def static_outputs(nb: dict) -> int:
    """Keep the static form of widget outputs: a widget view needs JavaScript from the network, so it is dropped in
    favour of the PNG or HTML the output also carries; an output that has none (a closed progress bar, whose only other
    form is a `repr` like 'HBox(children=...)') goes. Returns the number of outputs dropped."""
    dropped = 0
    nb.get('metadata', {}).pop('widgets', None)   # the widget state: myst-nb would load the widget manager for it
    for c in nb['cells']:
        outs = []
        for o in c.get('outputs', []):
            data = o.get('data', {})
            if WIDGET in data:
                del data[WIDGET]
                if not any(m in data for m in STATIC): dropped += 1; continue
            outs.append(o)
        if 'outputs' in c: c['outputs'] = outs
    return dropped

_LINK = re.compile(r'\]\((?:\./)?([\w.-]+)\.ipynb(#[^)\s]*)?\)')
_SYMBOL_LINK = re.compile(r'\[(`[^`\]]+`)\]\(([\w-]+)\.html#([^)\s]+)\)')
_SHOW_DOC = re.compile(r'^\s*show_doc\(\s*([\w.]+)\s*[,)]')

def _relink(md: str, pages: dict) -> str:
    "Links to notebooks (`](05_lr_find.ipynb#x)`, as they work in Jupyter and on a forge) become links to their pages."
    def sub(m): return f"]({pages[m[1]]}.html{m[2] or ''})" if m[1] in pages else m[0]
    return _LINK.sub(sub, md)

def _link_symbols(md: str, anchors: dict) -> str:
    """nbdev links each name in backticks to `page.html#name`: keep the links whose entry exists (a show_doc anchor),
    and leave the other names as plain code (private helpers, which have no entry)."""
    def sub(m):
        known = anchors.get(m[2])
        return m[0] if known is None or m[3] in known else m[1]
    return _SYMBOL_LINK.sub(sub, md)

def _show_doc_call(c: dict):
    "The match of `_SHOW_DOC` in a code cell (`m[1]`: the name shown), below the directives nbdev put on top of it."
    if c['cell_type'] != 'code': return None
    return _SHOW_DOC.match('\n'.join(l for l in _text(c['source']).splitlines() if not l.startswith('#|')))

def show_doc_anchors(nb: dict) -> set:
    """Give each show_doc entry the anchor nbdev's links point to (`#trainer.lr_find` for `show_doc(Trainer.lr_find)`);
    an entry shown twice (nbdev adds one for a function patched onto a class that the notebook documents by hand)
    keeps its last place. Returns the anchors."""
    entries = []
    for c in nb['cells']:
        m = _show_doc_call(c)
        outs = [o for o in c.get('outputs', []) if 'text/markdown' in o.get('data', {})]
        if m and outs: entries.append((m[1], c, outs[0]))
    anchors, last = set(), {}
    for name, c, o in entries: last[name] = o   # (by the name as written: `Search` and `search` are two entries)
    for name, c, o in entries:
        if last[name] is not o: c['outputs'].remove(o); continue
        name = name.lower()
        md = re.sub(r'^\s*---\s*\n', '', _text(o['data']['text/markdown']))   # (nbdev's leading rule)
        # (a plain name is already the id of the entry's heading: a second element with that id would be invalid)
        o['data']['text/markdown'] = md if re.fullmatch(r'[a-z0-9]+', name) else f'<a id="{name}"></a>\n\n' + md
        anchors.add(name)
    return anchors

# ---- 3b. signatures and parameter tables ----

def _default(v) -> str:
    "A default value as a reader would write it: a class or function by its shortest public dotted name."
    if not (inspect.isclass(v) or inspect.isfunction(v)): return repr(v)
    mod = getattr(v, '__module__', '') or ''
    parts = mod.split('.')
    for i in range(1, len(parts) + 1):   # torch.optim.adamw.AdamW -> torch.optim.AdamW
        m = sys.modules.get('.'.join(parts[:i]))
        if m is not None and getattr(m, v.__qualname__, None) is v: return f"{'.'.join(parts[:i])}.{v.__qualname__}"
    return v.__qualname__

def _anno(p) -> str:
    if p is inspect.Parameter.empty: return ''
    return p if isinstance(p, str) else inspect.formatannotation(p)

def _params(obj, name: str) -> list:
    "The parameters a caller passes: those of `inspect.signature`, less the `self` of a method shown as `Class.meth`."
    ps = list(inspect.signature(obj).parameters.values())
    if '.' in name and ps and ps[0].name in ('self', 'cls') and not inspect.ismethod(obj): ps = ps[1:]
    return ps

def signature_text(obj, name: str) -> str:
    "`name(...)` as `inspect.signature` has it, wrapped to `SIG_WIDTH` columns."
    P, parts, star = inspect.Parameter, [], False
    ps = _params(obj, name)
    for i, p in enumerate(ps):
        if p.kind is P.KEYWORD_ONLY and not star: parts.append('*'); star = True
        if p.kind is P.VAR_POSITIONAL: star = True
        a, d = _anno(p.annotation), '' if p.default is P.empty else _default(p.default)
        pre = '*' if p.kind is P.VAR_POSITIONAL else '**' if p.kind is P.VAR_KEYWORD else ''
        parts.append(pre + p.name + (f": {a}" if a else '') + ((' = ' if a else '=') + d if d else ''))
        last_positional = p.kind is P.POSITIONAL_ONLY and (i + 1 == len(ps) or ps[i + 1].kind is not P.POSITIONAL_ONLY)
        if last_positional: parts.append('/')
    ret = '' if inspect.isclass(obj) else _anno(inspect.signature(obj).return_annotation)
    ret = f" -> {ret}" if ret else ''
    one = f"{name}({', '.join(parts)}){ret}"
    if len(one) <= SIG_WIDTH: return one
    lines, cur = [], ''
    for part in parts:
        if cur and len(cur) + len(part) + 6 > SIG_WIDTH: lines.append(cur + ','); cur = ''
        cur = f"{cur}, {part}" if cur else part
    lines.append(cur)
    return f"{name}(\n" + '\n'.join('    ' + l for l in lines) + f"\n){ret}"

def _cell(s: str) -> str: return s.replace('|', '\\|').replace('\n', ' ')

def param_table(obj, name: str) -> str:
    """A markdown table of `obj`'s parameters (name, type, default, meaning), the meanings from its docments comments
    or numpy-style docstring; '' when none has a meaning."""
    from fastcore.docments import docments
    try: docs = docments(obj, args_kwargs=True, returns=False)   # (a class: its __init__'s)
    except Exception: return ''
    ps = _params(obj, name)
    if not any(docs.get(p.name) for p in ps): return ''
    P, rows = inspect.Parameter, ['| Parameter | Type | Default | Meaning |', '|---|---|---|---|']
    for p in ps:
        pre = '*' if p.kind is P.VAR_POSITIONAL else '**' if p.kind is P.VAR_KEYWORD else ''
        a, d = _anno(p.annotation), '' if p.default is P.empty else _default(p.default)
        rows.append(f"| `{pre}{p.name}` | {f'`{_cell(a)}`' if a else ''} | {f'`{_cell(d)}`' if d else ''} "
                    f"| {_cell(docs.get(p.name) or '')} |")
    return '\n'.join(rows)

def _namespace(stem: str) -> dict:
    "The names a notebook's show_doc calls see: the whole library's, its own module's first."
    ns = dict(vars(importlib.import_module('trainer_nb.all')))
    src = ROOT / 'nbs' / f"{stem}.ipynb"
    m = re.search(r'#\| default_exp ([\w.]+)', src.read_text()) if src.exists() else None
    if m: ns.update(vars(importlib.import_module(f"trainer_nb.{m[1]}")))
    return ns

def true_signatures(nb: dict, ns: dict) -> int:
    """Give each show_doc entry the signature `inspect.signature` reports (nbdev's own guesses a type from a default,
    `resume:NoneType=None`, and shows a class without an `__init__` as `(*args, **kwargs)`), and a parameter table.
    Returns the number of entries rewritten."""
    n = 0
    for c in nb['cells']:
        m = _show_doc_call(c)
        if not m: continue
        try:
            obj = ns[m[1].split('.')[0]]
            for part in m[1].split('.')[1:]: obj = getattr(obj, part)
            sig = signature_text(obj, m[1])
        except (KeyError, AttributeError, TypeError, ValueError): continue
        for o in c.get('outputs', []):
            md = o.get('data', {}).get('text/markdown')
            if md is None or '```python' not in _text(md): continue
            md = re.sub(r'```python\n.*?\n```', lambda _: f"```python\n{sig}\n```", _text(md), count=1, flags=re.S)
            # the docstring as it is written: nbdev sets its first source line (half a sentence, often) in italics
            md = re.sub(r'(```\n\n)\*([^\n]+)\*(\n|$)', r'\1\2\3', md, count=1)
            table = param_table(obj, m[1])
            o['data']['text/markdown'] = md.rstrip() + (f"\n\n{table}\n" if table else '\n')
            n += 1
    return n

def tidy(proc: Path, doc_host: str) -> tuple[list[str], list[str], list[str]]:
    """Make nbdev's processed notebooks Sphinx pages: front matter (a raw YAML cell, for Quarto) becomes a title and
    a lead line, pages take the name nbdev gave their HTML file, links to symbols and to notebooks become relative
    (and a link to a symbol with no entry plain code), widget outputs give way to their static form, and show_doc
    output loses its leading rule and its link to a source host, and gets an anchor and its true signature. Returns
    the page names in order, by kind: tutorials (notebooks with no number; the tutorial first), how-to guides
    (`howto_*` notebooks), then the modules."""
    import yaml
    nbs, pages = {}, {}
    for src in sorted(proc.glob('*.ipynb')):
        nb = json.loads(src.read_text())
        cells, fm = nb['cells'], {}
        if cells and cells[0]['cell_type'] == 'raw' and _text(cells[0]['source']).startswith('---'):
            fm = yaml.safe_load(_text(cells[0]['source']).strip().strip('-')) or {}
            title = str(fm.get('title', src.stem)).lstrip('# ').strip()
            title = re.sub(r'([_*])', r'\\\1', title)   # a title is text: `__main__` is not bold "main"
            lead = f"\n\n> {fm['description']}" if fm.get('description') else ''
            # `- keywords: a, b` in the first cell: main index entries, which the site's search ranks first
            words = [w.strip() for w in str(fm.get('keywords') or '').split(',') if w.strip()]
            # one directive (one target: search lists the page once), before the title (the target is the title)
            index = f"```{{index}} {', '.join('!' + w for w in words)}\n```\n\n" if words else ''
            cells[0] = {'cell_type': 'markdown', 'metadata': {}, 'source': f"{index}# {title}{lead}"}
        nbs[src] = nb
        pages[src.stem] = Path(fm.get('output-file', src.stem + '.html')).stem
    for src, nb in nbs.items(): true_signatures(nb, _namespace(src.stem))
    anchors = {pages[src.stem]: show_doc_anchors(nb) for src, nb in nbs.items()}
    def fix(md): return _link_symbols(_relink(md.replace(doc_host, ''), pages), anchors)
    guides, howtos, modules = [], [], []
    for src, nb in nbs.items():
        static_outputs(nb)
        nb.get('metadata', {}).pop('trainer_nb_docs', None)
        for c in nb['cells']:
            if c['cell_type'] == 'markdown': c['source'] = fix(_text(c['source']))
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
                o['data']['text/markdown'] = fix(md)
        keep = {'cell_type', 'id', 'metadata', 'source', 'outputs', 'execution_count', 'attachments'}
        for i, c in enumerate(nb['cells']):   # only the fields the notebook format allows
            for k in set(c) - keep: del c[k]
            c.setdefault('id', f"c{i:04d}")
            if c['cell_type'] != 'code': c.pop('outputs', None); c.pop('execution_count', None)
        name = pages[src.stem]
        src.unlink()
        (proc / f"{name}.ipynb").write_text(json.dumps(nb, indent=1))
        if src.stem == 'index': continue
        (modules if re.match(r'\d+_', src.stem) else howtos if src.stem.startswith('howto_') else guides).append(name)
    guides.sort(key=lambda g: (g != 'tutorial', g))   # the tutorial is the first thing to read
    return guides, sorted(howtos), modules

def add_toctree(index: Path, sections: list[tuple[str, list[str]]]):
    "Append hidden tables of contents, one per `(caption, page names)`, to the processed home page (not to its source)."
    nb = json.loads(index.read_text())
    for caption, names in sections:
        if not names: continue
        body = '\n'.join([':hidden:', f':caption: {caption}', ':maxdepth: 1', '', *names])
        nb['cells'].append({'cell_type': 'markdown', 'metadata': {}, 'source': f"```{{toctree}}\n{body}\n```"})
    index.write_text(json.dumps(nb, indent=1))

# ---- all four ----

def main():
    sys.path.insert(0, str(ROOT))   # this checkout's library, for the signatures
    from nbdev.config import get_config
    os.chdir(ROOT)
    t0 = time.perf_counter()
    run_only = '--run-only' in sys.argv
    times = execute(ROOT / 'nbs', EXEC, cache=not run_only and '--no-cache' not in sys.argv)
    for name, s in sorted(times.items(), key=lambda kv: -kv[1]): print(f"  ran {name}: {s:.0f} s")
    t1 = time.perf_counter()
    if run_only:
        print(f"{len(times)} notebooks ran without an error, each in a kernel of its own ({t1 - t0:.0f} s); "
              f"their runs are in {EXEC.relative_to(ROOT)}/")
        return
    proc = process(EXEC, ROOT / '_proc')
    cfg = get_config()
    guides, howtos, modules = tidy(proc, cfg.doc_host.rstrip('/') + cfg.doc_baseurl)
    add_toctree(proc / 'index.ipynb', [('Tutorials', guides), ('How-to', howtos), ('Reference', modules)])
    out = ROOT / '_docs'
    shutil.rmtree(out, ignore_errors=True)
    t2 = time.perf_counter()
    cmd = [sys.executable, '-m', 'sphinx', '-b', 'html', '-q', '-c', str(ROOT / 'docs'), str(proc), str(out)]
    if '--strict' in sys.argv: cmd.insert(3, '-W')
    subprocess.run(cmd, check=True)
    t3 = time.perf_counter()
    print(f"docs site: {out / 'index.html'} (run {t1 - t0:.0f} s, process {t2 - t1:.0f} s, render {t3 - t2:.0f} s)")

if __name__ == '__main__': main()
