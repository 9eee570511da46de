import pytest

from gradaccum.core import Window


def test_full_mean_window_needs_no_pass():
    w = Window.open(4)
    for _ in range(4):
        assert w.loss_factor(None) == 0.25
        w = w.advance(None)
    assert w.complete
    assert w.grad_factor() == 1.0


def test_short_last_window_is_its_own_mean():
    # 3 of 4 micro-batches, each scaled by 1/4: the correction N/r makes it the mean over 3.
    w = Window.open(4).advance(None).advance(None).advance(None)
    assert not w.complete
    assert w.grad_factor() == pytest.approx(4 / 3)


def test_item_weighting_divides_once_by_the_total():
    w = Window.open(3)
    for n in (5, 1, 7):
        assert w.loss_factor(n) == n
        w = w.advance(n)
    assert w.items == 13
    assert w.grad_factor() == 1 / 13
    assert w.grad_factor(items=6.5) == 1 / 6.5  # the per-rank average under DDP


def test_mixing_weightings_in_one_window_is_an_error():
    w = Window.open(3).advance(None)
    with pytest.raises(ValueError, match="mixes weightings"):
        w.advance(4)
    w = Window.open(3).advance(4)
    with pytest.raises(ValueError, match="n_items=None"):
        w.advance(None)


def test_boundary_flags():
    w = Window.open(2)
    assert w.empty and not w.next_is_last
    w = w.advance(None)
    assert w.next_is_last and not w.complete
    assert Window.open(1).next_is_last


def test_empty_window_has_no_factor():
    with pytest.raises(ValueError, match="empty"):
        Window.open(2).grad_factor()


def test_resize_only_at_boundary():
    assert Window.open(2).resized(4).size == 4
    held = Window.open(2).advance(None)
    assert held.resized(2) is held  # the same size keeps the micro-batches
    with pytest.raises(ValueError, match="boundary"):
        Window.open(2).advance(None).resized(4)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True, None])
def test_window_size_is_validated(bad):
    with pytest.raises((TypeError, ValueError), match="steps"):
        Window.open(bad)
