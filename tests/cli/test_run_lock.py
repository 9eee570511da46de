"""One run per `--out`: a second run into a folder in use exits 2 naming the first (pid, host,
start time); a lock left by a killed run is taken over.

The holder is a second process that takes the lock, says so on stdout, and keeps it until its
stdin closes: the test waits on those events, never on a clock.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from gradaccum.cli import main
from gradaccum.demos.run_lock import LOCK, holder, run_lock
from tests.cli import run
from tests.ranks import environment

TINY = ["--limit-train", "64", "--limit-test", "10", "--epochs", "1", "--no-progress"]
HOLD = ("import sys\nfrom pathlib import Path\nfrom gradaccum.demos.run_lock import run_lock\n"
        "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    sys.stdin.read()\n")


@pytest.fixture
def holding(tmp_path):
    """Start a process that holds ``tmp_path / 'run'``'s lock; yields it once it holds it."""
    started = []

    def start():
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], env=environment(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_second_run_into_a_busy_folder_exits_2_naming_the_first(holding, tmp_path, capsys):
    out = tmp_path / "run"
    proc = holding()
    code, err = run(["train", *TINY, "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    named = f"is in use by a running gradaccum run (pid {proc.pid} on {socket.gethostname()}, started "
    assert named in lines[0]
    assert not (out / "metrics.jsonl").exists()  # the second run wrote nothing
    # --resume and --overwrite are refused the same way, and so is compare.
    for extra in (["--resume"], ["--overwrite"]):
        assert run(["train", *TINY, *extra, "--out", str(out)], capsys)[0] == 2
    code, err = run(["compare", *TINY, "--settings", "64x1", "--out", str(out)], capsys)
    assert code == 2 and f"pid {proc.pid}" in err
    # Once the first one is done, the folder is free.
    proc.stdin.close()
    assert proc.wait() == 0 and not (out / LOCK).exists()
    assert main(["train", *TINY, "--out", str(out)]) == 0
    assert not (out / LOCK).exists()


def test_the_lock_of_a_killed_run_is_taken_over(holding, tmp_path, capsys):
    out = tmp_path / "run"
    proc = holding()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert holder(out)["pid"] == proc.pid  # the file stays behind, its flock went with the process
    assert main(["train", *TINY, "--out", str(out)]) == 0
    assert not (out / LOCK).exists()


def test_a_lock_file_naming_a_dead_pid_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    (out / LOCK).write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(),
                                        "started": 0}))
    with run_lock(out):
        assert holder(out)["pid"] == os.getpid()
    assert not (out / LOCK).exists()


def test_a_lock_is_released_when_the_run_fails(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(["train", *TINY, "--data-dir", str(tmp_path / "missing"), "--out", str(out)], capsys)[0] == 2
    assert not (out / LOCK).exists()
    with run_lock(out):  # free again
        pass
