"""The balancing loss's arithmetic from counts (gradaccum.core.balance): the weights it gives make
``sum a * S`` the loss written the usual way, pooled (Hugging Face) or per layer (Switch)."""

import math
import random

import pytest

from gradaccum.core.balance import MODES, check_coef, check_mode, count_scale


def usual_loss(counts, sums, tokens, experts, top_k, per_layer, coef):
    """``coef * E * sum_i f_i P_i`` written out, from per-layer counts and probability sums."""
    layers = len(counts)
    if per_layer:
        return sum(coef * experts * sum(c / (top_k * tokens) * s / tokens
                                        for c, s in zip(cl, sl, strict=True))
                   for cl, sl in zip(counts, sums, strict=True))
    pooled_c = [sum(cl[i] for cl in counts) for i in range(experts)]
    pooled_s = [sum(sl[i] for sl in sums) for i in range(experts)]
    return coef * experts * sum(c / (layers * tokens) * s / (layers * tokens)
                                for c, s in zip(pooled_c, pooled_s, strict=True))


@pytest.mark.parametrize("per_layer", [False, True])
def test_the_weights_times_the_probability_sums_are_the_loss(per_layer):
    rng = random.Random(0)
    layers, experts, top_k, tokens, coef = 3, 5, 2, 11, 0.3
    counts = [[rng.randint(0, 9) for _ in range(experts)] for _ in range(layers)]
    sums = [[rng.random() * 4 for _ in range(experts)] for _ in range(layers)]
    scale = count_scale(tokens, tokens, layers=layers, experts=experts, top_k=top_k,
                        per_layer=per_layer, coef=coef)
    pooled = [sum(cl[i] for cl in counts) for i in range(experts)]
    weights = [[scale * (counts[layer][i] if per_layer else pooled[i]) for i in range(experts)]
               for layer in range(layers)]
    got = sum(w * s for wl, sl in zip(weights, sums, strict=True) for w, s in zip(wl, sl, strict=True))
    assert got == pytest.approx(usual_loss(counts, sums, tokens, experts, top_k, per_layer, coef), rel=1e-12)


def test_the_pooled_loss_of_one_layer_is_the_per_layer_loss_times_top_k():
    kw = {"layers": 1, "experts": 4, "coef": 1.0}
    assert count_scale(8, 8, top_k=2, per_layer=False, **kw) == 2 * count_scale(8, 8, top_k=2, per_layer=True,
                                                                                 **kw)


def test_modes_and_coef_are_checked():
    assert [check_mode(m) for m in MODES] == ["global", "rolling", "micro_batch"]
    with pytest.raises(ValueError, match="'global', 'rolling', 'micro_batch'"):
        check_mode("roling")
    assert check_coef(0) == 0.0 and check_coef(2) == 2.0
    for bad in (-1e-9, math.nan, math.inf):
        with pytest.raises(ValueError, match="coef"):
            check_coef(bad)
    with pytest.raises(TypeError, match="coef"):
        check_coef(True)
