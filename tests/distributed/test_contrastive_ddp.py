"""The tiled losses as loss_fn of backward_cached on 2 and 4 gloo ranks (CPU), each rank computing
only its share of the rows, against one process on the global batch with the dense formula
(float64, 1e-12): CLIP with the temperature inside the DDP module, InfoNCE with hard negatives
concatenated in loss_fn, SigLIP with scale and bias outside it, SupCon through rank_local, and
FSDP2; ranks holding different numbers of rows, two chunks each, clipped windows. And, for each
loss alone on gathered tensors: every rank's gradient is the whole one, each rank's multiply-adds
are its share of the rows against every column, no tensor is B x B, and the collectives per call.

All scenarios run in one launch of tests/distributed/contrastive_ranks.py per world size.
"""

import pytest

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

WORLDS = [2, 4]
TILE = 5  # as in contrastive_ranks.py


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}-ranks")
def ranks(request, tmp_path_factory):
    return run_ranks("tests.distributed.contrastive_ranks", tmp_path_factory.mktemp("contrastive"),
                     world=request.param)


def largest(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["clip", "info_nce", "siglip", "rank_local", "fsdp"])
def test_each_rank_computing_its_rows_equals_one_process_on_the_global_batch(ranks, name):
    results = scenario(ranks, name)
    for r in results:
        assert largest(r["got"]["params"], r["want"]["params"]) < 1e-12
        assert max(abs(a - b) for a, b in zip(r["got"]["losses"], r["want"]["losses"], strict=True)) < 1e-12
    assert largest(results[0]["got"]["params"], results[-1]["got"]["params"]) == 0  # the ranks agree


def test_under_backward_cached_each_rank_computes_only_its_share_of_the_rows(ranks):
    results = scenario(ranks, "clip")
    world, rows, dim, calls = len(results), 24, 4, 4  # as in contrastive_ranks.py
    for rank, r in enumerate(results):
        share = rows * (rank + 1) // world - rows * rank // world
        assert r["forward_macs"] == [share * rows * dim] * calls  # not rows * rows * dim


# collectives per call: (op, elements) in the forward and the backward pass, for B rows, K columns
# and d features; and the loss's multiply-adds: 4 per element of its rows' blocks (the forward
# product, its recomputation, and the two gradient products).
SENT = {
    "clip": lambda b, k, d: ([("MAX", k), ("SUM", b + k)], [("SUM", (b + k) * d + 1)]),
    "info_nce": lambda b, k, d: ([("SUM", b)], [("SUM", (b + k) * d + 1)]),
    "siglip": lambda b, k, d: ([("SUM", b)], [("SUM", (b + k) * d + 2)]),
    "rank_local": lambda b, k, d: ([("SUM", 1)], [("SUM", (b + k) * d + 1)]),
}


@pytest.mark.parametrize("name", SENT)
def test_each_rank_computes_its_share_of_the_rows_and_gets_the_whole_gradient(ranks, name):
    results = scenario(ranks, f"counts_{name}")
    world = len(results)
    rows, keys, dim = (40, 52, 3) if name == "info_nce" else (40, 40, 3)
    shares = [rows * (r + 1) // world - rows * r // world for r in range(world)]
    for r, share in zip(results, shares, strict=True):
        assert abs(r["loss"] - r["dense"]) < 1e-12
        assert largest(r["grads"], r["want"]) < 1e-12  # every row's, on every rank
        assert (r["forward"], r["backward"]) == SENT[name](rows, keys, dim)
        if name != "rank_local":  # (its blocks are the user's own: one product, autograd's two)
            assert r["macs"] == 4 * share * keys * dim  # this rank's rows against every column
            assert r["largest"] <= (rows + keys) * dim + 2 < rows * keys
    if name != "rank_local":
        assert sum(r["macs"] for r in results) == 4 * rows * keys * dim  # one process's work, shared
