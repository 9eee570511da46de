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
    print(f"max parameter difference {diff(got['params'], ref['params']):.1e}")
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


def _loop(model, data, feed, **acc_kw):
    import gradaccum
    from tests.moe.models import count, lm_loss, make_opt

    opt, sched = make_opt(model)
    acc = gradaccum.Accumulator(opt, 3, clip_norm=CLIP, scheduler=sched, **acc_kw)
    balance = gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef=0.5)
    for window in balance.windows([b for micro in data for b in micro], acc, n_items=count):
        for batch in window:
            feed(acc, lm_loss(model(**batch)["logits"], batch["labels"]), count(batch))
    return acc, [p.detach().clone() for p in model.parameters()]


def test_a_grad_scaler_and_micro_batch_blocks_carry_the_same_balancing_gradient(data):
    # The balancing gradient is weighted by the backward's seed times the scaler's scale, which
    # the boundary unscales; a micro_batch() block's backward gets it as acc.backward does.
    model = tiny_moe(seed=4)
    ref = reference(model, data, "global", top_k=2, whole=True)

    def block(acc, loss, n):
        with acc.micro_batch(n) as mb:
            mb.backward(loss)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for feed, kw in ((lambda acc, loss, n: acc.backward(loss, n_items=n), {"scaler": scaler}),
                     (block, {})):
        acc, params = _loop(copy.deepcopy(model), data, feed, **kw)
        assert acc.optimizer_steps == WINDOWS
        assert diff(params, ref["params"]) < TOL


def test_dropout_before_the_routers_routes_as_the_pre_pass_counted(data):
    # The pre-pass draws the dropout masks the training forward draws (the RNG replayed, as
    # backward_cached does, even when the loop draws numbers of its own between micro-batches):
    # otherwise the routes differ and the window is refused.
    import gradaccum
    from tests.moe.models import count, lm_loss

    model = tiny_moe(seed=5)
    model.embed.register_forward_hook(lambda m, i, out: torch.nn.functional.dropout(out, 0.5, training=True))
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    balance = gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef=0.5)
    torch.manual_seed(0)
    for window in balance.windows([b for micro in data for b in micro], acc, n_items=count):
        for batch in window:
            acc.backward(lm_loss(model(**batch)["logits"], batch["labels"]), n_items=count(batch))
            torch.rand(5)  # the loop's own random numbers (an augmentation, a sampler)
    assert acc.optimizer_steps == WINDOWS


@pytest.mark.parametrize("make", ["qwen2_moe", "olmoe"])
def test_qwen2_moe_and_olmoe_routers_are_found_and_trained_exactly(data, make):
    from tests.moe import models

    model = getattr(models, make)()
    got = train(model, data, steps=3, mode="global")
    balance = got["balance"]
    assert [id(r) for r in balance.routers] == [id(r) for r in routers_of(got["model"])]
    assert (balance.top_k, balance.coef, tuple(balance.load.shape)) == (2, 0.5, (2, 4))
    assert_exact(got, reference(model, data, "global", top_k=2))


def test_the_hugging_face_recipe_as_written_is_exact_to_float32_rounding(data):
    # Unpatched Qwen3-MoE (float32 routing, norms, attention softmax) and its own outputs.loss
    # (float32 LM loss): the window's update to the float32 steps' rounding, not 1e-12.
    model = qwen3_moe(wide=False)
    got = train(model, data, steps=3, mode="global", hf_loss=True)
    ref = reference(model, data, "global", top_k=2)
    apart = diff(got["params"], ref["params"])
    print(f"qwen3-moe as shipped (float32 steps inside): {apart:.1e} from the whole window")
    assert apart < 1e-6


def test_the_pre_pass_stops_after_the_last_router(data):
    # The head (and the loss) of the pre-pass forward are not run: only the routers' counts are
    # needed.
    model = tiny_moe(seed=6)
    heads = []
    model.head.register_forward_hook(lambda *a: heads.append(torch.is_grad_enabled()))
    got = train(model, data, steps=3, mode="global", routers="own", top_k=2, coef=0.5)
    assert got["acc"].optimizer_steps == WINDOWS
    assert heads == [True] * (3 * WINDOWS)  # the training forwards only


class _CachedScale(torch.nn.Module):
    """A cache a module builds in its forward (as rotary embeddings do): a buffer per sequence
    length, rebuilt when the length changes, and saved by the training forward's backward."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cache = getattr(self, "scale", None)
        if cache is None or cache.shape[0] != h.shape[1]:
            self.register_buffer("scale", 1.0 + 0.1 * torch.arange(h.shape[1], dtype=h.dtype)[:, None],
                                 persistent=False)
        return h * self.scale


def test_a_buffer_a_pre_pass_builds_is_an_ordinary_tensor(data):
    # From its second window the pre-pass runs under inference_mode (cheaper than no_grad); a
    # buffer the forward builds there would be an inference tensor, which the training forward
    # cannot save for its backward: the pre-pass copies it out. The windows' lengths differ, so
    # each window's pre-pass rebuilds the cache.
    model = tiny_moe(seed=7)
    model.embed = torch.nn.Sequential(model.embed, _CachedScale())
    windows = [[{k: v[:, :6 - w] for k, v in b.items()} for b in micro] for w, micro in enumerate(data)]
    got = train(model, windows, steps=3, mode="global", routers="own", top_k=2, coef=0.5)
    assert not got["model"].embed[1].scale.is_inference()
    ref = reference(model, windows, "global", top_k=2, whole=True)
    assert diff(got["params"], ref["params"]) < TOL
