"Importing the library must not initialise CUDA (multi-GPU from a notebook needs CUDA untouched until launch)."
import json
import subprocess
import sys

from conftest import REPO

CHECK = r'''
import json, pkgutil, importlib, sys
import torch
calls = []
_init = torch.cuda._lazy_init
def _lazy_init(*a, **kw):
    import traceback; calls.append(''.join(traceback.format_stack(limit=8)))
    return _init(*a, **kw)
torch.cuda._lazy_init = _lazy_init
import trainer_nb, trainer_nb.core
mods = sorted(m.name for m in pkgutil.iter_modules(trainer_nb.__path__, 'trainer_nb.'))
for m in mods: importlib.import_module(m)
print(json.dumps({'initialized': torch.cuda.is_initialized(), 'lazy_init_calls': calls, 'modules': mods}))
'''


def test_import_does_not_initialise_cuda():
    p = subprocess.run([sys.executable, '-c', CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert 'trainer_nb.core' in r['modules']
    assert r['initialized'] is False
    assert r['lazy_init_calls'] == [], r['lazy_init_calls'][0]


def test_building_a_trainer_on_cpu_does_not_initialise_cuda():
    code = ("import torch, torch.nn.functional as F\n"
            "from trainer_nb.core import Trainer\n"
            "t = Trainer(torch.nn.Linear(2, 1), loss_func=F.mse_loss, cpu=True)\n"
            "print(t.device.type, torch.cuda.is_initialized())")
    p = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-2:] == ['cpu', 'False']


def test_trainer_from_core_alone_has_its_whole_api():
    "`from trainer_nb.core import Trainer` and nothing else: every method is there, in help() and dir(), and works."
    code = r'''
import io, contextlib, json, sys, torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainer_nb.core import Trainer
api = ['fit', 'fit_one_cycle', 'fit_cosine', 'fit_constant', 'lr_find', 'history', 'evaluate', 'predict',
       'describe_hooks', 'get_hook', 'state_dict', 'load_state_dict', 'temporary', 'split', 'freeze', 'unfreeze',
       'fine_tune', 'summary', 'find_batch_size', 'log', 'step', 'backward']
buf = io.StringIO()
with contextlib.redirect_stdout(buf): help(Trainer)
torch.manual_seed(0)   # (unseeded, about one draw in 60 diverges within the 20-step sweep: too few points to read)
x = torch.randn(64, 2)
t = Trainer(torch.nn.Linear(2, 1), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8),
            loss_func=F.mse_loss, cpu=True)
res = t.lr_find(show=False, num_it=20)
t.fit_one_cycle(1, res.valley)
mods = sorted(m for m in sys.modules if m.startswith('trainer_nb'))
print(json.dumps({'dir': [m for m in api if m not in dir(Trainer)], 'help': [m for m in api if m not in buf.getvalue()],
                  'epochs': len(t.history), 'loaded': mods}))
'''
    p = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r['dir'] == [] and r['help'] == [] and r['epochs'] == 1
    assert 'trainer_nb.all' not in r['loaded']


def test_import_all_leaves_out_the_heavy_optional_libraries():
    """`import trainer_nb.all` imports neither torchmetrics (seconds: it imports transformers and SciPy where they are
    installed) nor transformers, datasets or peft; `Mean(f)` imports torchmetrics and is its `Metric`."""
    code = ("import sys, json, trainer_nb.all\n"
            "heavy = ('torchmetrics', 'transformers', 'datasets', 'peft', 'scipy')\n"
            "before = [m for m in heavy if m in sys.modules]\n"
            "from trainer_nb.metrics import Mean\n"
            "m = Mean(lambda p, y: (p - y).abs())\n"
            "import torchmetrics\n"
            "print(json.dumps({'before': before, 'metric': isinstance(m, torchmetrics.Metric) and isinstance(m, Mean)}))")
    p = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r == {'before': [], 'metric': True}
