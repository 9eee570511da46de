import subprocess
import sys

import pytest

from gradaccum.cli import main


def test_python_dash_m_runs_the_same_command_line():
    out = subprocess.run([sys.executable, "-m", "gradaccum", "--help"], capture_output=True,
                         text=True, check=True)
    assert "usage: gradaccum" in out.stdout


def test_info_prints_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "torch_threads" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "compare"])
def test_commands_without_the_demo_extra_name_it_in_one_line(command, monkeypatch, capsys):
    import importlib.util

    from gradaccum.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tqdm" else real(name, *a))
    assert main([command, "--limit-train", "64", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'gradaccum[demo]'" in err and "Traceback" not in err
