"""Every command's errors: one line `gradaccum COMMAND: error: ...`, exit 2 for bad usage, 1 for
a failure while running, 3 when `check`'s model raised; the traceback only under --debug."""

import gzip
import subprocess
import sys

import pytest
import torch

from gradaccum.cli._errors import UsageError
from gradaccum.cli._options import check_device
from gradaccum.demos.mnist import default_data_dir
from tests.cli import run

TINY = ["--limit-train", "64", "--limit-test", "10", "--epochs", "1", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text file, an empty batch, a truncated and a corrupt copy of MNIST, a plain file."""
    folder = tmp_path_factory.mktemp("files")
    (folder / "text.txt").write_text("not a tensor\n")
    torch.save(torch.empty(0, 1, 28, 28), folder / "empty.pt")
    torch.save({"inputs": torch.randn(8, 5)}, folder / "narrow.pt")
    labels = "train-labels-idx1-ubyte.gz"  # the smallest file the training set needs
    for name, damage in [("truncated", lambda b: b[: len(b) // 2]),
                         ("corrupt", lambda b: gzip.compress(gzip.decompress(b)[:-1] + b"\x01"))]:
        (folder / name).mkdir()
        for original in default_data_dir().glob("*.gz"):
            (folder / name / original.name).symlink_to(original)
        (folder / name / labels).unlink()
        (folder / name / labels).write_bytes(damage((default_data_dir() / labels).read_bytes()))
    (folder / "afile").write_text("")
    return folder


BAD = [
    # (argv, exit code, a piece of the message); {} is the fixture's folder
    (["train", "--epochs", "0"], 2, "argument --epochs: must be an integer >= 1, got '0'"),
    (["train", "--epochs", "-1"], 2, "argument --epochs"),
    (["train", "--limit-train", "0"], 2, "argument --limit-train"),
    (["train", "--limit-train", "-5"], 2, "argument --limit-train"),
    (["train", "--limit-test", "0"], 2, "argument --limit-test"),
    (["train", "--log-every", "0"], 2, "argument --log-every"),
    (["train", "--lr", "-1"], 2, "argument --lr: must be a finite number > 0, got '-1'"),
    (["train", "--lr", "nan"], 2, "argument --lr"),
    (["train", "--seed", "-3"], 2, "argument --seed"),
    (["train", *TINY, "--data-dir", "{}/missing"], 2, "not found in"),
    (["train", *TINY, "--data-dir", "{}"], 2, "not found in"),
    (["train", *TINY, "--data-dir", "{}/truncated"], 2, "truncated or not gzip"),
    (["train", *TINY, "--data-dir", "{}/corrupt"], 2, "is corrupt"),
    (["train", *TINY, "--out", "{}/afile/run"], 2, "is not a writable folder"),
    (["train", *TINY, "--backend", "mindspore", "--precision", "bf16"], 2, "trains in fp32"),
    (["train", "--global-batch", "60", "--steps", "8"], 2, "not divisible"),
    (["compare", "--settings", "8"], 2, "MICROxSTEPS"),
    (["compare", "--epochs", "0"], 2, "argument --epochs"),
    (["compare", *TINY, "--settings", "64x1", "--data-dir", "{}/missing"], 2, "not found in"),
    (["compare", *TINY, "--settings", "64x1", "--data-dir", "{}/truncated", "--out", "{}/cmp"], 2,
     "the 64x1 run failed (exit 2)"),
    (["bench", "--smoke", "--data", "{}/missing"], 2, "not found in"),
    (["check", "--model", "mlp", "--sample", "{}/text.txt"], 2, "is not a torch.save file"),
    (["check", "--model", "mlp", "--sample", "{}/empty.pt"], 2, "is empty"),
    (["check", "--model", "mlp", "--sample", "{}/missing.pt"], 2, "no such file"),
    (["check", "--model", "mlp", "--steps", "0"], 2, "argument --steps"),
    (["check", "--model", "mlp", "--atol", "-1"], 2, "argument --atol"),
    (["check", "--model", "mlp", "--input-shape", "5"], 3, "the model raised RuntimeError"),
    (["check", "--model", "mlp", "--sample", "{}/narrow.pt", "--steps", "2"], 3, "the model raised"),
    (["plan", "--model", "mlp", "--input-shape", "5"], 2, "raised RuntimeError on input shape 5"),
    (["plan", "--seed", "-1"], 2, "argument --seed"),
    (["plan", "--probe", "03", "8"], 2, "argument --probe: must be an integer >= 1, got '03'"),
    (["train", "--epochs", "1_000"], 2, "argument --epochs: must be an integer >= 1, got '1_000'"),
    (["bench", "--threads", "0"], 2, "argument --threads"),
    (["bench", "--out", "{}/afile/docs"], 2, "is not a writable folder"),
    (["nosuchcommand"], 2, "invalid choice"),
    # Every number has a range (gradaccum.cli._options): above it, one line naming the option.
    (["train", "--out", ""], 2, "argument --out: must name a folder, got ''"),
    (["compare", "--out", " "], 2, "argument --out: must name a folder"),
    (["bench", "--out", ""], 2, "argument --out: must name a folder"),
    (["train", "--steps-schedule", "0:99999999999999999999999"], 2, "--steps-schedule N must be <= 16777216"),
    (["train", "--steps-schedule", "99999999999999999999999:2"], 2, "--steps-schedule start must be <="),
    (["train", "--micro-batch", "1e23"], 2, "argument --micro-batch: must be an integer >= 1, got '1e23'"),
    (["train", "--micro-batch", "9" * 23], 2, "argument --micro-batch: must be an integer <= 16777216"),
    (["train", "--steps", "16777217"], 2, "argument --steps: must be an integer <= 16777216"),
    (["train", "--global-batch", "9" * 23], 2, "argument --global-batch: must be an integer <="),
    (["train", "--epochs", "99999999999999999999999"], 2, "argument --epochs: must be an integer <= 10000"),
    (["train", "--seed", "99999999999999999999"], 2, "argument --seed: must be an integer <= 4294967295"),
    (["train", "--seed", "4294967296"], 2, "argument --seed: must be an integer <= 4294967295"),
    (["train", "--lr", "1e31"], 2, "argument --lr: must be <= 1e+30"),
    (["train", "--base-batch", "99999999999"], 2, "argument --base-batch"),
    (["train", "--limit-train", "99999999999"], 2, "argument --limit-train"),
    (["train", "--log-every", "99999999999"], 2, "argument --log-every"),
    (["train", "--checkpoint-every", "99999999999"], 2, "argument --checkpoint-every"),
    (["compare", "--settings", "99999999999999999999x2"], 2, "--settings micro-batch must be <= 16777216"),
    (["compare", "--settings", "2x99999999999999999999"], 2, "--settings steps must be <= 16777216"),
    (["compare", "--seed", "99999999999999999999"], 2, "argument --seed"),
    (["compare", "--settings", "64x1,32x2,64x1"], 2, "--settings '64x1,32x2,64x1' gives 64x1 twice"),
    (["plan", "--global-batch", "1e20"], 2, "argument --global-batch"),
    (["plan", "--global-batch", str(10**20)], 2, "argument --global-batch: must be an integer <="),
    (["plan", "--probe", "4", "99999999999"], 2, "argument --probe"),
    (["plan", "--check", "99999999999"], 2, "argument --check"),
    (["plan", "--check-steps", "99999999999"], 2, "argument --check-steps"),
    (["plan", "--budget", "99999999999999GB"], 2, "--budget must be at most 1 EiB"),
    (["plan", "--budget", f"{2**60 + 1}B"], 2, "--budget must be at most 1 EiB"),  # no float rounding
    (["plan", "--budget", "0.5B"], 2, "budget must be at least 1 byte, got '0.5B'"),
    (["plan", "--seed", "99999999999999999999"], 2, "argument --seed"),
    (["check", "--model", "mlp", "--steps", "99999999999"], 2, "argument --steps"),
    (["check", "--model", "mlp", "--micro-batch", "99999999999"], 2, "argument --micro-batch"),
    (["check", "--model", "mlp", "--vocab", "99999999999"], 2, "argument --vocab"),
    (["check", "--model", "mlp", "--seed", "99999999999999999999"], 2, "argument --seed"),
    (["check", "--model", "mlp", "--atol", "1e9"], 2, "argument --atol: must be <= 1000"),
    (["check", "--model", "mlp", "--rtol", "inf"], 2, "argument --rtol"),
    (["check", "--model", "mlp", "--input-shape", "99999,99999"], 2, "--input-shape '99999,99999'"),
    (["bench", "--threads", "5000"], 2, "argument --threads: must be an integer <= 1024"),
]
BAD += [([cmd, "--device", "cpu:7", *extra], 2, "--device cpu:7: the CPU is one device, cpu or cpu:0")
        for cmd, extra in [("train", []), ("compare", []), ("check", ["--model", "mlp"]),
                           ("plan", []), ("bench", [])]]
if not torch.cuda.is_available():
    BAD += [([cmd, "--device", "cuda", *extra], 2, "this machine has no cuda device")
            for cmd, extra in [("train", []), ("compare", []), ("check", ["--model", "mlp"]),
                               ("plan", []), ("bench", [])]]


@pytest.mark.parametrize(("argv", "code", "message"), BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_commands_exit_with_one_line(argv, code, message, files, capsys):
    argv = [a.replace("{}", str(files)) for a in argv]
    got, err = run(argv, capsys)
    lines = err.strip().splitlines()
    command = argv[0] if argv[0] != "nosuchcommand" else ""
    # (A run that compare starts writes its own line to the real stderr, not captured here.)
    assert got == code and len(lines) == 1, err
    assert lines[-1].startswith(f"gradaccum {command}".rstrip() + ": error: ") and message in lines[-1], err
    assert "Traceback" not in err


def test_a_failure_while_running_exits_1_and_debug_shows_the_traceback(capsys, monkeypatch):
    import gradaccum.cli.info as info

    def boom():
        raise RuntimeError("the disk caught fire\nsecond line")

    monkeypatch.setattr(info, "describe_machine", boom)
    code, err = run(["info"], capsys)
    assert code == 1
    assert err == ("gradaccum info: error: RuntimeError: the disk caught fire "
                   "(--debug shows the traceback)\n")
    for argv, env in [(["info", "--debug"], None), (["--debug", "info"], None), (["info"], "1")]:
        if env:
            monkeypatch.setenv("GRADACCUM_DEBUG", env)
        code, err = run(argv, capsys)
        assert code == 1 and "Traceback (most recent call last)" in err and "in boom" in err, argv
        assert err.strip().splitlines()[-1] == "gradaccum info: error: RuntimeError: the disk caught fire"


def test_a_keyboard_interrupt_outside_training_exits_130_in_one_line(capsys, monkeypatch):
    import gradaccum.cli.info as info

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "describe_machine", interrupted)
    assert run(["info"], capsys) == (130, "gradaccum info: interrupted (SIGINT)\n")


def test_the_shell_sees_the_exit_code_and_no_traceback(files):
    for argv, code in [(["train", "--log-every", "0"], 2),
                       (["check", "--model", "mlp", "--input-shape", "5"], 3)]:
        done = subprocess.run([sys.executable, "-m", "gradaccum", *argv], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == code and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr


def test_train_without_mindspore_names_the_extra_in_one_line():
    hide = "import sys; sys.modules['mindspore'] = None; from gradaccum.cli import main; "
    argv = ["train", *TINY, "--backend", "mindspore"]
    done = subprocess.run([sys.executable, "-c", hide + f"sys.exit(main({argv!r}))"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--backend mindspore needs MindSpore" in done.stderr
    assert "pip install 'gradaccum[mindspore]'" in done.stderr


def test_the_largest_seed_and_epoch_counts_run(tmp_path, capsys):
    # The upper ends of the ranges are accepted and work (torch, NumPy and the data order).
    code, err = run(["train", *TINY, "--seed", "4294967295", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err


def test_the_cpu_is_one_device_cpu_or_cpu_0():
    assert check_device("cpu") == "cpu" and check_device("cpu:0") == "cpu:0"  # the negative twin
    with pytest.raises(UsageError, match="--device cpu:1: the CPU is one device"):
        check_device("cpu:1")
