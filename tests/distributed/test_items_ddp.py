"""Item weighting under DDP on 2 gloo ranks: summed losses with empty micro-batches and windows
equal one process, a window of no items takes no step, and the guard rails speak up."""

import pytest
import torch

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.items_ranks", tmp_path_factory.mktemp("items"))


@pytest.mark.parametrize("name", ["summed_ints", "summed_tensors"])
def test_summed_losses_with_empty_micro_batches_equal_one_process(ranks, name):
    for r in scenario(ranks, name):
        assert r["stepped"] == [True, True, True] and r["steps"] == 3
        for got, want in zip(r["params"], r["ref"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_a_window_without_items_on_any_rank_takes_no_step(ranks):
    for r in scenario(ranks, "all_empty"):
        assert r["stepped"] == [False, False] and r["steps"] == 0 and r["micro_step"] == 0
        assert r["unchanged"] and r["grads_none"]


def test_a_forward_through_the_unwrapped_module_raises_at_the_boundary(ranks):
    for r in scenario(ranks, "raw_module_forward"):
        assert "no forward ran through model=" in r["outcome"]
        assert r["unchanged_after_error"]
        assert r["steps"] == 1 and r["micro_step"] == 0  # the failed window was dropped


def test_a_model_that_is_not_ddp_under_a_process_group_raises_on_every_rank(ranks):
    # 0.2.0 warned, then each rank normalized by its own item total: the ranks drifted apart.
    for r in scenario(ranks, "model_none_raises"):
        assert "model=None while a process group of 2 ranks" in r["none"]
        assert "sync='local'" in r["none"] and "model=Sequential" in r["module"]
        assert r["local_world"] == 1


def test_fp16_with_n_items_under_ddp_skips_no_more_windows_than_without(ranks):
    # The first window's provisional total is agreed by the ranks (one small all-reduce), so token
    # counts scale no backward by n/N: 0.2.0 used P = N there and overflowed fp16.
    for r in scenario(ranks, "fp16_first_window"):
        assert r["weighted"] <= r["plain"] < r["scaled_by_n_over_N"]
