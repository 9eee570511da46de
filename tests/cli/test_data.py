"""`gradaccum data mnist` against a local HTTP server (no internet here): the four files arrive
md5-checked; a corrupt one is refused with nothing left behind; without data, the commands that
read MNIST say in one line how to get it (exit 2)."""

import functools
import gzip
import http.server
import shutil
import threading

import pytest

from gradaccum.demos import data_dirs
from gradaccum.demos.data_dirs import MNIST_FILES, checkout_mnist_dir, find_mnist
from tests.cli import run

CHECKOUT = checkout_mnist_dir()


class _Handler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def do_GET(self):
        self.requests.append(self.path)
        super().do_GET()

    def log_message(self, format, *args):  # quiet
        pass


@pytest.fixture
def serve(tmp_path, monkeypatch):
    """``serve(folder)``: the base URL of an HTTP server on 127.0.0.1 that serves ``folder``, and
    the list of paths it was asked for."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")  # a CI proxy must not see the local server
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    servers = []

    def start(folder):
        requests = []
        handler = type("Handler", (_Handler,), {"requests": requests})
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/mnist/", requests

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def mirror(tmp_path):
    """A mirror's folder, ``mirror/mnist/``, holding copies of the checkout's four files."""
    folder = tmp_path / "mirror" / "mnist"
    folder.mkdir(parents=True)
    for name in MNIST_FILES:
        shutil.copy(CHECKOUT / name, folder / name)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty user cache (GRADACCUM_DATA) and no checkout: what a wheel install run outside a
    checkout sees."""
    monkeypatch.setenv("GRADACCUM_DATA", str(tmp_path / "cache"))
    monkeypatch.setattr(data_dirs, "checkout_mnist_dir", lambda: None)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache"


def _corrupt(path):
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[100] = (raw[100] + 1) % 10  # one label changed: valid gzip and IDX, not MNIST's bytes
    path.write_bytes(gzip.compress(bytes(raw)))


def test_downloads_the_four_files_into_the_cache(serve, mirror, cache, capsys):
    url, requests = serve(mirror.parent)
    code = run(["data", "mnist", "--mirror", url], capsys)[0]
    assert code == 0
    assert sorted(requests) == sorted(f"/mnist/{name}" for name in MNIST_FILES)
    for name in MNIST_FILES:
        assert (cache / "mnist" / name).read_bytes() == (CHECKOUT / name).read_bytes()
    assert sorted(p.name for p in (cache / "mnist").iterdir()) == sorted(MNIST_FILES)  # no leftovers
    assert find_mnist() == cache / "mnist"


def test_prints_one_line_per_file_and_where_the_data_is(serve, mirror, cache, capsys):
    url, _ = serve(mirror.parent)
    from gradaccum.cli import main

    assert main(["data", "mnist", "--mirror", url]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == list(MNIST_FILES)
    assert all("md5 ok" in line for line in lines[:4])
    assert lines[4].startswith(f"MNIST in {cache / 'mnist'}: 4 files, md5-checked (downloaded)")


def test_a_second_run_downloads_nothing(serve, mirror, cache, capsys):
    url, requests = serve(mirror.parent)
    assert run(["data", "mnist", "--mirror", url], capsys)[0] == 0
    requests.clear()
    from gradaccum.cli import main

    assert main(["data", "mnist", "--mirror", url]) == 0
    assert requests == [] and "(already there)" in capsys.readouterr().out


def test_a_corrupt_file_is_refused_and_nothing_is_left(serve, mirror, cache, capsys):
    _corrupt(mirror / "t10k-labels-idx1-ubyte.gz")  # the last file: three good ones came before it
    url, _ = serve(mirror.parent)
    code, err = run(["data", "mnist", "--mirror", url], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gradaccum data: error: t10k-labels-idx1-ubyte.gz: no mirror gave a good copy")
    assert "is corrupt: md5" in lines[0] and "nothing was written" in lines[0]
    assert not cache.exists()  # the folders made for the download are gone again


def test_a_damaged_cache_keeps_its_good_files_and_gets_the_bad_one_again(serve, mirror, cache, capsys):
    shutil.copytree(mirror, cache / "mnist")
    _corrupt(cache / "mnist" / "train-labels-idx1-ubyte.gz")
    url, requests = serve(mirror.parent)
    assert run(["data", "mnist", "--mirror", url], capsys)[0] == 0
    assert requests == ["/mnist/train-labels-idx1-ubyte.gz"]
    for name in MNIST_FILES:
        assert (cache / "mnist" / name).read_bytes() == (CHECKOUT / name).read_bytes()


def test_a_failed_download_leaves_an_existing_folder_as_it_was(serve, mirror, cache, capsys):
    shutil.copytree(mirror, cache / "mnist")
    (cache / "mnist" / "t10k-images-idx3-ubyte.gz").unlink()
    (mirror / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    url, _ = serve(mirror.parent)
    code, err = run(["data", "mnist", "--mirror", url], capsys)
    assert code == 1 and "truncated or not gzip" in err
    assert sorted(p.name for p in (cache / "mnist").iterdir()) == sorted(
        set(MNIST_FILES) - {"t10k-images-idx3-ubyte.gz"})


def test_the_next_mirror_is_tried_when_one_fails(serve, mirror, tmp_path, cache, capsys):
    empty = tmp_path / "empty"
    (empty / "mnist").mkdir(parents=True)
    broken, _ = serve(empty)  # answers 404 for every file
    good, requests = serve(mirror.parent)
    dest = tmp_path / "elsewhere"
    from gradaccum.cli import main

    assert main(["data", "mnist", "--dir", str(dest), "--mirror", broken, "--mirror", good]) == 0
    assert len(requests) == 4 and find_mnist(dest) == dest
    assert f"use it with --data {dest}" in capsys.readouterr().out
    assert not cache.exists()  # --dir: the cache is left alone


def test_a_folder_that_cannot_be_written_is_bad_usage(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    code, err = run(["data", "mnist", "--dir", str(tmp_path / "afile" / "mnist"),
                     "--mirror", "http://127.0.0.1:9/"], capsys)
    assert code == 2 and "is not a writable folder" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["train"], ["compare"], ["bench", "--smoke"]])
def test_without_data_a_command_says_how_to_get_it(argv, cache, capsys):
    code, err = run(argv, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"gradaccum {argv[0]}: error: no MNIST data found: run `gradaccum data mnist` (downloads "
        f"11 MB into {cache / 'mnist'}, md5-checked), or pass --data DIR, a folder with the four .gz files"]


@pytest.mark.parametrize("option", ["--data", "--data-dir"])
def test_data_names_the_folder_to_read(option, tmp_path, cache, capsys):
    code, err = run(["train", option, str(tmp_path), "--epochs", "1"], capsys)
    assert code == 2 and f"train-images-idx3-ubyte.gz not found in {tmp_path}" in err


def test_offline_the_error_names_each_mirror_and_the_data_option(cache, capsys):
    # No internet: every mirror refuses the connection (a closed port on 127.0.0.1 stands in).
    code, err = run(["data", "mnist", "--mirror", "http://127.0.0.1:9/a/", "--mirror", "http://127.0.0.1:9/b/"],
                    capsys)
    assert code == 1
    (line,) = err.strip().splitlines()
    assert line.startswith("gradaccum data: error: train-images-idx3-ubyte.gz: no mirror gave a good copy")
    assert "127.0.0.1:9/a/" in line and "127.0.0.1:9/b/" in line  # each mirror's failure
    assert "pass --data DIR to train, compare and bench" in line
    assert not cache.exists()
