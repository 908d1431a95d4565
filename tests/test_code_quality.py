"""The library's code as the notebooks export it: export cells of one idea, functions short enough to read, a hook as one
class, lines that fit, nothing unused; imports that all point down (no cycle, none hidden in a function, no class loaded
by name); one definition per method."""
import ast, importlib, inspect, json, pkgutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CELL = 80   # lines of an export cell (a class may take one cell of its own however long)
MAX_FUNC = 60   # lines of a function or method, its `def` line to its last
RULES = 'E501,E702,E703,F401,F811,F821'   # long lines, ';'-chained statements, unused imports, redefined or unknown names


def export_cells():
    for nb in sorted((ROOT / 'nbs').glob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and src.split('\n', 1)[0].strip().replace(' ', '') in ('#|export', '#|exporti'):
                yield nb.name, c.get('id'), src


def one_class_cell(src: str) -> bool:
    "Whether the cell is one class and nothing else."
    body = ast.parse(src).body
    return len(body) == 1 and isinstance(body[0], ast.ClassDef)


def test_export_cells_are_short():
    """Every export cell holds one idea, in at most 80 lines; a class (a hook, the Trainer) is read as a whole, in one
    cell of its own however long: its methods are what must stay short (below)."""
    cells = list(export_cells())
    assert len(cells) > 50   # the notebooks were found
    long = [f"{nb} cell {cid}: {len(src.splitlines())} lines" for nb, cid, src in cells
            if len(src.splitlines()) > MAX_CELL and not one_class_cell(src)]
    assert not long, f"export cells over {MAX_CELL} lines (split them by idea):\n" + '\n'.join(long)


LONG_OK = {('core', 'Trainer.__init__')}   # the constructor: its arguments, one a line, with their meaning


def test_functions_are_short():
    "No function or method of the library over 60 lines: a long one is split into steps that have names."
    long = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            inner = node.body if isinstance(node, ast.ClassDef) else [node]
            for f in inner:
                if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)): continue
                qual = f"{node.name}.{f.name}" if f is not node else f.name
                n = f.end_lineno - f.lineno + 1
                if n > MAX_FUNC and (name, qual) not in LONG_OK: long.append(f"{name}.{qual}: {n} lines")
    assert not long, f"functions over {MAX_FUNC} lines:\n" + '\n'.join(long)


def hook_classes():
    "Every class of a trainer_nb module that is a `base.Hook` (itself excepted), once, in the module that defines it."
    import trainer_nb
    from trainer_nb.base import Hook
    for info in pkgutil.iter_modules(trainer_nb.__path__):
        if info.name in ('__main__', '_modidx', 'all'): continue
        mod = importlib.import_module(f'trainer_nb.{info.name}')
        for obj in vars(mod).values():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and issubclass(obj, Hook) and obj is not Hook:
                yield obj


def test_a_hook_is_one_class():
    """A hook reads as one class: its MRO holds no other class of its own module (no mixins written only to cut it into
    cells); `base.Hook` and `MainProcessHook` are what every hook derives from."""
    from trainer_nb.base import Hook
    classes = list(hook_classes())
    assert {'Recorder', 'Checkpoint', 'EarlyStopping', 'MetricsLog', 'MainProcessHook'} <= {c.__name__ for c in classes}
    split = []
    for cls in classes:
        own = [k.__name__ for k in cls.__mro__ if k.__module__ == cls.__module__ and k is not Hook]
        if len(own) > 1: split.append(f"{cls.__module__}.{cls.__name__}: {own}")
    assert not split, "hook classes written in parts:\n" + '\n'.join(split)


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


# ---- the shape of the imports ----

LIB = ROOT / 'trainer_nb'
LAZY_OK = {'cli'}   # the command line defers the heavy imports, to answer --help fast


def lib_imports(path: Path):
    "`(module imported, line, inside a function?, names)` for each import of a trainer_nb module in `path`."
    tree = ast.parse(path.read_text())
    funcs = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1: mod = node.module or ''
            elif node.module and node.module.split('.')[0] == 'trainer_nb': mod = node.module.partition('.')[2]
            else: continue
            names = [a.name for a in node.names]
            if mod == '': mods = names                       # from . import x
            else: mods = [mod]
            for m in mods: yield m.split('.')[0], node.lineno, id(node) in funcs, names
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split('.')[0] == 'trainer_nb' and '.' in a.name:
                    yield a.name.split('.')[1], node.lineno, id(node) in funcs, []


def modules():
    return {p.stem: p for p in sorted(LIB.glob('*.py')) if p.stem not in ('_modidx', '__init__', '__main__', 'all')}


def test_imports_point_down():
    "No cycle among the modules, no trainer_nb import inside a function (the CLI aside), no private name imported."
    mods = modules()
    graph, inside, private = {}, [], []
    for name, path in mods.items():
        graph[name] = set()
        for m, line, in_func, names in lib_imports(path):
            if m not in mods: continue
            graph[name].add(m)
            if in_func and name not in LAZY_OK: inside.append(f"{name}.py:{line} imports {m} inside a function")
            private += [f"{name}.py:{line} imports {m}.{n}" for n in names if n.startswith('_')]
    assert not inside, '\n'.join(inside)
    assert not private, '\n'.join(private)
    cycles, state = [], {}
    def visit(n, path):
        state[n] = 'open'
        for m in sorted(graph[n]):
            if state.get(m) == 'open': cycles.append(' -> '.join(path[path.index(m):] + [m]))
            elif m not in state: visit(m, path + [m])
        state[n] = 'done'
    for n in sorted(graph):
        if n not in state: visit(n, [n])
    assert not cycles, 'import cycles:\n' + '\n'.join(cycles)
    assert graph['base'] == set(), graph['base']                           # the ground floor imports nothing of ours
    above = {'core', 'registry', 'cli', 'launch', 'search'}   # (search builds trainers, from configs too)
    low = [f"{n} imports {sorted(graph[n] & above)}" for n in graph if n not in above and graph[n] & above]
    assert not low, 'a feature module imports core or what sits above it:\n' + '\n'.join(low)


FEATURES = ('recorder', 'progress', 'liveplot', 'hooks', 'inside', 'checkpoint', 'lr_find', 'trackers', 'runs',
            'background', 'adapters', 'workflow', 'monitor', 'registry', 'cli', 'launch', 'demo', 'metrics', 'schedule')


ROOMS = ('control', 'hookset', 'state', 'forward', 'evaluation', 'devices')   # the loop's rooms, on the floor below it


def test_the_loop_imports_only_base():
    """`trainer_nb/loop.py` sits on the floor above `base`: of the package's modules it imports `base` and its own
    rooms (what other threads ask of a fit, the hooks, the state, evaluation, the devices), each of which imports
    `base` and other rooms only; and no feature module is named in its code: no import of one (at the top or in a
    function, absolute or relative) and no `trainer_nb.<feature>` in a string other than a docstring (a module looked up
    by name, `sys.modules[...]`). The features reach the loop through what hooks declare (`base.Hook`) and what
    `core.Trainer` gives it."""
    path = LIB / 'loop.py'
    tree = ast.parse(path.read_text())
    ours = {m for m, *_ in lib_imports(path)}
    assert ours == {'base', *ROOMS}, f"loop.py imports {sorted(ours)} of the package: base and its rooms only"
    for room in ROOMS:
        theirs = {m for m, *_ in lib_imports(LIB / f'{room}.py')}
        assert theirs <= {'base', *ROOMS}, f"{room}.py imports {sorted(theirs)}: base and the loop's rooms only"
    named = []
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            named += [f"line {node.lineno}: imports {m}" for m in mods for f in FEATURES
                      if f in m.split('.') and (m.startswith('trainer_nb') or getattr(node, 'level', 0))]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            named += [f"line {node.lineno}: {node.value!r}" for f in FEATURES if f"trainer_nb.{f}" in node.value]
    assert not named, "loop.py names feature modules:\n" + '\n'.join(named)


def test_no_class_loaded_by_name():
    "No importlib / __import__ on our own modules: classes are imported, not named in strings (registry imports the user's modules that a config names)."
    found = []
    for name, path in modules().items():
        if name == 'registry': continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, 'id', '')
                if fname in ('import_module', '__import__'): found.append(f"{name}.py:{node.lineno}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith('trainer_nb.') \
                    and ':' in node.value:
                found.append(f"{name}.py:{node.lineno} names {node.value!r}")
    assert not found, '\n'.join(found)


def test_trainer_methods_defined_once():
    "None of the loop's methods is defined in more than one class of the Trainer's MRO (no override chains)."
    from trainer_nb.core import Trainer
    for m in ('fit', 'state_dict', 'load_state_dict', 'describe_hooks', 'evaluate', 'backward', 'optimizer_step',
              'zero_grad', 'log', 'temporary'):
        owners = [c.__name__ for c in Trainer.__mro__ if m in vars(c)]
        assert len(owners) == 1, f"Trainer.{m} is defined in {owners}"


def _class_lines(path) -> dict:
    return {n.name: n.end_lineno - n.lineno + 1 for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def test_rooms_stay_small():
    """The loop is about the loop: the `Loop` class under 350 lines and loop.py under 800 (what is not the loop lives in
    its rooms); no other class of the package over 400 lines and no module over 720 (the LR finder, the checkpoints
    and the live plot's JavaScript have rooms of their own: loop.py is the largest)."""
    loop = _class_lines(LIB / 'loop.py')['Loop']
    assert loop < 350, f"Loop is {loop} lines: move what is not the loop to a room of its own"
    n = len((LIB / 'loop.py').read_text().splitlines())
    assert n < 800, f"loop.py is {n} lines"
    big = [f"{name}.{c}: {k} lines" for name, path in modules().items() for c, k in _class_lines(path).items() if k > 400]
    assert not big, big
    long = [f"{name}.py: {k} lines" for name, path in modules().items()
            if (k := len(path.read_text().splitlines())) > 720]
    assert not long, long


FEATURE_ROOMS = {   # a feature's rooms, on the floors below it: each imports only what sits below it
    'lr_find': {'lr_suggest': set(), 'lr_widget': {'lr_suggest'}},   # the suggestions and the reading; the widget
    'checkpoint': {'rundir': set()},                                # the run's directory: files, config, lock
    'liveplot': {'liveplot_js': set()},                             # the JavaScript the browser draws with
    'search': {'search_space': set()},                              # what a search tries: ranges, choices
}


def test_feature_rooms_sit_below_their_feature():
    """The LR finder's rooms (its suggestions, `lr_suggest`; its widget, `lr_widget`), the checkpoints' (the run
    directory, `rundir`), the live plot's (its JavaScript, `liveplot_js`) and the search's (its space, `search_space`)
    import `base` and the rooms below them only, never the feature they serve (which imports them), so each reads on
    its own; the feature imports each of its rooms."""
    wrong = []
    for feature, rooms in FEATURE_ROOMS.items():
        theirs = {m for m, *_ in lib_imports(LIB / f'{feature}.py')}
        wrong += [f"{feature}.py does not import its room {r}" for r in rooms if r not in theirs]
        for room, below in rooms.items():
            imports = {m for m, *_ in lib_imports(LIB / f'{room}.py')}
            if not imports <= {'base', *below}:
                wrong.append(f"{room}.py imports {sorted(imports - {'base', *below})}: only base and {sorted(below)}")
    assert not wrong, '\n'.join(wrong)


SHADOWED = {'suggest'}   # in trainer_nb.all, `suggest` is the search's (trainer_nb.search, imported after lr_find)


def test_moved_names_still_import_from_where_they_were():
    """What moved to a room stays importable from the module it was in (`from trainer_nb.lr_find import LRFindWidget`,
    `from trainer_nb.checkpoint import RunDir`) and from `trainer_nb.all`, as the same object."""
    import trainer_nb.all as tall
    for feature, rooms in FEATURE_ROOMS.items():
        old = importlib.import_module(f'trainer_nb.{feature}')
        for room in rooms:
            mod = importlib.import_module(f'trainer_nb.{room}')
            for name in mod.__all__:
                assert getattr(old, name, None) is getattr(mod, name), f"trainer_nb.{feature}.{name}"
                assert name in tall.__all__, f"trainer_nb.all.{name}"
                if name not in SHADOWED: assert getattr(tall, name) is getattr(mod, name), f"trainer_nb.all.{name}"
