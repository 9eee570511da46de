"""A guard that refuses on one rank only, under DDP and FSDP2 on 2 gloo ranks: every rank raises
the same error at the window's boundary, the window is dropped on every rank, nothing hangs.

Raised on that rank alone (as before), the other rank waited in the window's gradient reduction
(or the boundary's small all-reduce, or flush's agreement) until the process group's timeout.
All scenarios run in one launch of tests/distributed/guard_ranks.py, each on a group of its own
with a 5 s timeout.
"""

import pytest
import torch

from tests.distributed.guard_ranks import SCENARIOS
from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

SAID = {"zero_grad": "cleared", "edit": "changed in place", "stale": "", "scheduler": "scheduler.step()"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.guard_ranks", tmp_path_factory.mktemp("guard"), timeout=240)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_the_same_error_and_drops_the_window(ranks, name):
    r0, r1 = scenario(ranks, name)
    assert r0["raised"] and r0["raised"] == r1["raised"], (r0["raised"], r1["raised"])
    assert SAID[SCENARIOS[name]["mistake"]] in r0["raised"]
    assert "[rank(s) 1; raised on every rank at the window's boundary" in r0["raised"]
    for r in (r0, r1):
        assert r["dropped"] and r["optimizer_steps"] == 0 and r["micro_step"] == 0


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_next_window_is_exact_as_if_the_dropped_one_never_ran(ranks, name):
    # Rank 1's own scheduler.step() left its learning rate halved (said once, then checked from
    # there): its next window steps, but cannot match the reference.
    for r in scenario(ranks, name):
        assert r["clean_stepped"]
        if SCENARIOS[name]["mistake"] != "scheduler":
            for a, b in zip(r["clean_params"], r["ref_params"], strict=True):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_nan_loss_without_a_mistake_is_skipped_as_before_not_refused(ranks):
    # A refusing rank sends NaN as its loss sum; a NaN loss of the window's own must not be taken
    # for one (the ranks agree once more when the reduced loss is NaN).
    for r in scenario(ranks, "nan_loss"):
        assert r == {"raised": "", "skipped": 1, "optimizer_steps": 0}
