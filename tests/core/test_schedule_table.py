"""Schedule.table(): the step-function form a compiled graph looks N up in."""

import pytest

from gradaccum.core import Schedule


@pytest.mark.parametrize("spec", [3, {0: 4, 2: 2}, {3: 8}, {1: 2, 4: 5, 9: 1}])
def test_table_agrees_with_calling_the_schedule(spec):
    s = Schedule(spec)
    starts, sizes = s.table()
    assert starts[0] == 0 and starts == sorted(starts)
    for count in range(12):
        i = sum(1 for start in starts if start <= count) - 1  # the lookup the graph does
        assert sizes[i] == s(count)


def test_callable_has_no_table():
    assert Schedule(lambda k: 2).table() is None
