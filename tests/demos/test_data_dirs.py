"""Where the demo finds MNIST: the folder named, else the checkout's data/mnist (the package's, then the
one the command runs in), else the cache."""

import pytest

from gradaccum.demos import data_dirs
from gradaccum.demos.data_dirs import (
    MNIST_FILES,
    MnistNotFoundError,
    checkout_mnist_dir,
    find_mnist,
    mnist_cache_dir,
    working_checkout_mnist_dir,
)

CHECKOUT = checkout_mnist_dir()


def _copy_of_mnist(folder):
    """``folder`` holding links to the checkout's four files."""
    folder.mkdir(parents=True)
    for name in MNIST_FILES:
        (folder / name).symlink_to(CHECKOUT / name)
    return folder


@pytest.fixture
def no_checkout(monkeypatch, tmp_path):
    """Run as an installed wheel does: no checkout beside the package, and run outside one."""
    monkeypatch.setattr(data_dirs, "checkout_mnist_dir", lambda: None)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")


def test_the_tests_run_from_a_checkout_that_holds_mnist():
    assert CHECKOUT is not None and CHECKOUT.parts[-2:] == ("data", "mnist")
    assert sorted(p.name for p in CHECKOUT.glob("*.gz")) == sorted(MNIST_FILES)


def test_cache_is_gradaccum_data_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset
    monkeypatch.setenv("GRADACCUM_DATA", "")
    assert mnist_cache_dir() == tmp_path / "home" / ".cache" / "gradaccum" / "mnist"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mnist_cache_dir() == tmp_path / "xdg" / "gradaccum" / "mnist"
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path / "sets"))
    assert mnist_cache_dir() == tmp_path / "sets" / "mnist"


def test_a_named_folder_is_the_only_place_looked_at(tmp_path):
    # The checkout holds MNIST, but a folder the user names is used or refused, never swapped.
    with pytest.raises(MnistNotFoundError, match=r"train-images-idx3-ubyte\.gz not found in"):
        find_mnist(tmp_path)
    named = _copy_of_mnist(tmp_path / "mine")
    (named / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(MnistNotFoundError, match=r"t10k-labels-idx1-ubyte\.gz not found in"):
        find_mnist(named)


def test_the_checkout_comes_before_the_cache(monkeypatch, tmp_path):
    _copy_of_mnist(tmp_path / "mnist")
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path))
    assert find_mnist() == CHECKOUT


def test_without_a_checkout_the_cache_is_read(monkeypatch, tmp_path, no_checkout):
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path))
    cache = _copy_of_mnist(tmp_path / "mnist")
    assert find_mnist() == cache


def test_an_incomplete_cache_is_not_used(monkeypatch, tmp_path, no_checkout):
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path))
    (_copy_of_mnist(tmp_path / "mnist") / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(MnistNotFoundError, match="no MNIST data found"):
        find_mnist()


def test_without_data_the_error_says_how_to_get_it(monkeypatch, tmp_path, no_checkout):
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path))
    with pytest.raises(MnistNotFoundError) as caught:
        find_mnist()
    message = str(caught.value)
    assert "\n" not in message
    assert "`gradaccum data mnist`" in message and "--data DIR" in message
    assert str(tmp_path / "mnist") in message


@pytest.mark.parametrize(("layout", "found"), [
    ("root/src/gradaccum/demos/data_dirs.py", True),  # a checkout with pyproject.toml and data/mnist
    ("venv/lib/python3.11/site-packages/gradaccum/demos/data_dirs.py", False),  # a wheel install
])
def test_a_checkout_is_src_beside_pyproject(monkeypatch, tmp_path, layout, found):
    module = tmp_path / layout
    module.parent.mkdir(parents=True)
    (tmp_path / "root").mkdir(exist_ok=True)
    (tmp_path / "root" / "pyproject.toml").write_text("")
    (tmp_path / "root" / "data" / "mnist").mkdir(parents=True)
    monkeypatch.setattr(data_dirs, "__file__", str(module))
    assert checkout_mnist_dir() == (tmp_path / "root" / "data" / "mnist" if found else None)


@pytest.mark.parametrize("where", [".", "src/gradaccum", "data"])
def test_the_wheel_run_in_the_checkout_reads_its_data(monkeypatch, tmp_path, where):
    # README's install block run line by line puts the wheel over the editable install: the
    # package then lives in site-packages, and the checkout around the command still counts.
    monkeypatch.setattr(data_dirs, "checkout_mnist_dir", lambda: None)
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path))  # an empty cache
    root = CHECKOUT.parents[1]
    monkeypatch.chdir(root / where)
    assert find_mnist() == CHECKOUT


def test_another_projects_data_mnist_is_not_a_checkout(tmp_path):
    project = tmp_path / "other"
    _copy_of_mnist(project / "data" / "mnist")
    (project / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert working_checkout_mnist_dir(project) is None
    (project / "pyproject.toml").write_text('[project]\nname = "gradaccum"\n')
    assert working_checkout_mnist_dir(project / "data") == project / "data" / "mnist"
