"""The wheel, installed as a user installs it: built from the checkout, into a fresh venv that
already has torch, with no MNIST inside; it imports, runs, and says how to get the data.

Offline, as CI is: the wheel is built with the .venv's hatchling (no build isolation), and the
fresh venv sees torch, numpy and their requirements through one .pth file that points at links to
exactly those distributions of the project's .venv (not at its site-packages, which holds
gradaccum itself, tqdm, matplotlib, ...). pip then installs the wheel with every requirement
already met, from no index: the torch that was there is the torch that stays.
"""

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import gradaccum

ROOT = Path(__file__).resolve().parents[1]
PRESENT = ("torch", "numpy")  # what the fresh venv has before gradaccum: its two requirements


def _closure(names):
    """The distributions ``names`` need, themselves included (markers evaluated, no extras)."""
    seen, todo = {}, list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _link_distributions(dists, folder):
    """Links in ``folder`` to each distribution's top-level files and its .dist-info."""
    folder.mkdir()
    for dist in dists:
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "GRADACCUM"))}
    # No pip configuration (no local wheel folder, no index), and an empty data cache.
    return {**env, "PIP_CONFIG_FILE": os.devnull, "GRADACCUM_DATA": str(tmp_path / "cache")}


def _run(argv, tmp_path, check=True, cwd=None):
    out = subprocess.run(argv, capture_output=True, text=True, cwd=cwd or tmp_path, env=_env(tmp_path),
                         timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"{argv} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the fresh venv's python) after ``pip install`` of the wheel into it."""
    tmp = tmp_path_factory.mktemp("install")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(tmp / "dist"), str(ROOT)], tmp)
    (wheel,) = (tmp / "dist").glob("gradaccum-*.whl")

    venv.create(tmp / "venv", with_pip=False)
    python = tmp / "venv" / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp).stdout.strip())
    _link_distributions(_closure(PRESENT), tmp / "present")
    (site / "present.pth").write_text(f"{tmp / 'present'}\n")

    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "-q",
          str(wheel)], tmp)
    return wheel, python, site


@pytest.mark.slow  # builds a wheel and a venv, starts torch five times (~15 s)
def test_the_wheel_is_small_and_carries_no_data(installed):
    wheel, _, site = installed
    assert wheel.name == f"gradaccum-{gradaccum.__version__}-py3-none-any.whl"
    assert wheel.stat().st_size < 1_000_000
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "gradaccum/demos/mnist.py" in names and "gradaccum/py.typed" in names
    assert [n for n in names if n.endswith(".gz") or "mnist/" in n or "/data/" in n] == []
    assert list((site / "gradaccum").rglob("*.gz")) == []


@pytest.mark.slow
def test_the_installed_wheel_imports_and_keeps_the_torch_it_found(installed, tmp_path):
    _, python, site = installed
    out = _run([str(python), "-c", "import gradaccum, torch, numpy; "
                "print(gradaccum.__version__); print(gradaccum.__file__); print(torch.__file__); "
                "print(gradaccum.Accumulator.__name__)"], tmp_path).stdout.split()
    assert out[0] == gradaccum.__version__
    assert Path(out[1]).is_relative_to(site)  # the wheel's copy, not the checkout's
    assert Path(out[2]).resolve() == Path(importlib.metadata.distribution("torch").locate_file(
        "torch/__init__.py")).resolve()  # pip replaced nothing
    assert not (site / "torch").exists() and out[3] == "Accumulator"
    assert sysconfig.get_paths()["purelib"] != str(site)


@pytest.mark.slow
def test_the_installed_command_runs_and_asks_for_the_data(installed, tmp_path):
    _, python, _ = installed
    gradaccum_cmd = str(python.parent / "gradaccum")
    assert _run([gradaccum_cmd, "--version"], tmp_path).stdout.strip() == f"gradaccum {gradaccum.__version__}"
    assert "torch" in _run([gradaccum_cmd, "info"], tmp_path).stdout
    out = _run([gradaccum_cmd, "train"], tmp_path, check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"gradaccum train: error: no MNIST data found: run `gradaccum data mnist` (downloads 11 MB "
        f"into {tmp_path / 'cache' / 'mnist'}, md5-checked), or pass --data DIR, a folder with the "
        "four .gz files"]
    # The wheel user's next step (file:// stands in for the canonical mirror: no internet here).
    mirror = f"file://{ROOT / 'data' / 'mnist'}/"
    assert _run([gradaccum_cmd, "data", "mnist", "--mirror", mirror], tmp_path).stdout.count("md5 ok") == 4
    out = _run([gradaccum_cmd, "train"], tmp_path, check=False)  # data found; the demo extra is next
    assert out.returncode == 2 and "pip install 'gradaccum[demo]'" in out.stderr


@pytest.mark.slow
def test_the_installed_wheel_run_in_the_checkout_reads_its_data(installed, tmp_path):
    # README's install block run line by line: the wheel over the editable install. Run in the
    # checkout (its root or a folder below), the demo finds the checkout's data/mnist.
    _, python, site = installed
    for cwd in (ROOT, ROOT / "docs"):
        out = _run([str(python), "-c", "import gradaccum; from gradaccum.demos.data_dirs import find_mnist; "
                    "print(gradaccum.__file__); print(find_mnist())"], tmp_path, cwd=cwd).stdout.split()
        assert Path(out[0]).is_relative_to(site) and Path(out[1]) == ROOT / "data" / "mnist"
