"""A kill soak: SIGKILL a single-process run that checkpoints every few steps at N moments drawn at random (seeded,
printed), each kill in a run of its own, then resume it (`resume='last'`; from scratch when no checkpoint was
complete yet); every resumed run must end with weights bitwise equal to those of a run never interrupted.

The moments are drawn uniformly over the time an uninterrupted run with checkpoints takes from its first batch to its
fit's end (measured first), so that some land inside a checkpoint's write: a kill is counted as inside a write when the
temporary directory of a save (`.tmp-step-*`) or a set-aside old one (`.trash-*`) is there after it.

    .venv/bin/python bench/kill_soak.py [--kills 50] [--seed 0] [--hidden 32768] [--every 2]

It prints one line per kill and a summary: kills, kills inside a write, resumes equal to the reference (all of them,
or it exits 1). The run is tests/ckpt_script.py (3 epochs of 12 batches, Dropout, MetricsLog, Checkpoint).
"""
import argparse, json, random, signal, subprocess, sys, tempfile, time
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / 'tests' / 'ckpt_script.py')


def start(cfg):
    return subprocess.Popen([sys.executable, SCRIPT, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)


def finish(cfg):
    p = subprocess.run([sys.executable, SCRIPT, json.dumps(cfg)], capture_output=True, text=True, cwd=REPO)
    return p


def in_write(d: Path) -> bool:
    return any(x.name.startswith(('.tmp-step-', '.trash-')) for x in d.iterdir()) if d.is_dir() else False


def has_checkpoint(d: Path) -> bool:
    return d.is_dir() and any(x.name.startswith(('step-', '.tmp-step-')) for x in d.iterdir())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--kills', type=int, default=50)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--hidden', type=int, default=1 << 15)   # a model big enough that saving takes a good share
    ap.add_argument('--every', type=int, default=2)
    a = ap.parse_args()
    base = {'epochs': 3, 'hidden': a.hidden, 'every_steps': a.every}
    tmp = Path(tempfile.mkdtemp(prefix='kill_soak-'))
    p = finish({**base, 'dir': str(tmp / 'ref'), 'out': str(tmp / 'ref' / 'out'), 'ckpt': False})
    assert p.returncode == 0, p.stderr
    ref = load_file(str(tmp / 'ref' / 'out.safetensors'))
    # how long a run with checkpoints takes from its first batch to its end: the span the moments are drawn from
    q = start({**base, 'dir': str(tmp / 'timed'), 'out': str(tmp / 'timed' / 'out'), 'ready_first': True})
    assert q.stdout.readline().startswith('READY')
    t0 = time.monotonic()
    for line in q.stdout:   # its fit ends when it reports (then it writes its outputs and exits)
        if line.startswith('REPORT'): break
    span = time.monotonic() - t0
    q.communicate()
    rng = random.Random(a.seed)
    moments = [rng.uniform(0, span) for _ in range(a.kills)]
    print(f"seed {a.seed}: {a.kills} kills drawn over {span:.2f} s (an uninterrupted run with checkpoints every "
          f"{a.every} steps, hidden={a.hidden})", flush=True)
    kills = writes = equal = finished = 0
    for i, m in enumerate(moments):
        d, out = tmp / f'run{i}', str(tmp / f'run{i}' / 'out')
        q = start({**base, 'dir': str(d), 'out': out, 'ready_first': True})
        line = q.stdout.readline()
        assert line.startswith('READY'), line + q.stderr.read()
        time.sleep(m)
        q.send_signal(signal.SIGKILL)
        q.communicate()
        killed = q.returncode == -signal.SIGKILL
        w = killed and in_write(d)
        kills, writes, finished = kills + killed, writes + w, finished + (not killed)
        left = [x.name for x in d.iterdir() if x.name.startswith(('step-', '.tmp', '.trash'))] if d.is_dir() else []
        r = finish({**base, 'dir': str(d), 'out': out, 'resume': 'last' if has_checkpoint(d) else None})
        if r.returncode != 0 and 'No checkpoint to resume' in r.stderr + r.stdout:   # only a save cut short was there
            r = finish({**base, 'dir': str(d), 'out': out, 'resume': None})
        ok = r.returncode == 0 and all(load_file(out + '.safetensors')[k].equal(v) for k, v in ref.items())
        equal += ok
        print(f"{i:3d} kill at {m:6.3f} s: {'killed' if killed else 'had ended'}"
              f"{' inside a write' if w else ''}; left {sorted(left)}; resumed: {'equal' if ok else 'DIFFERENT'}"
              + ('' if r.returncode == 0 else f" (exit {r.returncode}: {r.stderr[-500:]})"), flush=True)
    print(f"kills: {kills} of {a.kills} moments ({finished} after the run had ended); inside a checkpoint's write: "
          f"{writes}; resumed runs bitwise equal to the uninterrupted one: {equal} of {a.kills}", flush=True)
    sys.exit(0 if equal == a.kills else 1)


if __name__ == '__main__':
    main()
