"""The GPU benchmark (bench/gpu.py) shrunk with --tiny to the CPU: it runs to the end within its budget, and writes a
row for every workload and contender, with ratios to the raw loop, or the reason a cell has none."""
import importlib.util
import json
import subprocess
import sys

from conftest import REPO

BENCH = REPO / 'bench' / 'gpu.py'
WORKLOADS = ('lm', 'cnn', 'mlp', 'lm_compile')
OURS = ('trainer_nb bare', 'trainer_nb defaults', 'trainer_nb background')
PEERS = {'hf': 'transformers', 'lightning': 'lightning', 'fastai': 'fastai'}
CONTENDERS = ('raw', *OURS, *PEERS)
BUDGET = 120
REPS = 2   # (5 by default: two show the repetitions, interleaved and rotated, in half the time)


def check_ran(row: dict, raw: dict):
    "A contender that ran: a ratio per repetition, its median within its range, on the raw loop's steps."
    name = f"{row['workload']} / {row['contender']}"
    assert row['status'] == 'ok' and row['reason'] is None, (name, row['reason'], row['error'])
    assert 1 <= row['reps'] == len(row['ratios']) == len(row['seconds']) <= REPS, name
    assert 0 < row['ratio_min'] <= row['ratio'] <= row['ratio_max'], name
    assert row['throughput'] > 0 and row['unit'].endswith('/s'), name
    assert row['steps'] == raw['steps'][:len(row['steps'])], name   # each repetition: the same steps for all


def test_tiny_run_has_a_row_for_every_workload_and_contender(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), '--tiny', '--budget', str(BUDGET), '--reps', str(REPS),
                          '--out', str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    [js], [md] = list(tmp_path.glob('gpu-*-tiny.json')), list(tmp_path.glob('gpu-*-tiny.md'))
    rep = json.loads(js.read_text())
    # no repetition is started past the budget (the first of each workload always runs, and the warm-ups: on a
    # loaded machine they overrun it a little)
    assert rep['tiny'] and rep['budget_s'] == BUDGET and rep['elapsed_s'] < 2 * BUDGET and rep['reps_wanted'] == REPS
    assert {'cpu', 'cores', 'gpu'} <= set(rep['machine'])
    assert {'python', 'torch', 'accelerate', 'transformers', 'lightning', 'trainer_nb'} <= set(rep['versions'])
    rows = {(r['workload'], r['contender']): r for r in rep['rows']}
    assert len(rows) == len(rep['rows']) and set(rows) == {(w, c) for w in WORKLOADS for c in CONTENDERS}
    assert [w['name'] for w in rep['workloads'] if w['status'] == 'ok'] == ['lm', 'cnn', 'mlp']
    for c in CONTENDERS:   # compiling on the CPU is left out with --tiny, and says so
        assert rows['lm_compile', c]['status'] == 'skipped' and 'compil' in rows['lm_compile', c]['reason']
    for w in ('lm', 'cnn', 'mlp'):
        raw = rows[w, 'raw']
        check_ran(raw, raw)
        assert raw['ratio'] == raw['ratio_min'] == raw['ratio_max'] == 1.0
        for c in OURS: check_ran(rows[w, c], raw)
        for c, pkg in PEERS.items():
            row = rows[w, c]
            if c != 'fastai' and importlib.util.find_spec(pkg): check_ran(row, raw)
            else: assert row['status'] == 'skipped' and row['reason'].startswith(('not installed', f"{pkg} is")), row
    assert 'its torchvision' in rows['lm', 'fastai']['reason'] or importlib.util.find_spec('fastai')
    text = md.read_text()
    assert '| contender | lm | cnn | mlp | lm_compile |' in text and '| raw | 1.00x: ' in text
    assert text in out.stdout   # the table is printed too
