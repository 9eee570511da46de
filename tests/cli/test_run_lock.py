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
from pathlib import Path

import pytest

from gradaccum.cli import main
from gradaccum.run_folder.run_lock import LOCK, RunLockError, holder, run_lock
from tests.cli import run
from tests.ranks import environment

TINY = ["--limit-train", "64", "--limit-test", "10", "--epochs", "1", "--no-progress"]
HOLD = ("import sys\nfrom pathlib import Path\nfrom gradaccum.run_folder.run_lock import run_lock\n"
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


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("data")
    return victim


ODD_LOCKS = {  # what stands where the lock file goes, and how the refusal names it
    "symlink": (lambda lock, victim: lock.symlink_to(victim), "is a symbolic link"),
    "dangling symlink": (lambda lock, victim: lock.symlink_to(victim.with_name("absent")),
                         "is a symbolic link"),
    "hard link": (lambda lock, victim: os.link(victim, lock), "is a file with 2 hard links"),
    "folder": (lambda lock, victim: lock.mkdir(), "is a folder"),
    "fifo": (lambda lock, victim: os.mkfifo(lock), "is not a regular file"),
}


@pytest.mark.parametrize("kind", list(ODD_LOCKS))
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_nothing_is_written_through_it(
        kind, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    victim = _victim(tmp_path)
    make, named = ODD_LOCKS[kind]
    make(out / LOCK, victim)
    code, err = run(["train", *TINY, "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"its lock file {out / LOCK} {named}; nothing was written through it" in lines[0]
    assert victim.read_text() == "data"
    assert sorted(p.name for p in out.iterdir()) == [LOCK]  # the run wrote nothing, removed nothing
    assert os.path.lexists(out / LOCK)
    assert not (tmp_path / "absent").exists()  # a dangling link is not created through either


def test_a_regular_lock_file_is_used_as_it_is_the_negative_twin(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text("left by a run that was killed")
    with run_lock(out) as killed_run_was_here:
        assert killed_run_was_here and holder(out)["pid"] == os.getpid()
    assert not (out / LOCK).exists()
    with run_lock(out) as killed_run_was_here:  # a folder no run has used
        assert not killed_run_was_here


def test_removing_the_lock_file_lets_no_second_lock_in(tmp_path):
    out = tmp_path / "run"
    with run_lock(out):
        (out / LOCK).unlink()
        with pytest.raises(RunLockError, match="is in use by a running gradaccum run"), run_lock(out):
            pass  # pragma: no cover - the lock is refused
        (out / LOCK).write_text("{}")  # replaced by another file: refused alike
        with pytest.raises(RunLockError, match="is in use by a running gradaccum run"), run_lock(out):
            pass  # pragma: no cover
        assert (out / LOCK).read_text() == "{}"
    assert (out / LOCK).read_text() == "{}"  # not ours: the lock leaves another's file alone
    with run_lock(out):  # free again
        pass


def test_a_lock_file_removed_under_a_live_run_does_not_let_a_second_run_in(holding, tmp_path, capsys):
    out = tmp_path / "run"
    proc = holding()
    (out / "metrics.jsonl").write_text("the live run's\n")
    (out / LOCK).unlink()
    code, err = run(["train", *TINY, "--overwrite", "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "is in use by a running gradaccum run (" in lines[0]
    if Path("/proc/locks").exists():  # Linux names the holder from the kernel's lock table
        assert f"(pid {proc.pid} on {socket.gethostname()}; its lock file names no holder)" in lines[0]
    assert (out / "metrics.jsonl").read_text() == "the live run's\n"  # --overwrite cleared nothing
    assert not (out / LOCK).exists()  # and wrote no lock file
    proc.stdin.close()
    assert proc.wait() == 0  # the live run ends as usual
    assert main(["train", *TINY, "--overwrite", "--out", str(out)]) == 0


def test_resume_of_a_folder_holding_only_a_killed_runs_lock_starts_over(holding, tmp_path, capsys):
    out = tmp_path / "run"
    proc = holding()
    proc.send_signal(signal.SIGKILL)  # killed before it wrote anything but its lock
    proc.wait()
    assert sorted(p.name for p in out.iterdir()) == [LOCK]
    capsys.readouterr()
    assert main(["train", *TINY, "--resume", "--out", str(out)]) == 0
    assert f"No checkpoint in {out} yet: the run starts over" in capsys.readouterr().out
    assert (out / "summary.json").exists() and not (out / LOCK).exists()
    # The negative twin: a folder no run has used has nothing to resume.
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = run(["train", *TINY, "--resume", "--out", str(empty)], capsys)
    assert code == 2 and "nothing to resume" in err
    assert list(empty.iterdir()) == []
