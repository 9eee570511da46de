"""FSDP2 (``fully_shard``) on 2 gloo ranks (CPU): window sync and every-micro-batch sync, flush,
and clipping of sharded (DTensor) gradients, against a one-process full-batch reference.

All scenarios run in one launch of tests/distributed/fsdp_ranks.py.
"""

import pytest
import torch

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

STEPS, WINDOWS, CLIP = 3, 3, 0.2  # as in fsdp_ranks.py


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.fsdp_ranks", tmp_path_factory.mktemp("fsdp"))


def assert_all_close(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, i=i: f"tensor {i}: {m}")


@pytest.mark.parametrize("mode", ["window", "micro_batch"])
def test_clipped_windows_equal_one_process_full_batch(ranks, mode):
    for r in scenario(ranks, mode):
        assert min(r["ref_norms"]) > CLIP  # clipping is active in every window
        assert_all_close(r["params"], r["ref_params"])
        assert r["world_size"] == 2


@pytest.mark.parametrize("mode", ["window", "micro_batch"])
def test_grad_norm_of_sharded_grads_is_the_global_plain_norm(ranks, mode):
    for r in scenario(ranks, mode):
        assert r["norm_types"] == ["Tensor"] * WINDOWS
        torch.testing.assert_close(r["norms"], r["ref_norms"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["window", "micro_batch"])
def test_window_loss_is_the_global_full_batch_loss(ranks, mode):
    for r in scenario(ranks, mode):
        torch.testing.assert_close(r["losses"], r["ref_losses"], atol=1e-12, rtol=0)


def test_window_sync_holds_no_sharded_grads_mid_window(ranks):
    for r in scenario(ranks, "window"):
        assert r["held"] == [[False] * 4] * (WINDOWS * (STEPS - 1))


def test_micro_batch_sync_reduce_scatters_every_backward(ranks):
    for r in scenario(ranks, "micro_batch"):
        assert r["held"] == [[True] * 4] * (WINDOWS * (STEPS - 1))


@pytest.mark.parametrize("mode", ["flush_window", "flush_micro_batch"])
def test_flush_of_a_partial_window_is_exact(ranks, mode):
    for r in scenario(ranks, mode):
        assert r["flushed"] == [True, True, False]
        assert_all_close(r["params"], r["ref_params"])


def test_mid_window_checkpoint_is_refused_only_under_window_sync(ranks):
    for r in scenario(ranks, "checkpoint_and_discard"):
        assert "save at a window boundary" in r["window"]
        assert r["micro_batch"] == ""


@pytest.mark.parametrize("mode", ["window", "micro_batch"])
def test_discard_drops_the_gradients_fsdp_holds(ranks, mode):
    for r in scenario(ranks, "checkpoint_and_discard"):
        assert_all_close(r[f"{mode}_params"], r["ref_params"])


def test_sharded_submodules_under_an_unsharded_root_are_refused(ranks):
    for r in scenario(ranks, "unsharded_root"):
        assert "call fully_shard(model) on the root" in r["message"]


def test_a_cleared_sharded_gradient_is_refused_and_a_window_held_by_fsdp_is_exact(ranks):
    for r in scenario(ranks, "edited_grads"):
        assert r["micro_batch"].startswith("the gradient of parameter '2.bias' was cleared"), r["micro_batch"]
        assert r["window"] == "stepped: 1"
        assert_all_close(r["window_params"], r["ref_params"])
