import pytest

from gradaccum.core import Window
from gradaccum.core.window import provisional_total


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


def test_the_window_is_an_immutable_record():
    w = Window.open(2)
    nxt = w.advance(3, scale=6, losses=(("loss", 3),))
    assert (w.micro_step, w.items, w.losses) == (0, 0, ())  # the old record is as it was
    assert (nxt.micro_step, nxt.items, nxt.scale, nxt.losses) == (1, 3, 6, (("loss", 3),))
    with pytest.raises(AttributeError):
        nxt.items = 4


def test_the_scale_is_fixed_by_the_first_micro_batch():
    w = Window.open(3).advance(2, scale=6).advance(5, scale=99)
    assert w.scale == 6 and w.items == 7


def test_provisional_total_is_n_times_the_count_and_never_zero():
    assert provisional_total(4, 3) == 12
    assert provisional_total(0, 3) == 3  # a window of summed losses with no item
    assert provisional_total(2.5, 2) == 5.0


@pytest.mark.parametrize("counts, basis", [([4, 4], 4), ([4, 2, 6], 4), ([3, 4], 3.5)])
def test_the_next_window_derives_from_this_windows_mean_count(counts, basis):
    w = Window.open(len(counts))
    for n in counts:
        w = w.advance(n, scale=provisional_total(w.first_count(n), w.size))
    got = w.next_basis()
    assert got == basis and type(got) is type(basis)  # an even total stays an int (exact P)


def test_equal_counts_give_a_correction_of_exactly_one():
    w = Window.open(3, basis=4)
    for _ in range(3):
        w = w.advance(4, scale=provisional_total(w.first_count(4), 3))
    assert w.scale == 12 and w.grad_factor() == 1.0


def test_the_basis_is_carried_by_mean_windows_and_resizes():
    w = Window.open(2, basis=5).advance(None).advance(None)
    assert w.next_basis() == 5
    assert Window.open(2, basis=5).resized(4).basis == 5


def test_the_loss_denominator_is_the_micro_steps_or_the_item_total():
    assert Window.open(4).advance(None).loss_denominator() == 1
    assert Window.open(4).advance(3).advance(5).loss_denominator() == 8
    assert Window.open(4).advance(3).loss_denominator(items=6.5) == 6.5
