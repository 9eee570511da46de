"""The MNIST reader: the checkout's copy loads; a missing, truncated or corrupt file names itself."""

import gzip
import re
import shutil

import numpy as np
import pytest

from gradaccum.demos.mnist import FILES, default_data_dir, load_mnist, mnist_tensors


def test_the_checkout_copy_loads_with_known_shapes():
    images, labels = load_mnist("train")
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (60000,) and set(np.unique(labels)) == set(range(10))


def test_normalization_is_the_seeds():
    x, y = mnist_tensors("test", limit=100)
    raw, _ = load_mnist("test")
    expected = (raw[:100].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(x.squeeze(1).numpy(), expected, rtol=1e-6)
    assert x.shape == (100, 1, 28, 28) and y.dtype.is_floating_point is False


@pytest.fixture
def copy_dir(tmp_path):
    for name in (f for pair in FILES.values() for f, _ in pair):
        shutil.copy(default_data_dir() / name, tmp_path / name)
    return tmp_path


def test_missing_file_is_named(copy_dir):
    (copy_dir / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("t10k-labels-idx1-ubyte.gz")):
        load_mnist("test", copy_dir)


def test_truncated_file_is_named(copy_dir):
    path = copy_dir / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz .*truncated"):
        load_mnist("test", copy_dir)


def test_corrupt_file_fails_its_md5(copy_dir):
    path = copy_dir / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[100] = (raw[100] + 1) % 10  # one label changed: a valid file, but not MNIST's
    path.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match=re.escape("t10k-labels-idx1-ubyte.gz is corrupt: md5")):
        load_mnist("test", copy_dir)


def test_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_mnist("validation")


def test_a_gzip_bomb_is_refused_without_unpacking_it_whole(tmp_path):
    import gzip

    from gradaccum.demos.mnist import MAX_UNPACKED_BYTES, read_idx

    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        for _ in range(MAX_UNPACKED_BYTES // 2**20 + 2):
            f.write(bytes(2**20))
    assert bomb.stat().st_size < 2**20  # a small file that would unpack to 66 MiB
    with pytest.raises(ValueError, match="unpacks to more than 64 MiB"):
        read_idx(bomb)
