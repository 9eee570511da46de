"""The memory plan's arithmetic: a line through two probes, the floor, the recommendation."""

import pytest

from gradaccum.core.memory import MemoryEstimate, fit_line, fit_probes, format_bytes, parse_bytes

MiB = 2**20
EST = MemoryEstimate(param_bytes=10 * MiB, grad_bytes=10 * MiB, optimizer_bytes=20 * MiB,
                     activation_bytes_per_sample=4 * MiB, overhead_bytes=8 * MiB)


def test_peak_is_static_plus_overhead_plus_activations():
    assert EST.static_bytes == 40 * MiB
    assert EST.peak(1) == EST.floor == 52 * MiB
    assert EST.peak(16) == (48 + 64) * MiB


def test_recommendation_takes_fewest_steps_and_spreads_the_batch():
    # 512 MiB leaves 464 MiB for activations: 116 samples; 256 needs 3 steps of 86 (86+86+84).
    assert EST.max_micro_batch(512 * MiB) == 116
    assert EST.recommend(256, 512 * MiB) == (86, 3)
    assert EST.peak(86) <= 512 * MiB
    assert EST.recommend(64, 512 * MiB) == (64, 1)
    assert EST.recommend(256, EST.floor) == (1, 256)


def test_max_micro_batch_is_exact_at_the_edge():
    budget = EST.peak(40)
    assert EST.max_micro_batch(budget) == 40
    assert EST.max_micro_batch(budget - 1) == 39


def test_budget_below_the_floor_is_a_clear_error():
    with pytest.raises(ValueError, match=r"budget 51\.0 MiB .* is below the floor 52\.0 MiB"):
        EST.recommend(256, 51 * MiB)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: EST.peak(0), "micro_batch must be a positive integer.*0"),
    (lambda: EST.recommend(0, 512 * MiB), "global_batch must be a positive integer.*0"),
    (lambda: EST.recommend(64, 0), "budget must be a positive integer.*0"),
    (lambda: fit_line(4, 1.0, 4, 2.0), "must differ, got 4 and 4"),
    (lambda: fit_line(0, 1.0, 4, 2.0), "probe micro-batch must be a positive integer.*0"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_optimizer_steps_own_peak_bounds_small_micro_batches():
    est = MemoryEstimate(10 * MiB, 10 * MiB, 20 * MiB, 4 * MiB, 8 * MiB, update_peak_bytes=70 * MiB)
    assert est.peak(1) == est.peak(4) == est.floor == 70 * MiB
    assert est.peak(8) == 80 * MiB
    assert est.max_micro_batch(76 * MiB) == 7
    with pytest.raises(ValueError, match=r"below the floor 70\.0 MiB"):
        est.max_micro_batch(60 * MiB)


def test_line_through_two_probes():
    assert fit_line(4, 100.0, 8, 140.0) == (10.0, 60.0)


@pytest.mark.parametrize(("text", "value"), [("512MiB", 512 * MiB), ("2GB", 2 * 10**9),
                                             ("1.5 GiB", 3 * 2**29), ("4096", 4096), (7, 7),
                                             (f"{2**60 + 1}B", 2**60 + 1), (2**60 + 1, 2**60 + 1),
                                             ("1.9B", 1)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "0MiB", "-5GB", "", "0.5B", 0])
def test_parse_bytes_rejects_non_sizes(text):
    with pytest.raises(ValueError, match="budget"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.0 GiB" and format_bytes(512) == "512 B"


def test_least_squares_line_through_several_probes():
    assert fit_probes([(2, 18.0), (4, 26.0), (8, 42.0), (16, 74.0)]) == (4.0, 10.0)  # on one line
    # Not on one line: the least-squares slope (8.5 / 5) through the means (2.5, 5.75).
    slope, intercept = fit_probes([(1, 4.0), (2, 4.0), (3, 6.0), (4, 9.0)])
    assert (slope, intercept) == (pytest.approx(1.7), pytest.approx(1.5))
    assert fit_probes([(4, 100.0), (8, 140.0)]) == fit_line(4, 100.0, 8, 140.0)


@pytest.mark.parametrize(("points", "match"), [([(4, 1.0)], "at least two"),
                                               ([(2, 1.0), (4, 2.0), (2, 3.0)], "must differ"),
                                               ([(0, 1.0), (4, 2.0)], "probe micro-batch")])
def test_bad_probe_sets_are_named(points, match):
    with pytest.raises(ValueError, match=match):
        fit_probes(points)

