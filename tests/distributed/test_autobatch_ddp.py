"""AutoBatch under DDP on 2 gloo ranks: the ranks agree on an OOM before any of them retries.

All scenarios run in one launch of tests/distributed/autobatch_ranks.py (spawning ranks costs
seconds); each test checks one behaviour of that run. A deadlock fails the launch at its timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("autobatch_ddp")
    return run_ranks("tests.distributed.autobatch_ranks", out, timeout=180.0)


def test_an_oom_on_one_rank_makes_every_rank_retry_and_training_stays_exact(ranks):
    r0, r1 = scenario(ranks, "recovers_on_both_ranks")
    assert r0["steps"] == r1["steps"] == 4
    assert r0["ooms"] == r1["ooms"] == 2 and r0["micro_batch"] == r1["micro_batch"] == 1
    for a, b, ref in zip(r0["params"], r1["params"], r0["reference"], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, atol=1e-12, rtol=0)


def test_oom_at_micro_batch_one_on_one_rank_stops_every_rank(ranks):
    r0, r1 = scenario(ranks, "oom_at_one_on_one_rank")
    assert r0["error_type"] == r1["error_type"] == "NoMicroBatchFitsError"
    assert "on another rank" in r0["message"] and "CUDA out of memory" in r1["message"]
    assert r0["grads_none"] and r1["grads_none"]


def test_ranks_that_split_into_other_part_counts_get_a_clear_error(ranks):
    r0, r1 = scenario(ranks, "ranks_with_other_part_counts")
    for r in (r0, r1):
        assert "2 to 3 micro-batches" in r["message"] and r["micro_step"] == 0


def test_oom_in_a_synced_last_micro_batch_raises_instead_of_hanging(ranks):
    # What remains unrecoverable: the rank that ran out says why; the rank waiting in the
    # gradient all-reduce fails when the first one leaves (gloo), instead of hanging.
    r0, r1 = scenario(ranks, "oom_in_a_synced_last_micro_batch")
    assert r1["error_type"] == "RuntimeError" and r1["cause"] == "OutOfMemoryError"
    assert "last micro-batch of a window under DDP" in r1["message"]
    assert r0["error_type"] == "RuntimeError"
