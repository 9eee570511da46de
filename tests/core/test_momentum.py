"""The BatchNorm momentum rules for N micro-steps per update."""

import pytest

from gradaccum.core.momentum import scaled_momentum


@pytest.mark.parametrize("m", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("n", [2, 3, 16])
def test_compound_rule_decays_n_steps_like_one(m: float, n: int) -> None:
    assert (1 - scaled_momentum(m, n)) ** n == pytest.approx(1 - m, abs=1e-14)


def test_linear_rule_is_m_over_n_and_decays_less() -> None:
    assert scaled_momentum(0.1, 4, "linear") == 0.025
    assert (1 - 0.025) ** 4 > 1 - 0.1  # the first-order rule keeps more of the old statistics


@pytest.mark.parametrize(("args", "error", "name"), [
    ((1.5, 4), ValueError, "momentum"),
    ((float("nan"), 4), ValueError, "momentum"),
    ((True, 4), TypeError, "momentum"),
    ((0.1, 0), ValueError, "steps"),
    ((0.1, 2.0), TypeError, "steps"),
    ((0.1, 2, "cubic"), ValueError, "rule"),
])
def test_bad_arguments_name_themselves(args: tuple, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        scaled_momentum(*args)
