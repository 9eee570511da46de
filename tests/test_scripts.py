"""scripts/setup.sh, which demo.sh and test.sh run first: on a first set-up (minutes) it says
what it is doing, a line per step; when nothing needs doing it installs and prints nothing.

The script runs in a copy of what it reads (itself and pyproject.toml), with a stand-in for
Python that makes no environment and downloads nothing: it records each call, and "has" torch
once a pip call installed it.
"""

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_DIR/calls"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then [ -f "$STUB_DIR/torch" ]; exit; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    case "$*" in *"torch=="*) touch "$STUB_DIR/torch" ;; esac
fi
exit 0
"""


def _setup(tmp_path, extras):
    """Run the copy's setup.sh with ``extras``: (its stderr lines, the stand-in's calls)."""
    calls = tmp_path / "stub" / "calls"
    calls.unlink(missing_ok=True)
    env = {"PATH": f"{tmp_path / 'stub'}:/usr/bin:/bin", "PYTHON": str(tmp_path / "stub" / "python3"),
           "STUB_DIR": str(tmp_path / "stub"), "HOME": str(tmp_path)}
    out = subprocess.run(["bash", "scripts/setup.sh", extras], cwd=tmp_path / "checkout", env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "", out
    return out.stderr.splitlines(), calls.read_text().splitlines() if calls.exists() else []


def test_setup_says_each_step_and_nothing_when_nothing_needs_doing(tmp_path):
    (tmp_path / "checkout" / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "checkout" / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "checkout")
    (tmp_path / "stub").mkdir()
    for name, text in (("python3", STUB), ("nvidia-smi", "#!/bin/sh\nexit 1\n")):  # no GPU here
        (tmp_path / "stub" / name).write_text(text)
        os.chmod(tmp_path / "stub" / name, 0o755)

    said, calls = _setup(tmp_path, "demo")
    stub = tmp_path / "stub" / "python3"
    assert said[:3] == [
        f"setup: creating the virtual environment .venv ({stub} -m venv)",
        "setup: installing torch 2.13.0 into .venv, the CPU build (minutes on a first set-up)",
        "setup: installing gradaccum into .venv, editable, with the extras demo and its requirements",
    ]
    assert len(said) == 4 and said[3].startswith("setup: .venv is ready (") and said[3].endswith(" s)")
    assert [c for c in calls if "pip" in c and "-e" in c] == [
        "-m pip --disable-pip-version-check -q install -e .[demo]"]

    # Idempotent and quiet: the same extras again install nothing and print nothing.
    said, calls = _setup(tmp_path, "demo")
    assert said == [] and not any("pip" in c for c in calls)

    # Other extras: the environment and torch are there; only gradaccum is installed again.
    said, calls = _setup(tmp_path, "demo,dev")
    assert [line.split(",")[0] for line in said[:-1]] == ["setup: installing gradaccum into .venv"]
    assert said[-1].startswith("setup: .venv is ready (")
    assert not any("torch==" in c for c in calls)


def test_demo_and_test_run_setup_first():
    for script in ("demo.sh", "test.sh"):
        lines = [line for line in (ROOT / "scripts" / script).read_text().splitlines()
                 if line and not line.startswith(("#", "set ", "cd "))]
        assert lines[0].startswith("bash scripts/setup.sh "), script
