import pytest

from gradaccum.core import Schedule, as_schedule, parse_schedule


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


def test_parse_schedule_reads_start_n_pairs():
    s = parse_schedule("0:4,2:2")
    assert [s(k) for k in range(5)] == [4, 4, 2, 2, 2]
    assert s.describe() == Schedule({0: 4, 2: 2}).describe()


def test_parse_schedule_ignores_spaces_and_order():
    assert parse_schedule(" 2 : 2 , 0:4 ").describe() == Schedule({0: 4, 2: 2}).describe()


def test_parse_schedule_reads_a_constant():
    assert parse_schedule("8").constant == 8


def test_parse_schedule_by_epoch():
    assert parse_schedule("0:4,1:2", by="epoch").by == "epoch"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "'' is not an integer"),
        ("0", "N must be >= 1, got 0"),
        ("0:4,", "'' is not 'start:N'"),
        ("0-4", "'0-4' is not an integer"),
        ("0:4:2", "'0:4:2' is not 'start:N'"),
        ("0:4,a:2", "start 'a' is not an integer"),
        ("0:4,2:x", "N 'x' is not an integer"),
        ("0:4,2:2.5", "N '2.5' is not an integer"),
        ("0:4,0:2", "start 0 appears twice"),
        ("-1:4", "start must be >= 0, got -1"),
        ("0:0", "N must be >= 1, got 0"),
    ],
)
def test_parse_schedule_errors_quote_the_text_and_the_entry(text, match):
    with pytest.raises(ValueError, match="steps schedule") as info:
        parse_schedule(text)
    assert match in str(info.value) and repr(text) in str(info.value)


def test_parse_schedule_wants_a_string():
    with pytest.raises(TypeError, match="steps schedule must be a string"):
        parse_schedule(4)  # type: ignore[arg-type]
