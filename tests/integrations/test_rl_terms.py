"""The recipe `rl-terms` of docs/INTEGRATIONS.md: a policy term per sequence, an entropy bonus per
token and an auxiliary loss per micro-batch in one window, against the full batch in float64."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.common import run
from tests.torch.test_terms import AUX, BETA, SPLITS, batch, chunks, fresh, params_of, per_token, reference


def windows_of(data, sizes):
    return [[{"x": x, "targets": t, "advantages": a, "completion_mask": m}
             for x, t, a, m in chunks(data, sizes)]]


def compute_losses(model, inputs):
    return per_token(model, inputs["x"], inputs["targets"], inputs["advantages"])


@pytest.mark.parametrize("split", SPLITS)
def test_the_terms_recipe_matches_the_full_batch(split):
    sizes, data = SPLITS[split], batch()
    ref, model = fresh(), fresh()
    reference(ref, data, sizes)
    assert int(data[3].sum()) == 66  # the tokens the docs name
    ns = run("rl-terms", {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
                          "gradient_accumulation_steps": len(sizes), "windows": windows_of(data, sizes),
                          "compute_losses": compute_losses, "entropy_coef": BETA, "aux_coef": AUX})
    assert ns["acc"].optimizer_steps == 1
    assert (params_of(model) - params_of(ref)).abs().max() < 1e-12
    assert (params_of(model) - params_of(fresh())).abs().max() > 1e-2


@pytest.mark.slow
def test_the_terms_recipe_on_two_ranks_is_the_full_batch_and_local_totals_raise_on_both(tmp_path):
    from tests.ranks import run_ranks, scenario

    ranks = run_ranks("tests.integrations.rl_terms_ranks", tmp_path, world=2, timeout=120)
    data, ref = batch(), fresh()
    reference(ref, data, [2, 2, 2, 2])  # rank 0 holds completions 0-3, rank 1 4-7
    for got in scenario(ranks, "recipe"):
        assert got["steps"] == 1
        assert (got["params"] - params_of(ref)).abs().max() < 1e-12
    # Totals over one rank's micro-batches only: 1.8x to 2.3x the gradient, before; now the
    # window's counts (summed across ranks in its all-reduce) refuse it, with one error everywhere.
    errors = [got["raised"] for got in scenario(ranks, "local_totals")]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "sum it over the 2 ranks" in errors[0] and "mb.term #0" in errors[0]
