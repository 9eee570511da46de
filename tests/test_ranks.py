"""The launcher of the distributed tests (tests/ranks.py) leaves no process behind.

A rank past the timeout is killed with its children; once a rank fails, the others get
``GRACE_S`` to finish and are then killed; either way the message holds every rank's log.

No test here waits on a clock: the launcher's clock is replaced by one that stands still until
every rank has written its pid file and its first line (and, when one is to fail, has failed),
then moves on by 10 s per look, so the timeout or the grace period ends exactly after those
events. The kills are then awaited on each process's pidfd, readable once the process ends.
"""

import os
import select
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


class SettledClock:
    """``time`` for tests.ranks: 0 until ``settled()`` holds, then 100, 110, 120, ..."""

    def __init__(self, settled):
        self.settled, self.now = settled, 90.0
        self.sleep = __import__("time").sleep

    def monotonic(self) -> float:
        if not self.settled():
            return 0.0
        self.now += 10.0
        return self.now


def wait_ended(pids: list[int]) -> None:
    """Return once every process has ended (killed: the kernel ends them; nothing is timed)."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        assert not alive(pid)


pytestmark = pytest.mark.skipif(not (Path("/proc/self/stat").exists() and hasattr(os, "pidfd_open")),
                                reason="reads /proc, waits on pidfds")


def started(out: Path) -> bool:
    """Every rank has written its pid file and said so in its log (the probe does both before
    it hangs or fails)."""
    logs = [out / f"rank{r}.log" for r in range(WORLD)]
    return all(log.exists() and f"rank {r} started child" in log.read_text() for r, log in enumerate(logs))


def test_ranks_past_the_timeout_are_killed_with_their_children(tmp_path, monkeypatch):
    (tmp_path / "mode").write_text("hang")
    monkeypatch.setattr(ranks, "time", SettledClock(lambda: started(tmp_path)))
    with pytest.raises(AssertionError, match="ran past 3s; killed") as failure:
        ranks.run_ranks("tests.ranks_probe", tmp_path, world=WORLD, timeout=3.0)
    pids = launched(tmp_path)
    assert len(pids) == 2 * WORLD
    wait_ended(pids)
    for r in range(WORLD):
        assert f"--- rank{r}.log (exit -9)\nrank {r} started child" in str(failure.value)


def test_a_failed_rank_stops_the_others_after_the_grace_period(tmp_path, monkeypatch):
    # The timeout (300 s) is far past the grace period (30 s): only the grace period can end
    # rank 0, which waits "for rank 1".
    def settled():
        return started(tmp_path) and not alive(launched(tmp_path)[2])  # rank 1 failed

    (tmp_path / "mode").write_text("fail")
    clock = SettledClock(settled)
    monkeypatch.setattr(ranks, "time", clock)
    with pytest.raises(AssertionError, match=r"tests\.ranks_probe failed") as failure:
        ranks.run_ranks("tests.ranks_probe", tmp_path, world=WORLD, timeout=300.0)
    message = str(failure.value)
    assert "--- rank0.log (exit -9)" in message
    assert "--- rank1.log (exit 1)" in message and "rank 1 fails on purpose" in message
    assert clock.now < 300.0  # the grace period ended it, not the timeout
    wait_ended(launched(tmp_path))  # rank 1's child too, though rank 1 had ended
