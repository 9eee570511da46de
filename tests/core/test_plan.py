import pytest

from gradaccum.core import check_batch_sizes, lr_scale, resolve_batch_sizes, split_sizes


def test_lr_scale_rules():
    assert lr_scale(0.01, 32, 64) == pytest.approx(0.02)
    assert lr_scale(0.01, 64, 32) == pytest.approx(0.005)
    assert lr_scale(0.01, 32, 128, rule="sqrt") == pytest.approx(0.02)
    assert lr_scale(0.01, 32, 32) == 0.01


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"base_lr": 0}, "base_lr"),
        ({"base_lr": -1.0}, "base_lr"),
        ({"base_batch": 0}, "base_batch"),
        ({"batch": 2.5}, "batch"),
        ({"rule": "cubic"}, "rule"),
    ],
)
def test_lr_scale_bad_input(kwargs, name):
    args = {"base_lr": 0.01, "base_batch": 32, "batch": 64, **kwargs}
    with pytest.raises((TypeError, ValueError), match=name):
        lr_scale(**args)


def test_batch_sizes_disagreeing_show_all_four_numbers():
    check_batch_sizes(64, 8, 4, 2)
    with pytest.raises(ValueError) as info:
        check_batch_sizes(64, 8, 3, 2)
    for number in ("64", "8", "3", "2"):
        assert number in str(info.value)


def test_resolve_from_any_two():
    assert resolve_batch_sizes(32, 2, None) == (32, 2)
    assert resolve_batch_sizes(None, 2, 64) == (32, 2)
    assert resolve_batch_sizes(8, None, 64, world_size=2) == (8, 4)
    with pytest.raises(ValueError, match="divisible"):
        resolve_batch_sizes(None, 3, 64)
    with pytest.raises(ValueError, match="two of"):
        resolve_batch_sizes(32, None, None)
    with pytest.raises(ValueError, match="global batch 64"):
        resolve_batch_sizes(32, 4, 64)


def test_split_sizes_uneven_last():
    assert split_sizes(10, 4) == [4, 4, 2]
    assert split_sizes(8, 4) == [4, 4]
    assert split_sizes(3, 8) == [3]
    with pytest.raises(ValueError, match="micro_batch"):
        split_sizes(8, 0)
