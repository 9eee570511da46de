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
