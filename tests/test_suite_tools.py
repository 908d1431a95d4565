"The test suite's own tools: failures written as they happen (see conftest.py)."
import os
import subprocess
import sys

from conftest import REPO


def test_failures_are_written_as_they_happen(tmp_path):
    "A run stopped before its summary (here: the second test kills pytest) has already written the first failure."
    (tmp_path / 'test_two.py').write_text(
        "import os, signal\n"
        "def test_fails(): assert 1 + 1 == 3, 'arithmetic'\n"
        "def test_killed(): os.kill(os.getpid(), signal.SIGKILL)\n")
    out = tmp_path / 'failures.txt'
    env = dict(os.environ, TRAINER_NB_FAILURES=str(out), PYTHONPATH=str(REPO / 'tests'))
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'conftest', '-p', 'no:cacheprovider', '--rootdir', str(tmp_path),
           str(tmp_path / 'test_two.py')]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9 and 'short test summary' not in p.stdout   # killed: no summary printed
    text = out.read_text()
    assert text.startswith('==== test_two.py::test_fails (call)\n') and 'AssertionError: arithmetic' in text
    assert text.count('====') == 1
