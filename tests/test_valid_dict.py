"""`valid_dl` as a dict of named loaders: each evaluated after each epoch (and at `eval_every`), results named
`valid_<name>_loss` and `valid_<name>_<metric>`; EarlyStopping, Checkpoint and PlateauLR monitor any of them; the
quick checks and the default hooks take it."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import regression_ds, small_model

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def mae(preds, targets): return (preds - targets).abs().mean()


def loaders():
    return {'near': DataLoader(regression_ds(16, seed=1), batch_size=8),
            'far': DataLoader(regression_ds(24, seed=2), batch_size=8)}


def make(hooks=(), valid=None, **kw):
    from trainer_nb.core import Trainer
    kw.setdefault('default_hooks', False)
    return Trainer(small_model(), DataLoader(regression_ds(48), batch_size=8, shuffle=True),
                   loaders() if valid is None else valid, loss_func=F.mse_loss, metrics=[mae], cpu=True, lr=1e-2,
                   hooks=list(hooks), **kw)


NAMES = ['valid_near_loss', 'valid_near_mae', 'valid_far_loss', 'valid_far_mae']


def test_each_loader_evaluated_under_its_name():
    from trainer_nb.recorder import Recorder
    t = make([Recorder()])
    assert t.result_names() == ['epoch', 'train_loss', *NAMES, 'time']
    t.fit(2)
    h = t.history
    assert list(h.columns) == ['train_loss', *NAMES, 'time'] and len(h) == 2
    for name, dl in loaders().items():   # each one's numbers: those of evaluating that loader alone
        alone = t.evaluate(dl)
        assert h[f'valid_{name}_loss'].iloc[-1] == pytest.approx(alone['valid_loss'], rel=1e-6)
        assert h[f'valid_{name}_mae'].iloc[-1] == pytest.approx(alone['mae'], rel=1e-6)
    assert h.valid_near_loss.iloc[-1] != h.valid_far_loss.iloc[-1]
    assert list(t.evaluate()) == NAMES and list(t.valid_results) == NAMES


def test_early_stopping_and_checkpoint_monitor_any_of_them(tmp_path):
    from trainer_nb.checkpoint import Checkpoint
    from trainer_nb.monitor import EarlyStopping, MetricsLog, read_metrics
    from trainer_nb.recorder import Recorder
    es = EarlyStopping('valid_far_mae', patience=1, min_delta=10.)   # (no epoch improves by 10: stops after two)
    t = make([Recorder(), es, Checkpoint(tmp_path, monitor='valid_near_loss'), MetricsLog(tmp_path)])
    t.fit(5)
    assert len(t.history) == 2 and es.best == pytest.approx(t.history.valid_far_mae.iloc[0])
    best = json.loads((tmp_path / 'best.json').read_text())
    assert best['monitor'] == 'valid_near_loss' and best['value'] == pytest.approx(t.history.valid_near_loss.min())
    m = read_metrics(tmp_path)
    assert set(NAMES) <= set(m.columns)


@pytest.mark.parametrize('monitor,match', [('valid_loss', "did you mean 'valid_(near|far)_loss'"),
                                           ('valid_fra_mae', "did you mean 'valid_far_mae'")])
def test_a_name_no_epoch_reports_is_refused_before_training(monitor, match):
    from trainer_nb.monitor import EarlyStopping
    t = make([EarlyStopping(monitor)])
    w0 = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(ValueError, match=match): t.fit(1)
    assert t.state.iteration == 0 and all(torch.equal(a, b) for a, b in zip(w0, t.model.parameters()))


def test_plateau_lr_monitors_a_named_result():
    from trainer_nb.workflow import PlateauLR
    t = make([PlateauLR('valid_far_loss', patience=0, factor=0.5, threshold=10.)])   # no epoch improves by 10
    t.fit(3)
    assert t.opt.param_groups[0]['lr'] < 1e-2


def test_eval_every_and_the_quick_checks():
    from trainer_nb.base import Hook
    from trainer_nb.recorder import Recorder
    seen = []
    class Seen(Hook):
        def after_valid(self): seen.append((self.trainer.phase, list(self.trainer.valid_results)))
    t = make([Recorder(), Seen()])
    t.fit(1, eval_every=2)
    assert ('valid_step', NAMES) in seen and seen[-1] == ('valid', NAMES)
    t.fit(1, limit_batches=1)
    assert set(NAMES) <= set(t.epoch_results)
    t.fit(1, overfit_batches=1)
    assert set(NAMES) <= set(t.epoch_results)
    t.fit(fast_dev_run=True)


def test_default_hooks_take_it(capsys):
    t = make(default_hooks=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # (nothing warns about a valid_loss it lacks)
        t.fit(2)
    assert list(t.history.columns) == ['train_loss', *NAMES, 'time']


@pytest.mark.parametrize('valid,err,match', [
    ({}, TypeError, 'non-empty string names'), ({1: None}, TypeError, 'non-empty string names'),
    ({'a': DataLoader(regression_ds(16), batch_size=8), 'empty': DataLoader(regression_ds(0), batch_size=8)},
     ValueError, r"valid_dl\['empty'\] yields no batches")])
def test_bad_dicts_refused(valid, err, match):
    with pytest.raises(err, match=match): make(valid=valid).fit(1)


def test_the_live_plot_draws_a_validation_curve_per_loader(tmp_path):
    "LivePlot's frame holds each named loader's validation losses, and its picture draws them under their names."
    from trainer_nb.liveplot import LivePlot, _panels
    from trainer_nb.recorder import Recorder
    from trainer_nb.base import Hook
    class Epochs(Hook):
        def __init__(self): self.results = []
        def after_epoch(self): self.results.append(dict(self.trainer.epoch_results))
    plot, epochs = LivePlot(mode='text', path=tmp_path / 'curves.png', metrics=False), Epochs()
    t = make([Recorder(), plot, epochs])
    t.fit(3)
    frame = plot.frame()
    s = frame['series']
    assert frame['valid'] == ['near', 'far'] and len(s['valid_loss']) == 0   # no unnamed loader
    for n in ('near', 'far'):
        assert list(s['valid_step:' + n]) == [6, 12, 18]
        assert list(s['valid:' + n]) == [e[f'valid_{n}_loss'] for e in epochs.results]
    loss_panel = _panels(frame)[0]
    assert [st.get('label') for _, _, st in loss_panel[2]] == [None, 'train (smoothed)', 'valid near', 'valid far']
    assert (tmp_path / 'curves.png').stat().st_size > 10_000


def test_the_baseline_draws_each_named_loader_faint(tmp_path):
    "`LivePlot(compare='last')` after a fit with named loaders: the last fit's validation curve of each, faint."
    from trainer_nb.liveplot import LivePlot, _panels
    from trainer_nb.recorder import Recorder
    from trainer_nb.runs import RunRecorder
    first = make([Recorder(), RunRecorder()])
    first.fit(2)
    plot = LivePlot(mode='text', path=tmp_path / 'curves.png', metrics=False, compare='last')
    make([Recorder(), plot]).fit(1)
    s, epochs = plot.frame()['series'], first.history.to_dict('records')
    for n in ('near', 'far'):
        assert list(s['base_valid_step:' + n]) == [6, 12]
        assert list(s['base_valid:' + n]) == pytest.approx([e[f'valid_{n}_loss'] for e in epochs])
    faint = [st for _, _, st in _panels(plot.frame())[0][2] if st.get('ls') == '--']
    assert len(faint) == 3 and faint[0]['label'].startswith('baseline')   # the loss and the two loaders
