"""`gradaccum train` on long runs: checkpoints, `--resume` bitwise after SIGKILL, SIGINT and
SIGTERM, and one run per output folder.

A run in a subprocess writes its loss lines (``--log-every 1``, unbuffered) into a pipe of one
page that the test reads: once the test stops reading, the run blocks within about a hundred
micro-batches, long before its end. So "kill it after a checkpoint, before it finishes" holds
on any machine, however loaded, with no sleeps and no timing.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.demos.metrics import read_metrics
from gradaccum.run_folder.checkpoint import read_state
from gradaccum.run_folder.run_lock import LOCK
from tests.cli import run
from tests.ranks import environment, free_port

pytestmark = [pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux pipes"),
              pytest.mark.slow]  # runs killed and resumed in subprocesses

# 6400 items in micro-batches of 32: 200 loss lines per epoch, far more than the pipe holds.
RUN = ["--limit-train", "6400", "--limit-test", "200", "--epochs", "2", "--no-progress",
       "--log-every", "1", "--micro-batch", "32", "--steps", "2"]
TIMING = {"seconds", "samples_per_s", "peak_memory_bytes"}


STARTED = []  # every Run, so that a failed test leaves no process behind


@pytest.fixture(autouse=True)
def _no_stragglers():
    yield
    while STARTED:
        run = STARTED.pop()
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


class Run:
    """``gradaccum ARGS`` in a subprocess whose stdout is a one-page pipe read by the test."""

    def __init__(self, args, tmp_path, command="train", launcher=("-m",)):
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: a run blocks soon
        env = {**environment(), "PYTHONUNBUFFERED": "1"}
        self.stderr_path = tmp_path / f"stderr-{len(list(tmp_path.glob('stderr-*')))}.txt"
        with open(self.stderr_path, "w") as err:
            # A session of its own: the test can end the whole tree (torchrun's ranks too).
            self.proc = subprocess.Popen([sys.executable, *launcher, "gradaccum", command, *args],
                                         stdout=write_end, stderr=err, env=env, start_new_session=True)
        os.close(write_end)
        self.stdout = os.fdopen(read_end)
        STARTED.append(self)

    def read_until(self, condition, limit=2000):
        """Read lines until ``condition(line)`` holds; then the run can go on only a little."""
        for _ in range(limit):
            line = self.stdout.readline()
            assert line, "the run ended first: " + self.stderr_path.read_text()[-2000:]
            if condition(line):
                return line
        raise AssertionError("condition never met")

    def finish(self, timeout=600):
        """Drain stdout to the end and wait: the exit code, stdout's rest, stderr."""
        try:
            rest = self.stdout.read()
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.stdout.close()
        return code, rest, self.stderr_path.read_text()


def same_metrics(a, b):
    """metrics.jsonl of two runs, equal but for the timings."""
    def strip(records):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in records]
    return strip(read_metrics(a / "metrics.jsonl")) == strip(read_metrics(b / "metrics.jsonl"))


def same_params(a, b):
    with np.load(a / "params.npz") as pa, np.load(b / "params.npz") as pb:
        return pa.files == pb.files and all(np.array_equal(pa[k], pb[k]) for k in pa.files)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (in this process; one torch thread, like the subprocesses)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", *RUN, "--checkpoint-every", "5", "--out", str(out)]) == 0
    assert not (out / "checkpoint.pt").exists()  # a finished run needs no checkpoint
    return out


def test_sigkill_after_a_checkpoint_then_resume_is_bitwise_the_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--checkpoint-every", "5", "--out", str(out)]
    run = Run(args, tmp_path)
    # Window 10 is micro-batch 20: once its line is read, two checkpoints are on disk.
    run.read_until(lambda line: "[ 21/200]" in line)
    run.proc.kill()
    code, _, _ = run.finish()
    assert code == -signal.SIGKILL
    assert not (out / "params.npz").exists() and (out / "checkpoint.pt").exists()
    resumed = Run([*args, "--resume"], tmp_path)
    code, text, err = resumed.finish()
    assert code == 0, err[-2000:]
    assert "Resumed from" in text and "Traceback" not in err
    assert same_params(out, reference) and same_metrics(out, reference)
    assert not (out / "checkpoint.pt").exists()


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_over(reference, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "window", "epoch": 1, "samples": 64, "loss": 2.3}\n')
    assert main(["train", *RUN, "--checkpoint-every", "5", "--out", str(out), "--resume"]) == 0
    assert "No checkpoint in " in capsys.readouterr().out
    assert same_params(out, reference) and same_metrics(out, reference)
    # A folder with no run at all is not resumed: a mistyped --out says so.
    assert main(["train", *RUN, "--out", str(tmp_path / "typo"), "--resume"]) == 2
    assert "no checkpoint.pt in" in capsys.readouterr().err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_checkpoints_exits_128_plus_signum_and_resumes_bitwise(signum, reference, tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--out", str(out)]  # no --checkpoint-every: the signal alone writes one
    run = Run(args, tmp_path)
    run.read_until(lambda line: "[ 15/200]" in line)
    run.proc.send_signal(signum)
    code, _, err = run.finish()
    assert code == 128 + signum
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"gradaccum train: interrupted by {signal.Signals(signum).name} at epoch ")
    assert "resume with: gradaccum train " in lines[0] and lines[0].endswith(" --resume")
    assert (out / "checkpoint.pt").exists() and not (out / "summary.json").exists()
    code, _, err = Run([*args, "--resume"], tmp_path).finish()
    assert code == 0, err[-2000:]
    assert same_params(out, reference) and same_metrics(out, reference)


def test_resume_refuses_settings_that_change_the_result(tmp_path, capsys):
    out = tmp_path / "run"
    run = Run([*RUN, "--out", str(out)], tmp_path)
    run.read_until(lambda line: "[  3/200]" in line)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish()[0] == 130
    capsys.readouterr()
    for extra, message in [(["--lr", "0.02"], "--lr is 0.02 here but 0.01"),
                           (["--seed", "1"], "--seed is 1 here but 0"),
                           (["--epochs", "3"], "--epochs is 3 here but 2")]:
        assert main(["train", *RUN, *extra, "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert (out / "checkpoint.pt").exists()  # refused: nothing changed
    # Settings that do not change the result may differ.
    assert main(["train", *RUN, "--log-every", "50", "--out", str(out), "--resume"]) == 0


def test_an_out_folder_holds_one_run(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["train", "--limit-train", "128", "--limit-test", "50", "--epochs", "1", "--no-progress",
             "--out", str(out)]
    assert main(small) == 0
    first = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    # A second run is refused, and changes nothing there...
    assert main([*small, "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds another run" in err and "--overwrite" in err
    assert json.loads((out / "summary.json").read_text()) == first
    # ...as is --resume of a run that finished...
    assert main([*small, "--resume"]) == 2
    assert "the run there finished" in capsys.readouterr().err
    # ...unless told to replace it: the old files go first.
    (out / "curves.png").unlink()
    (out / "notes.txt").write_text("mine")
    assert main([*small, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["config"]["seed"] == 1
    assert (out / "curves.png").exists() and (out / "notes.txt").read_text() == "mine"
    assert not list(out.glob(".*tmp*"))  # no temporary file left behind


def test_a_live_run_whose_lock_file_is_removed_keeps_its_folder_and_ends_as_usual(reference, tmp_path,
                                                                                  capsys):
    out = tmp_path / "run"
    live = Run([*RUN, "--checkpoint-every", "5", "--out", str(out)], tmp_path)
    live.read_until(lambda line: "[  3/200]" in line)  # it holds the folder, blocked on its pipe
    (out / LOCK).unlink()
    code, err = run(["train", *RUN, "--overwrite", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"is in use by a running gradaccum run (pid {live.proc.pid} on " in err
    code, _, err = live.finish()
    assert code == 0, err[-2000:]
    assert same_params(out, reference) and same_metrics(out, reference)  # undisturbed


@pytest.mark.parametrize(("argv", "message"), [
    (["--resume"], "--resume needs --out"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --out"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be an integer >= 1, got '0'"),
    (["--backend", "mindspore", "--resume", "--out", "x"], "does not write checkpoints"),
])
def test_checkpoint_options_need_an_out_folder_and_the_torch_backend(argv, message, capsys):
    code, err = run(["train", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_compare_passes_an_interrupt_to_its_run_and_says_so_in_one_line(tmp_path):
    out = tmp_path / "cmp"
    run = Run(["--settings", "32x2,64x1", *RUN[:-4], "--out", str(out)], tmp_path, command="compare")
    run.read_until(lambda line: "[  5/200]" in line)
    run.proc.send_signal(signal.SIGINT)
    code, _, err = run.finish()
    assert code == 130 and "Traceback" not in err
    lines = err.strip().splitlines()
    # One line from the run (where its checkpoint is), one from compare, which stops there.
    assert len(lines) == 2 and lines[0].startswith("gradaccum train: interrupted by SIGINT")
    assert lines[1].startswith("gradaccum compare: interrupted by SIGINT during the 32x2 run (exit 130)")
    assert (out / "32x2" / "checkpoint.pt").exists() and not (out / "64x1").exists()
    assert not (out / "compare.md").exists()


def test_compare_replaces_its_own_earlier_outputs(tmp_path):
    out = tmp_path / "cmp"
    (out / "64x1").mkdir(parents=True)
    (out / "64x1" / "summary.json").write_text("{}")  # an earlier compare's run
    (out / "compare.md").write_text("an earlier table")
    args = ["compare", "--settings", "64x1", "--limit-train", "128", "--limit-test", "50",
            "--epochs", "1", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    assert "an earlier table" not in (out / "compare.md").read_text()
    assert json.loads((out / "64x1" / "summary.json").read_text())["epochs"]


def test_under_torchrun_sigterm_checkpoints_at_a_window_and_resumes_bitwise(tmp_path):
    # 2 ranks x micro-batch 16 x 2 steps: 200 micro-batches per rank and epoch. torchrun passes
    # SIGTERM on to both ranks; they agree on the next window to stop at, rank 0 writes the
    # checkpoint, and both read it back on --resume.
    def torchrun():
        return ["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", "-m"]

    args = [*RUN[:-4], "--micro-batch", "16", "--steps", "2", "--optimizer", "momentum"]
    code, _, err = Run([*args, "--out", str(tmp_path / "ref")], tmp_path, launcher=torchrun()).finish()
    assert code == 0, err[-3000:]
    out = tmp_path / "run"
    run = Run([*args, "--out", str(out)], tmp_path, launcher=torchrun())
    run.read_until(lambda line: "[ 15/200]" in line)
    run.proc.send_signal(signal.SIGTERM)
    code, _, err = run.finish()
    assert code != 0 and (out / "checkpoint.pt").exists(), err[-3000:]
    assert err.count("gradaccum train: interrupted by SIGTERM at epoch 1, micro-batch ") == 2, err[-3000:]
    saved = read_state(out / "checkpoint.pt")  # sealed: its SHA-256 checked
    assert saved["world"] == 2 and saved["accumulator"]["window"]["micro_step"] == 0  # at a window
    code, _, err = Run([*args, "--out", str(out), "--resume"], tmp_path, launcher=torchrun()).finish()
    assert code == 0, err[-3000:]
    assert same_params(out, tmp_path / "ref") and same_metrics(out, tmp_path / "ref")
