import pytest

from gradaccum.core import Schedule, as_schedule


def test_constant():
    s = as_schedule(3)
    assert s.constant == 3 and s(0) == 3 and s(100) == 3
    assert s.describe() == 3


def test_mapping_is_piecewise_constant():
    s = Schedule({0: 4, 2: 2})
    assert [s(k) for k in range(5)] == [4, 4, 2, 2, 2]
    assert s.constant is None


def test_mapping_without_zero_starts_at_one():
    s = Schedule({3: 8})
    assert [s(k) for k in (0, 2, 3, 9)] == [1, 1, 8, 8]


def test_callable_result_is_validated():
    assert Schedule(lambda k: 1 + k)(2) == 3
    with pytest.raises(ValueError, match=r"steps\(0\)"):
        Schedule(lambda k: 0)(0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True, None])
def test_bad_steps_name_the_argument(bad):
    with pytest.raises((TypeError, ValueError), match="steps") as info:
        as_schedule(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [{}, {0: 0}, {-1: 2}, {0: 2.5}, {"a": 2}])
def test_bad_mappings(bad):
    with pytest.raises((TypeError, ValueError), match="steps"):
        Schedule(bad)


def test_describe_tells_schedules_apart():
    assert Schedule({0: 4, 2: 2}).describe() != Schedule({0: 4, 3: 2}).describe()
    assert Schedule({0: 4}, by="epoch").describe() != Schedule({0: 4}).describe()
