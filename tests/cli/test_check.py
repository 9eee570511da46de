"""``gradaccum check``: the report, the named modules and the exit codes."""

import subprocess
import sys

import torch

from gradaccum.cli import main

FACTORY = """
from torch import nn

def dropout_net():
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5),
                         nn.Linear(8, 2))

def plain_net():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))

not_callable = 3
"""


def test_mlp_is_equivalent_exit_0(capsys):
    assert main(["check", "--model", "mlp", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "EQUIVALENT: all 6 tensors agree" in out and "1.weight" in out and "max abs diff" in out


def test_cnn_bn_is_not_equivalent_exit_1_naming_the_batchnorms(capsys):
    assert main(["check", "--model", "cnn-bn", "--micro-batch", "2"]) == 1
    out = capsys.readouterr().out
    assert "NOT EQUIVALENT" in out
    assert "1 (BatchNorm2d)" in out and "5 (BatchNorm2d)" in out and "docs/BATCHNORM.md" in out


def test_user_factory_with_dropout(capsys, tmp_path, monkeypatch):
    (tmp_path / "usernets.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usernets", raising=False)  # this test's file, not a cached one
    assert main(["check", "--model", "usernets:dropout_net", "--input-shape", "5"]) == 1
    out = capsys.readouterr().out
    assert "1 (Dropout)" in out and "3 (Dropout)" in out
    assert main(["check", "--model", "usernets:plain_net", "--input-shape", "5", "--dtype",
                 "float32"]) == 0
    assert "float32" in capsys.readouterr().out


def test_sample_file(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"inputs": torch.randn(6, 1, 28, 28), "targets": torch.randint(0, 10, (6,))}, path)
    assert main(["check", "--model", "mlp", "--sample", str(path), "--steps", "3",
                 "--loss", "cross-entropy"]) == 0
    assert "batch of 6 against 3 micro-batches of 2" in capsys.readouterr().out.replace("\n", " ")


def test_tolerance_is_settable(capsys):
    # Float rounding of another summation order fails a zero tolerance.
    assert main(["check", "--model", "mlp", "--micro-batch", "2", "--atol", "0", "--rtol", "0"]) == 1
    assert "NOT EQUIVALENT" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys, tmp_path, monkeypatch):
    (tmp_path / "usernets.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usernets", raising=False)  # this test's file, not a cached one
    for argv, message in [
        (["--model", "resnet"], "--model must be one of"),
        (["--model", "usernets:plain_net"], "--input-shape or --sample"),
        (["--model", "usernets:missing", "--input-shape", "5"], "no attribute 'missing'"),
        (["--model", "usernets:not_callable", "--input-shape", "5"], "not a callable"),
        (["--model", "no_such_module:f", "--input-shape", "5"], "no_such_module"),
        (["--model", "mlp", "--input-shape", "1,x"], "--input-shape"),
        (["--model", "mlp", "--sample", "missing.pt"], "no such file"),
    ]:
        assert main(["check", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_exit_code_reaches_the_shell():
    out = subprocess.run([sys.executable, "-m", "gradaccum", "check", "--model", "cnn-bn",
                          "--micro-batch", "1", "--steps", "2"], capture_output=True, text=True)
    assert out.returncode == 1 and "BatchNorm2d" in out.stdout


RANKS_FACTORY = """
from torch import nn

def bn_net():
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
"""


def test_world_size_runs_ranks_and_names_batchnorm(capsys, tmp_path, monkeypatch):
    (tmp_path / "ranknets.py").write_text(RANKS_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "--model", "ranknets:bn_net", "--input-shape", "5", "--steps", "1",
                 "--micro-batch", "4", "--world-size", "2"]) == 1
    out = capsys.readouterr().out.replace("\n", " ")
    assert "against 2 DDP ranks (gloo processes) of 1 micro-batch of 4 each" in out
    assert "1 (BatchNorm1d)" in out and "SyncBatchNorm" in out


def test_world_size_usage_errors_exit_2(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"inputs": torch.randn(6, 1, 28, 28), "targets": torch.randn(6, 10)}, path)
    for argv, message in [
        (["--model", "mlp", "--world-size", "0"], "--world-size"),
        (["--model", "mlp", "--sample", str(path), "--steps", "2", "--world-size", "2"],
         "world_size=2 x steps=2"),
    ]:
        assert main(["check", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
