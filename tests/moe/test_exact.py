"""LoadBalance trains exactly as one process on the whole window, whose loss (the LM loss over
every token plus the window's balancing loss) the test writes out itself (tests/moe/models.py):
float64, 3 windows of uneven micro-batches (3+3+2 sequences) with padding, SGD with momentum, a
clip that acts on every window and a scheduler. "rolling" and "micro_batch" each equal their own
reference loop, and differ from "global" (their distance is printed)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.moe.models import (
    CLIP,
    balance_loss,
    batches,
    mixtral,
    qwen3_moe,
    reference,
    routers_of,
    stats,
    tiny_moe,
    train,
)
from tests.moe.models import (
    max_diff as diff,
)

WINDOWS = 3
TOL = 1e-12


@pytest.fixture(scope="module")
def data():
    return [batches(w) for w in range(WINDOWS)]


@pytest.fixture(scope="module")
def qwen():
    return qwen3_moe()


@pytest.fixture(scope="module")
def qwen_global(qwen, data):
    return reference(qwen, data, "global", top_k=2)


def assert_exact(got, ref):
    assert min(ref["norms"]) > CLIP  # the clip acts on every window
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-12, atol=0)
    assert diff(got["params"], ref["params"]) < TOL


def test_qwen3_moe_global_equals_one_process_on_the_whole_window(qwen, data, qwen_global):
    got = train(qwen, data, steps=3, mode="global")
    assert_exact(got, qwen_global)
    assert got["acc"].optimizer_steps == WINDOWS
    # the model's own auxiliary loss was switched off (else counted twice)
    assert got["model"].config.output_router_logits is False


def test_mixtral_global_equals_one_process_on_the_whole_window(data):
    model = mixtral()
    assert_exact(train(model, data, steps=3, mode="global"), reference(model, data, "global", top_k=2))


@pytest.mark.parametrize("mode", ["rolling", "micro_batch"])
def test_qwen3_moe_one_pass_modes_equal_their_own_loop_and_differ_from_global(qwen, data, qwen_global, mode):
    got = train(qwen, data, steps=3, mode=mode)
    assert_exact(got, reference(qwen, data, mode, top_k=2))
    apart = diff(got["params"], qwen_global["params"])
    print(f"qwen3-moe {mode}: max parameter distance from 'global' after {WINDOWS} windows {apart:.2e}")
    assert apart > 1e-6


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_counts_each_router_once(qwen, data, qwen_global, reentrant):
    # torchtitan refuses checkpointing with its global balance: a recomputed router would count
    # its routes twice. Here the recomputation (inside the backward) is not counted, and a
    # reentrant checkpoint's router, which first ran without grad, gets its gradient there.
    model = copy.deepcopy(qwen)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    for gate in routers_of(model):
        gate.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    got = train(model, data, steps=3, mode="global")
    assert_exact(got, qwen_global)
    # each router ran 3 times per micro-batch: the pre-pass, the forward, the recomputation
    assert len(calls) == 3 * 2 * 3 * WINDOWS
    tokens = sum(float(b["attention_mask"].sum()) for b in data[-1])
    assert float(got["balance"].load.sum()) == 2 * 2 * tokens  # layers x top-k x tokens: once


@pytest.mark.parametrize("mode", ["global", "rolling", "micro_batch"])
def test_a_moe_of_ones_own_per_layer_equals_its_reference(data, mode):
    model = tiny_moe()
    got = train(model, data, steps=3, mode=mode, routers="own", per_layer=True, top_k=2, coef=0.5)
    ref = reference(model, data, mode, top_k=2, per_layer=True, whole=(mode == "global"))
    assert_exact(got, ref)


def test_mean_weighted_backward_gets_the_same_balancing_gradient(data):
    # No n_items on the backward: the LM loss is the mean of the micro-batches' means, and the
    # balancing loss is still the window's, weighted 1.
    model = tiny_moe(seed=1)
    got = train(model, data, steps=3, mode="global", routers="own", top_k=2, coef=0.5, items=False)
    assert_exact(got, reference(model, data, "global", top_k=2, items_weighted=False))


def test_a_short_last_window_is_flushed_as_its_own_window(data):
    model = tiny_moe(seed=2)
    loader = [*data, data[0][:2]]  # 3 full windows and one of 2 micro-batches
    got = train(model, loader, steps=3, mode="global", routers="own", top_k=2, coef=0.5)
    assert got["acc"].optimizer_steps == 4
    assert_exact(got, reference(model, loader, "global", top_k=2))


def test_the_aux_free_bias_is_one_update_per_window_from_its_whole_load(data):
    # DeepSeek-V3's auxiliary-loss-free balance: a routing bias moved once per optimizer step
    # against the window's load (here with coef=0: no balancing loss at all).
    model = tiny_moe(seed=3)
    loads = {"ref": [], "got": []}

    def update(key):
        def fn(trained, load):
            loads[key].append(load.clone())
            for layer, router in enumerate(routers_of(trained)):
                router.bias += 0.2 * torch.sign(load[layer].mean() - load[layer])
        return fn

    ref = reference(model, data, "global", top_k=2, coef=0.0, whole=True, after=update("ref"))
    got = train(model, data, steps=3, mode="global", routers="own", top_k=2, coef=0.0,
                after_window=update("got"))
    assert_exact(got, ref)
    assert len(loads["got"]) == WINDOWS
    for a, b in zip(loads["got"], loads["ref"], strict=True):
        assert torch.equal(a, b)
    biases = [r.bias for r in routers_of(got["model"])]
    assert all(b.abs().sum() > 0 for b in biases)  # the bias moved
    for a, b in zip(biases, [r.bias for r in routers_of(ref["model"])], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got["balance"].load, loads["ref"][-1])


def test_balance_loss_written_out_matches_hugging_face_on_one_batch(qwen, data):
    # The test's own formula (pooled) is Hugging Face's load_balancing_loss_func, in float64.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from tests.moe.models import Logits, concat

    whole = concat(data[0])
    with torch.no_grad(), Logits(routers_of(qwen)) as rec:
        qwen(**whole)
    counts, sums = stats(rec.seen, whole["attention_mask"], 2)
    tokens = float(whole["attention_mask"].sum())
    ours = balance_loss(counts, sums, tokens, tokens, 2, per_layer=False, coef=1.0)
    theirs = load_balancing_loss_func(tuple(rec.seen), 8, 2, whole["attention_mask"])
    torch.testing.assert_close(ours, theirs.to(torch.float64), rtol=1e-6, atol=0)  # theirs: float32
