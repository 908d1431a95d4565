"""LayerStats' heat maps in the live view's frames: the samples as the hook holds them, sent when they change (or 2 s
on), and in the picture left behind."""
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer_nb.core import Trainer
from trainer_nb.inside import LayerStats
from trainer_nb.liveplot import LivePlot, draw_curves, pack

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def fitted(every=3, steps=60):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(steps)]
    stats, plot = LayerStats(every=every, report=False), LivePlot(mode='text', path=os.devnull)
    t = Trainer(net, batches, loss_func=F.mse_loss, cpu=True, hooks=[stats])
    t.remove_hooks(LivePlot).add_hooks(plot)
    t.fit(1)
    return stats, plot


def test_frame_holds_the_samples_and_sends_them_once():
    stats, plot = fitted()
    f = plot.frame()
    steps, std = stats.series('act_std')
    assert f['layers'] == {'names': ['0 Linear', '2 Linear'], 'every': 3}
    assert np.array_equal(f['series']['layer_step'], steps) and list(steps) == list(range(3, 61, 3))
    assert np.array_equal(f['series']['layer_std'], std.ravel())   # a sample's layers, then the next sample's
    assert np.array_equal(f['series']['layer_dead'], stats.series('near_zero')[1].ravel())
    spec, data = pack(plot._heat_once(f, 100.))                     # new samples: sent
    assert ['layer_std', 40] in spec['series'] and not spec['layers'].get('same')
    spec2, data2 = pack(plot._heat_once(plot.frame(), 101.))       # the same samples a second later: left out
    assert spec2['layers']['same'] and not any(n.startswith('layer_') for n, _ in spec2['series'])
    assert len(data) - len(data2) == 8 * (20 + 2 * 40)
    assert not pack(plot._heat_once(plot.frame(), 102.5))[0]['layers'].get('same')   # 2 s on: sent again


def test_the_picture_holds_the_heat_maps():
    _, plot = fitted()
    f = plot.frame()
    with_maps, without = draw_curves(f), draw_curves({**f, 'layers': None})
    height = lambda png: int.from_bytes(png[20:24], 'big')
    assert height(with_maps) > height(without) == 580

