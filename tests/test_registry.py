"""Registries and trainers built from a config: look-ups and their errors, every config field checked (with the
closest valid name in the error), overrides, a user's own modules, Trainer subclasses, `trainer.config` rebuilding
the run."""
import json
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from trainer_nb.core import Trainer
from trainer_nb.checkpoint import Checkpoint
from trainer_nb.monitor import EarlyStopping, MetricsLog
from trainer_nb.recorder import Recorder
from trainer_nb.registry import (DEFAULTS, KINDS, ConfigError, RegistryKeyError, apply_overrides, build_trainer,
                                 load_config, lookup, register, registry, resolve_config)
from trainer_nb.schedule import cosine, one_cycle

pytestmark = pytest.mark.usefixtures('fresh_accelerate')

# the digits demo, one epoch, no run directory and no default hooks: quick to build and to train
BASE = {'data': {'type': 'digits_dls', 'bs': 64}, 'model': 'digits_model', 'loss': 'cross_entropy',
        'metrics': ['accuracy'], 'fit': {'epochs': 1, 'lr': 0.005}, 'run_dir': None,
        'trainer_args': {'default_hooks': False}}


def weights(t): return {k: v.detach().clone() for k, v in t.unwrapped_model.state_dict().items()}


def config_error(cfg, overrides=()) -> str:
    with pytest.raises(ConfigError) as e: resolve_config(cfg, overrides)
    return str(e.value)


# ---- registries ----

def test_library_pieces_are_registered():
    assert lookup('trainer', 'Trainer') is Trainer
    for h in (Recorder, Checkpoint, EarlyStopping, MetricsLog): assert lookup('hook', h.__name__) is h
    assert {'SGD', 'Adam', 'AdamW'} <= set(registry('optimizer')) and lookup('optimizer', 'SGD') is torch.optim.SGD
    assert lookup('scheduler', 'one_cycle') is one_cycle and lookup('scheduler', 'cosine') is cosine
    assert lookup('loss', 'cross_entropy') is F.cross_entropy
    assert {'digits_dls'} <= set(registry('data')) and 'digits_model' in registry('model')
    assert set(KINDS) == {'trainer', 'model', 'data', 'loss', 'metric', 'optimizer', 'scheduler', 'hook'}


def test_unknown_key_lists_known_keys_and_the_closest():
    with pytest.raises(KeyError) as e: lookup('optimizer', 'adamw')
    assert isinstance(e.value, RegistryKeyError)
    msg = str(e.value)
    assert "No optimizer named 'adamw' (did you mean 'AdamW'?)" in msg
    assert 'Known optimizer names: ' in msg and 'SGD' in msg and 'RMSprop' in msg
    with pytest.raises(KeyError, match="did you mean 'model'"): registry('modle')
    with pytest.raises(KeyError) as e: lookup('model', 'zzzzzz')
    assert 'did you mean' not in str(e.value) and 'digits_model' in str(e.value)


def test_register_default_and_explicit_names_and_replacing_warns():
    @register('model')
    def my_net_for_test(width: int = 3): return torch.nn.Linear(2, width)
    assert lookup('model', 'my_net_for_test') is my_net_for_test
    register('model', 'net_alias_for_test')(my_net_for_test)
    assert lookup('model', 'net_alias_for_test') is my_net_for_test
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        register('model', 'net_alias_for_test')(my_net_for_test)     # the same object: no warning
    other = lambda: torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="model 'net_alias_for_test' registered again: .* replaces .*my_net_for_test"):
        register('model', 'net_alias_for_test')(other)
    assert lookup('model', 'net_alias_for_test') is other


def test_register_refuses_what_it_cannot_use():
    with pytest.raises(TypeError, match='must be Trainer or a subclass of it'): register('trainer')(torch.nn.Linear)
    with pytest.raises(TypeError, match='class or a function'): register('metric', 'x')(3)
    with pytest.raises(TypeError, match='name must be a string'): register('model', torch.nn.Linear)


# ---- config checks ----

@pytest.mark.parametrize('override, says', [
    ('model.hiden=64', "model.hiden: model 'digits_model' has no argument 'hiden' (did you mean 'hidden'?)"),
    ('model.type=digit_model', "model: No model named 'digit_model' (did you mean 'digits_model'?)"),
    ('data.bz=32', "(did you mean 'bs'?)"),
    ('fit.epoch=3', "Unknown config field fit.'epoch' (did you mean 'epochs'?)"),
    ('trainer_args.grad_acum=2', "(did you mean 'grad_accum'?)"),
    ('trainer_args.lr=0.1', "trainer_args.lr: set it with the config field 'fit.lr'"),
    ('trainer_args.loss_func=mse_loss', "set it with the config field 'loss'"),
    ('trainer_args.train_step=x', 'it is code'),
    ('optimizer.lr=0.1', 'the learning rate is fit.lr'),
    ('optimizer={type: SGD, momentm: 0.9}', "(did you mean 'momentum'?)"),
    ('optimizer=SDG', "(did you mean 'SGD'?)"),
    ('loss=cross_entropi', "(did you mean 'cross_entropy'?)"),
    ('loss.label_smothing=0.1', "(did you mean 'label_smoothing'?)"),
    ('metrics=[acuracy]', "metrics.0: No metric named 'acuracy' (did you mean 'accuracy'?)"),
    ('schedule=cosin', "(did you mean 'cosine'?)"),
    ('hooks=[{type: EarlyStoping}]', "(did you mean 'EarlyStopping'?)"),
    ('hooks=[{type: EarlyStopping, patiense: 2}]', "(did you mean 'patience'?)"),
    ('hooks=[MetricsLog]', "hook 'MetricsLog' needs its argument 'path': add hooks.0.path"),
    ('lr_find.num_iter=50', "(did you mean 'num_it'?)"),
    ('lr_find.suggestion=valey', "(did you mean 'valley'?)"),
    ('checkpoint.keep=2', "(did you mean 'keep_last'?)"),
    ('trainer_type=Traner', "(did you mean 'Trainer'?)"),
    ('fit.lr=fnd', "fit.lr must be a positive number or 'find'"),
    ('fit.lr=-1', "fit.lr must be a positive number or 'find'"),
    ('fit.epochs=1.5', 'fit.epochs must be an int'),
    ('run_dir=runs/{nme}', 'only {name} and {time} can be filled in'),
    ('imports=[no_such_module_here]', "imports: can't import 'no_such_module_here'"),
])
def test_config_errors_name_the_field_and_the_closest_valid_name(override, says):
    assert says in config_error(BASE, [override])


def test_unknown_top_level_field_in_a_file(tmp_path):
    f = tmp_path / 'c.yaml'
    f.write_text('model: digits_model\ndata: digits_dls\nschedul: one_cycle\n')
    msg = config_error(f)
    assert "Unknown config field 'schedul' (did you mean 'schedule'?)" in msg and 'run_dir' in msg
    f.write_text('model: digits_model\ndata: [digits_dls\n')
    assert f'{f} is not valid YAML' in config_error(f)
    assert 'needs a \'model\'' in config_error({'data': 'digits_dls'})
    assert "trainer_type" in config_error({**BASE, 'trainer': 'Trainer'})   # the closest field to a common slip


def test_defaults_filled_and_pieces_as_mappings():
    c = resolve_config(BASE)
    assert list(c) == list(DEFAULTS)
    assert c['model'] == {'type': 'digits_model'} and c['loss'] == {'type': 'cross_entropy'}
    assert c['optimizer'] == {'type': 'AdamW'} and c['schedule'] is None and c['name'] == 'run'
    assert c['fit'] == {'epochs': 1, 'lr': 0.005, 'resume': None} and c['checkpoint'] == {} and c['hooks'] == []
    assert resolve_config(c) == c          # resolving is idempotent
    assert resolve_config({**BASE, 'checkpoint': False, 'metrics_log': None})['metrics_log'] is False


def test_overrides_are_yaml_and_reach_into_pieces_and_lists():
    c = apply_overrides({**BASE, 'hooks': ['EarlyStopping']},
                        ['model.hidden=64', 'fit.lr=1e-3', 'hooks.0.patience=2', 'optimizer.weight_decay=0',
                         'trainer_args.max_grad_norm=1', 'schedule={type: cosine, lr_min: 1e-5}', 'run_dir='])
    assert c['model'] == {'type': 'digits_model', 'hidden': 64}
    assert c['fit']['lr'] == 0.001 and isinstance(c['fit']['lr'], float)
    assert c['hooks'] == [{'type': 'EarlyStopping', 'patience': 2}]
    assert c['optimizer'] == {'type': 'AdamW', 'weight_decay': 0}       # the default piece, with an argument
    assert c['schedule'] == {'type': 'cosine', 'lr_min': 1e-5} and c['run_dir'] is None
    assert BASE['model'] == 'digits_model'                              # the config given is not changed
    with pytest.raises(ConfigError, match='not of the form key.sub=value'): apply_overrides(BASE, ['fit.epochs'])
    with pytest.raises(ConfigError, match="did you mean 'model'"): apply_overrides(BASE, ['modle=digits_model'])
    with pytest.raises(ConfigError, match='not valid YAML'): apply_overrides(BASE, ['metrics=[a'])


def test_yaml_numbers_like_1e_3_are_floats(tmp_path):
    f = tmp_path / 'c.yaml'
    f.write_text('model: digits_model\ndata: digits_dls\nfit: {lr: 3e-3, epochs: 2}\n'
                 'optimizer: {type: SGD, momentum: 9E-1}\n')
    c = resolve_config(f)
    assert c['fit']['lr'] == 0.003 and c['optimizer']['momentum'] == 0.9 and c['name'] == 'c'


# ---- building ----

def test_build_trainer_makes_what_the_config_says():
    t = build_trainer(BASE, ['optimizer={type: SGD, momentum: 0.8}', 'loss.label_smoothing=0.1',
                             'schedule={type: cosine, lr_min: 0.0001, warmup_pct: 0}', 'hooks=[Recorder]',
                             'trainer_args.grad_accum=2', 'data.bs=32'])
    opt = t.opt.optimizer
    assert type(opt) is torch.optim.SGD and opt.defaults['momentum'] == 0.8 and t.lr == 0.005
    assert t.loss_func.__name__ == 'cross_entropy' and t.loss_func.keywords == {'label_smoothing': 0.1}
    assert [m.__name__ for m in t.metrics] == ['accuracy'] and t.grad_accum == 2 and t.train_dl.batch_size == 32
    assert [type(h) for h in t.hooks] == [Recorder]
    t.fit(1)
    assert t.opt.param_groups[0]['lr'] == pytest.approx(1e-4)   # the cosine schedule ran to its end
    assert set(t.evaluate()) == {'valid_loss', 'accuracy'}


def test_a_bad_argument_value_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer_args .*mixed_precision must be 'no', 'bf16' or 'fp16'"):
        build_trainer(BASE, ['trainer_args.mixed_precision=fp32'])
    with pytest.raises(ConfigError, match='data .*valid_pct must be between 0 and 1'):
        build_trainer(BASE, ['data.valid_pct=2'])


def test_trainer_config_rebuilds_the_same_run(tmp_path):
    "Built again from `trainer.config` (or from the run directory's config.json), the same fit gives the same weights."
    t = build_trainer(BASE, [f'run_dir={tmp_path}/{{name}}-{{time}}', 'name=rebuild'])
    run_dir = t.config['run_dir']
    assert run_dir.startswith(f'{tmp_path}/rebuild-') and [type(h) for h in t.hooks] == [MetricsLog, Checkpoint]
    t.fit(1, 0.005)
    w1 = weights(t)
    saved = json.loads((tmp_path / run_dir.split('/')[-1] / 'config.json').read_text())
    assert {k: v for k, v in saved.items() if k != 'trainer'} == t.config
    assert saved['trainer']['lr'] == 0.005 and saved['trainer']['metrics'] == ['accuracy']
    again = build_trainer(t.config, ['checkpoint=false', 'metrics_log=false'])   # the config rebuilds it
    assert again.config['run_dir'] == run_dir and again.hooks == []
    again.fit(1, 0.005)
    for k, v in weights(again).items(): assert torch.equal(v, w1[k]), k
    from_dir = build_trainer(tmp_path / run_dir.split('/')[-1], ['checkpoint=false', 'metrics_log=false'])
    assert from_dir.config == again.config
    # another seed: other weights
    other = build_trainer(t.config, ['seed=1', 'checkpoint=false', 'metrics_log=false'])
    assert not torch.equal(weights(other)['0.weight'], weights(build_trainer(again.config))['0.weight'])


def test_a_users_module_is_imported_from_the_configs_folder(tmp_path, monkeypatch):
    (tmp_path / 'my_parts_for_test.py').write_text(textwrap.dedent('''
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from trainer_nb.registry import register

        @register('data', 'pairs')
        def make_pairs(n: int = 32):
            x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
            return {'train': DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)}

        @register('model')
        class Summer(torch.nn.Module):
            def __init__(self, d: int):
                super().__init__()
                self.lin = torch.nn.Linear(d, 1)
            def forward(self, x): return self.lin(x)
    '''))
    cfg = tmp_path / 'cfg.yaml'
    cfg.write_text('imports: [my_parts_for_test]\ndata: pairs\nmodel: Summer\nloss: mse_loss\nrun_dir: null\n')
    monkeypatch.chdir(tmp_path.parent)   # not the config's folder: the module is found there all the same
    assert "model 'Summer' needs its argument 'd'" in config_error(cfg)
    t = build_trainer(cfg, ['model.d=3', 'fit.lr=0.05', 'fit.epochs=5', 'trainer_args.default_hooks=false'])
    assert type(t.unwrapped_model).__name__ == 'Summer' and t.valid_dl is None
    t.fit(5)
    assert t.losses.values[-4:].mean() < t.losses.values[:4].mean()


def test_a_registered_trainer_subclass_gets_the_trainer_arguments():
    seen = {}

    @register('trainer', 'RecordingTrainer')
    class RecordingTrainer(Trainer):
        def __init__(self, model, train_dl=None, valid_dl=None, *, tag: str = 'x', **kwargs):
            seen.update(kwargs, tag=tag)
            super().__init__(model, train_dl, valid_dl, **kwargs)

    t = build_trainer(BASE, ['trainer_type=RecordingTrainer', 'trainer_args.tag=mine', 'trainer_args.max_grad_norm=2',
                             'schedule=one_cycle'])
    assert type(t) is RecordingTrainer and seen['tag'] == 'mine' and t.max_grad_norm == 2
    given = {'loss_func', 'opt_func', 'lr', 'metrics', 'hooks', 'scheduler', 'max_grad_norm', 'default_hooks'}
    assert given <= set(seen)
    assert seen['lr'] == 0.005 and seen['opt_func'] is torch.optim.AdamW
    assert "(did you mean 'tag'?)" in config_error(BASE, ['trainer_type=RecordingTrainer', 'trainer_args.tga=1'])
    assert "(did you mean 'grad_accum'?)" in config_error(BASE, ['trainer_type=RecordingTrainer',
                                                                 'trainer_args.grad_acum=1'])


def test_checkpoint_hooks_come_from_their_fields(tmp_path):
    msg = config_error(BASE, [f'run_dir={tmp_path}', f'hooks=[{{type: Checkpoint, dir: {tmp_path}}}]'])
    assert 'made from the config field' in msg and "'checkpoint'" in msg
    t = build_trainer(BASE, [f'run_dir={tmp_path}/r', 'checkpoint.keep_last=1', 'metrics_log=false'])
    (ck,) = t.hooks
    assert isinstance(ck, Checkpoint) and ck.keep_last == 1 and str(ck.dir) == f'{tmp_path}/r' and ck.config is t.config


def test_load_config_reads_yaml_json_and_run_directories(tmp_path):
    (tmp_path / 'a.json').write_text(json.dumps(BASE))
    assert load_config(tmp_path / 'a.json') == {**BASE, 'name': 'a'}
    run = tmp_path / 'run-1'
    run.mkdir()
    (run / 'config.json').write_text(json.dumps({**BASE, 'trainer': {'parameters': 3, 'model': 'X'}}))
    assert load_config(run) == {**BASE, 'name': 'run-1'}          # the Checkpoint's record of the trainer is dropped
    with pytest.raises(ConfigError, match='No config file'): load_config(tmp_path / 'nope.yaml')
    (tmp_path / 'list.yaml').write_text('- a\n- b\n')
    with pytest.raises(ConfigError, match='must hold a mapping'): load_config(tmp_path / 'list.yaml')
