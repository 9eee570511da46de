"""The launcher of the distributed tests (tests/ranks.py) leaves no process behind.

A rank past the timeout is killed with its children; once a rank fails, the others get
``GRACE_S`` to finish and are then killed; either way the message holds every rank's log.
"""

import time
from pathlib import Path

import pytest

from tests import ranks

WORLD = 2


def alive(pid: int) -> bool:
    """True for a running process (an unreaped zombie has ended)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def launched(out: Path) -> list[int]:
    return [int(pid) for r in range(WORLD) for pid in (out / f"pids{r}").read_text().split()]


def all_ended(pids: list[int]) -> bool:
    """Whether every process has ended, given up to 10 s for the kills to land."""
    deadline = time.monotonic() + 10.0
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(alive, pids))


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def test_ranks_past_the_timeout_are_killed_with_their_children(tmp_path):
    (tmp_path / "mode").write_text("hang")
    with pytest.raises(AssertionError, match="ran past 3s; killed") as failure:
        ranks.run_ranks("tests.ranks_probe", tmp_path, world=WORLD, timeout=3.0)
    pids = launched(tmp_path)
    assert len(pids) == 2 * WORLD
    assert all_ended(pids)
    for r in range(WORLD):
        assert f"--- rank{r}.log (exit -9)\nrank {r} started child" in str(failure.value)


def test_a_failed_rank_stops_the_others_after_the_grace_period(tmp_path, monkeypatch):
    # The timeout is far away: only the grace period can end rank 0, which waits "for rank 1".
    monkeypatch.setattr(ranks, "GRACE_S", 1.0)
    (tmp_path / "mode").write_text("fail")
    with pytest.raises(AssertionError, match=r"tests\.ranks_probe failed") as failure:
        ranks.run_ranks("tests.ranks_probe", tmp_path, world=WORLD, timeout=300.0)
    message = str(failure.value)
    assert "--- rank0.log (exit -9)" in message
    assert "--- rank1.log (exit 1)" in message and "rank 1 fails on purpose" in message
    assert all_ended(launched(tmp_path))  # rank 1's child too, though rank 1 had ended
