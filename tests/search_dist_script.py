"""One trial's fit on two processes (`accelerate launch`): every process holds the trial (as a launched worker would),
the main one reports to it and a pruner stops the trial at its second report.

Usage: `accelerate launch ... tests/search_dist_script.py OUT_DIR`. Each process writes `OUT_DIR/rank{R}.json`: the
step it stopped at, how its fit ended, the values its hook saw; process 0 adds what the study holds."""
import json
import sys
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).parent))
import search_parts as P  # noqa: E402

from trainer_nb.search import TrialReport, open_storage  # noqa: E402


class AtStep(optuna.pruners.BasePruner):
    "Prunes a trial once it has reported at step 4 or later."
    def prune(self, study, trial): return max(trial.intermediate_values, default=0) >= 4


out = Path(sys.argv[1])
t = P.make(0.05)
state = t.accelerator   # (the trainer's: the processes' group)
if state.is_main_process:
    study = optuna.create_study(storage=open_storage(None, out / 'study.journal'), study_name='dist', pruner=AtStep())
    study.ask()
state.wait_for_everyone()
storage = open_storage(None, out / 'study.journal')
study = optuna.load_study(storage=storage, study_name='dist', pruner=AtStep())
trial = optuna.trial.Trial(study, study.trials[0]._trial_id)   # (the same trial on each process)
hook = TrialReport(trial, 'valid_loss')
t.add_hooks(hook)
t.fit(3, eval_every=2)
res = {'rank': state.process_index, 'step': t.state.step, 'status': getattr(t.cancelled, 'status', None),
       'values': hook.values, 'pruned': hook.pruned}
if state.is_main_process:
    ft = optuna.load_study(storage=storage, study_name='dist').trials[0]
    res['study'] = {str(k): v for k, v in ft.intermediate_values.items()}
(out / f'rank{state.process_index}.json').write_text(json.dumps(res))
