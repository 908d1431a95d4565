"""Trainer(compile=...): the model compiled once (checkpoints keep its own names, resume works), the first batch timed,
and no graph break from our code inside a compiled forward (`log_scalar`), checked with torch._dynamo.explain."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import LoggingModel, flat, regression_ds, small_model

pytestmark = pytest.mark.usefixtures('fresh_accelerate')


def test_log_scalar_inside_a_compiled_forward_breaks_no_graph():
    import torch._dynamo as dynamo
    from trainer_nb.core import Hook, Trainer
    seen = {}
    class Explain(Hook):
        "Explain the model's forward while the trainer is training (log_scalar then records)."
        def before_batch(self):
            if not seen:
                seen['e'] = dynamo.explain(self.trainer.model)(self.trainer.batch[0])
    t = Trainer(LoggingModel(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss, hooks=[Explain()],
                default_hooks=False)
    t.fit(1)
    e = seen['e']
    assert e.graph_break_count == 0 and e.graph_count == 1, e.break_reasons
    assert len(t.logged['out_mean'].values) == 6 + 1   # each step, and the explained call


@pytest.mark.usefixtures('on_the_cpu')
def test_compiled_trainer_checkpoint_resume_and_weights(tmp_path, capsys):
    from trainer_nb.checkpoint import Checkpoint, list_checkpoints, load_weights
    from trainer_nb.core import Trainer
    def make(compile, d):
        return Trainer(small_model(), DataLoader(regression_ds(), batch_size=8), loss_func=F.mse_loss,
                       compile=compile, hooks=[Checkpoint(d, every_steps=4)], default_hooks=False)
    c = make({'backend': 'eager'}, tmp_path / 'c')
    c.fit(2)
    assert 'compiled the model: the first batch took' in capsys.readouterr().out and c.compile_time > 0
    p = make(False, tmp_path / 'p')
    p.fit(2)
    assert torch.allclose(flat(c.model), flat(p.model), atol=1e-6)
    m = small_model()
    load_weights(m, list_checkpoints(tmp_path / 'c')[-1])   # the model's own names, no `_orig_mod.`
    assert torch.equal(flat(m), flat(c.model))
    r = make({'backend': 'eager'}, tmp_path / 'r')
    r.fit(2, resume=[x for x in list_checkpoints(tmp_path / 'c') if x.name == 'step-00000008'][0])
    assert torch.equal(flat(r.model), flat(c.model))
    with pytest.raises(TypeError, match='compile must be True or a dict'): make('yes', tmp_path / 'x')
