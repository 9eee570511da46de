"""`gradaccum train --resume` resumes only a checkpoint that proves its integrity: a damaged,
truncated or edited file is refused in one line, exit 2, and nothing in the folder changes."""

import errno
import math
import shutil
import signal

import numpy as np
import pytest
import torch

from gradaccum.cli import main
from gradaccum.demos.config import TrainConfig
from gradaccum.demos.trainer import run_torch
from gradaccum.run_folder.checkpoint import read_state, write_state
from gradaccum.run_folder.interrupt import Interrupted
from gradaccum.run_folder.outputs import CHECKPOINT
from gradaccum.run_folder.sealed import seal
from tests.cli import run

# 256 items in micro-batches of 32: 8 micro-batches per epoch.
ARGS = ["--limit-train", "256", "--limit-test", "50", "--epochs", "2", "--no-progress"]
CONFIG = dict(limit_train=256, limit_test=50, epochs=2, progress=False)


class StopAfter:
    """A stop flag that fires after ``n`` looks: the run checkpoints there (micro-batch n)."""

    def __init__(self, n):
        self.n = n

    @property
    def signum(self):
        self.n -= 1
        return signal.SIGINT if self.n < 0 else 0


def interrupted_run(out, looks):
    with pytest.raises(Interrupted):
        run_torch(TrainConfig(**CONFIG, out=out), log=lambda line: None, stop=StopAfter(looks))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run stopped at epoch 2, micro-batch 3 (epoch 1's results and metrics in its position)."""
    return interrupted_run(tmp_path_factory.mktemp("saved") / "run", 8 + 3)


@pytest.fixture
def out(saved, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def refused(out, capsys, message):
    """--resume exits 2 with one line holding ``message``, and the folder is as it was."""
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run(["train", *ARGS, "--out", str(out), "--resume"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_untouched_checkpoint_resumes_to_the_uninterrupted_result(out, tmp_path, capsys):
    state = read_state(out / CHECKPOINT)
    assert (state["position"]["epoch"], state["position"]["micro_batch"]) == (2, 3)
    assert main(["train", *ARGS, "--out", str(out), "--resume"]) == 0
    assert "Resumed from" in capsys.readouterr().out
    assert main(["train", *ARGS, "--out", str(tmp_path / "whole")]) == 0
    with np.load(out / "params.npz") as resumed, np.load(tmp_path / "whole" / "params.npz") as whole:
        assert all(np.array_equal(resumed[k], whole[k]) for k in whole.files)


def test_64_flipped_bytes_in_the_middle_are_refused(out, capsys):
    data = bytearray((out / CHECKPOINT).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    (out / CHECKPOINT).write_bytes(bytes(data))
    refused(out, capsys, "damaged or edited: its SHA-256 does not match")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_checkpoint_is_refused(out, capsys, keep):
    data = (out / CHECKPOINT).read_bytes()
    (out / CHECKPOINT).write_bytes(data[: int(len(data) * keep)])
    refused(out, capsys, "truncated")


def test_a_checkpoint_without_its_seal_is_refused(out, capsys):
    # A bare torch.save, as gradaccum 0.2 wrote it, or a file whose header was damaged.
    torch.save(read_state(out / CHECKPOINT), out / CHECKPOINT)
    refused(out, capsys, "no integrity header")


def edit(change):
    def apply(state):
        change(state)
        return state
    return apply


EDITS = {
    "epoch 99": (edit(lambda s: s["position"].update(epoch=99)), "position.epoch is 99, outside 1..2"),
    "epoch -1": (edit(lambda s: s["position"].update(epoch=-1)), "position.epoch is -1, outside 1..2"),
    "epoch 1.0": (edit(lambda s: s["position"].update(epoch=1.0)), "position.epoch is 1.0"),
    "micro-batch past the epoch": (edit(lambda s: s["position"].update(micro_batch=9)),
                                   "position.micro_batch is 9, outside 0..8"),
    "micro-batch -1": (edit(lambda s: s["position"].update(micro_batch=-1)), "position.micro_batch is -1"),
    "no rng": (edit(lambda s: s.pop("rng")), "it has no 'rng'"),
    "no position": (edit(lambda s: s.pop("position")), "it has no 'position'"),
    "no model": (edit(lambda s: s.pop("model")), "it has no 'model'"),
    "rng.torch a string": (edit(lambda s: s["rng"].update(torch="abc")), "rng.torch must be a uint8 tensor"),
    "rng.torch too short": (edit(lambda s: s["rng"].update(torch=s["rng"]["torch"][:10])),
                            "rng.torch is not a torch generator state"),
    "rng.python a list": (edit(lambda s: s["rng"].update(python=[1, 2])), "rng.python is not a python"),
    "rng.numpy short": (edit(lambda s: s["rng"].update(numpy=("MT19937", [1, 2], 0, 0, 0.0))),
                        "rng.numpy is not a numpy"),
    "rng.cuda on a cpu run": (edit(lambda s: s["rng"].update(cuda=[])), "rng.cuda must be None"),
    "no rng.numpy": (edit(lambda s: s["rng"].pop("numpy")), "rng must hold"),
    "finished epochs dropped": (edit(lambda s: s["position"].update(epochs=[])),
                                "position.epochs must list the 1 finished epoch(s), got 0"),
    "an epoch result edited": (edit(lambda s: s["position"]["epochs"][0].update(epoch=5)),
                               "position.epochs[0] is not epoch 1's results"),
    "an epoch result's field dropped": (edit(lambda s: s["position"]["epochs"][0].pop("test_loss")),
                                        "position.epochs[0] is not epoch 1's results"),
    "an epoch result with a field of no run": (edit(lambda s: s["position"]["epochs"][0].update(x=1.0)),
                                               "position.epochs[0] is not epoch 1's results"),
    "metrics lines dropped": (edit(lambda s: s["position"].update(records=[])),
                              "position.records hold 0 epoch line(s), not 1"),
    "a metrics line of no kind": (edit(lambda s: s["position"]["records"].append({"loss": 1.0})),
                                  "position.records must be metrics lines"),
    "seconds nan": (edit(lambda s: s["position"].update(run_seconds=math.nan)),
                    "position.run_seconds is nan"),
    "a window loss dropped": (edit(lambda s: s["position"]["window_losses"].pop()),
                              "position.window_losses and window_samples"),
    "world 0": (edit(lambda s: s.update(world=0)), "'world' is 0"),
    "config a list": (edit(lambda s: s.update(config=[])), "'config' is a list"),
    "not a dict": (lambda s: [s], "not a gradaccum train checkpoint"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_checkpoint_with_a_valid_seal_is_refused(name, out, capsys):
    change, message = EDITS[name]
    write_state(out / CHECKPOINT, change(read_state(out / CHECKPOINT)))
    refused(out, capsys, message)


def test_an_edit_refused_leaves_the_checkpoint_resumable(out, capsys):
    # The refusal changed nothing: the original, put back, resumes.
    original = (out / CHECKPOINT).read_bytes()
    write_state(out / CHECKPOINT, EDITS["epoch 99"][0](read_state(out / CHECKPOINT)))
    refused(out, capsys, "position.epoch is 99")
    (out / CHECKPOINT).write_bytes(original)
    assert run(["train", *ARGS, "--out", str(out), "--resume"], capsys)[0] == 0


def test_an_epoch_result_may_lack_a_field_that_has_a_default(out, capsys):
    # A checkpoint of a run before skipped_windows existed: EpochResult fills in its default.
    write_state(out / CHECKPOINT, edit(lambda s: s["position"]["epochs"][0].pop("skipped_windows"))(
        read_state(out / CHECKPOINT)))
    assert run(["train", *ARGS, "--out", str(out), "--resume"], capsys)[0] == 0


def test_a_killed_runs_temporary_file_is_removed_on_resume(out, capsys):
    leftover = out / ".checkpoint.tmp99999.pt"
    leftover.write_bytes(seal(b"half a checkpoint"))
    assert run(["train", *ARGS, "--out", str(out), "--resume"], capsys)[0] == 0
    assert not leftover.exists()


def test_a_killed_runs_temporary_file_is_removed_at_the_next_save(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    leftover = out / ".checkpoint.tmp99999.pt"
    leftover.write_bytes(b"half a checkpoint")
    interrupted_run(out, 2)
    assert (out / CHECKPOINT).exists() and not leftover.exists()


def test_a_full_disk_is_one_line_exit_1_and_replaces_nothing(tmp_path, capsys, monkeypatch):
    from gradaccum.run_folder import outputs

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "replace", full)
    out = tmp_path / "run"
    code, err = run(["train", "--limit-train", "64", "--limit-test", "10", "--epochs", "1",
                     "--no-progress", "--checkpoint-every", "1", "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("gradaccum train: error: no space left on the device to write "), err
    assert not list(out.glob(".*tmp*"))  # the temporary file is gone too
