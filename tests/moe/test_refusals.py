"""Bad input to LoadBalance raises a clear error before anything changes: no parameter, gradient,
window or config of the model is touched by the failed call."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradaccum
from tests.moe.models import batches, count, lm_loss, qwen3_moe, tiny_moe


def setup(seed: int = 0, **kw):
    model = tiny_moe(seed=seed)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    balance = gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef=0.5, **kw)
    return model, acc, balance


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_unchanged(model, acc, before):
    assert acc.micro_step == 0 and acc.optimizer_steps == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model), strict=True))


def feed(model, acc, batch, n=True):
    loss = lm_loss(model(**batch)["logits"], batch["labels"])
    return acc.backward(loss, n_items=count(batch) if n else None)


def test_a_model_without_routers_and_no_routers_argument_raises():
    with pytest.raises(ValueError, match="found no router in Sequential: give routers="):
        gradaccum.moe.LoadBalance(nn.Sequential(nn.Linear(4, 4)), top_k=1, coef=0.1)


def test_routers_whose_output_holds_no_logits_raise_before_the_window_trains():
    model = tiny_moe()
    # the router now returns the chosen experts only: no logits
    model.layers[0].router.register_forward_hook(lambda m, i, o: (o.argmax(-1),))
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    before = snapshot(model)
    balance = gradaccum.moe.LoadBalance(model, routers=[model.layers[0].router], top_k=1, coef=0.5)
    with pytest.raises(TypeError, match="output holds no logits"):
        for window in balance.windows(batches(0), acc, n_items=count):
            for batch in window:
                feed(model, acc, batch)
    assert_unchanged(model, acc, before)


@pytest.mark.parametrize("mode", ["global", "rolling", "micro_batch"])
def test_a_window_that_differs_from_the_one_prepared_raises_before_its_backward(mode):
    model, acc, balance = setup(mode=mode)
    before = snapshot(model)
    other = batches(7)
    with pytest.raises(ValueError, match=r"differs from the one prepared|otherwise than the window"):
        for window in balance.windows(batches(0), acc, n_items=count):
            for batch in window:
                feed(model, acc, batch)
            feed(model, acc, other[0])  # a fourth micro-batch in a window of three
    # the window stepped; the fourth micro-batch was refused before its backward
    assert acc.micro_step == 0 and acc.optimizer_steps == 1
    assert all(p.grad is None for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(model), strict=True))


def test_another_batch_in_a_global_window_raises_before_its_backward():
    model, acc, balance = setup()
    before = snapshot(model)
    other = batches(7)
    with pytest.raises(ValueError, match="routed otherwise than the window LoadBalance prepared"):
        for _ in balance.windows(batches(0), acc, n_items=count):
            feed(model, acc, other[0])
    assert_unchanged(model, acc, before)


def test_a_training_forward_before_windows_raises_and_evaluation_does_not():
    model, _, balance = setup()
    batch = batches(0)[0]
    with pytest.raises(RuntimeError, match=r"outside balance\.windows"):
        model(**batch)
    with torch.no_grad():
        model(**batch)
    model.eval()
    model(**batch)
    balance.remove()
    model.train()
    model(**batch)


def test_backward_outside_windows_raises():
    model, acc, balance = setup()
    data = batches(0)
    for window in balance.windows(data[:3], acc, n_items=count):
        for batch in window:
            feed(model, acc, batch)
    assert acc.optimizer_steps == 1
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"outside balance\.windows"):
        feed(model, acc, data[0])
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model), strict=True))


@pytest.mark.parametrize("mode", ["globl", "Global", "", None, 1])
def test_a_misspelled_mode_raises(mode):
    model = tiny_moe()
    with pytest.raises(ValueError, match="mode must be one of 'global', 'rolling', 'micro_batch'"):
        gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef=0.1, mode=mode)


@pytest.mark.parametrize("coef", [-0.1, math.nan, math.inf, -math.inf])
def test_a_negative_or_non_finite_coef_raises(coef):
    model = tiny_moe()
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef=coef)


def test_a_coef_that_is_not_a_number_raises():
    model = tiny_moe()
    with pytest.raises(TypeError, match="coef must be a finite number"):
        gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef="0.1")


def test_the_models_own_aux_loss_is_switched_off_and_turning_it_on_is_refused():
    model = qwen3_moe()
    model.config.output_router_logits = True
    balance = gradaccum.moe.LoadBalance(model)
    assert model.config.output_router_logits is False
    assert balance.coef == 0.5 and balance.top_k == 2 and len(balance.routers) == 2
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    before = snapshot(model)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="counted twice"):
        next(iter(balance.windows(batches(0), acc, n_items=count)))
    model.config.output_router_logits = False
    data = batches(0)
    data[1] = {**data[1], "output_router_logits": True}
    with pytest.raises(ValueError, match="counted twice"):
        next(iter(balance.windows(data, acc, n_items=count)))
    assert_unchanged(model, acc, before)


def test_an_item_weighted_backward_needs_the_count_function():
    model, acc, balance = setup()
    before = snapshot(model)
    with pytest.raises(ValueError, match="given no n_items="):
        for window in balance.windows(batches(0), acc):
            for batch in window:
                feed(model, acc, batch)
    assert_unchanged(model, acc, before)


def test_the_one_pass_modes_need_a_mask():
    model, acc, balance = setup(mode="rolling")
    loader = [b["input_ids"] for b in batches(0)]
    with pytest.raises(ValueError, match="needs each batch's token mask"):
        next(iter(balance.windows(loader, acc, forward=lambda ids: model(ids))))


def test_counts_given_to_backward_that_differ_from_the_count_function_raise_at_the_window_end():
    model, acc, balance = setup()
    with pytest.raises(ValueError, match=r"n_items given to acc\.backward sum to"):
        for window in balance.windows(batches(0), acc, n_items=count):
            for batch in window:
                loss = lm_loss(model(**batch)["logits"], batch["labels"])
                acc.backward(loss, n_items=count(batch) + 1)


class _Stage:  # a pipeline stage, as far as the refusals read it
    submod, group = None, None


class _Schedule:
    _stage = _Stage()

    def step(self, *args, **kwargs):
        raise AssertionError("never run: the refusal comes first")


@pytest.mark.parametrize("mode, per_layer, match", [
    ("global", True, r"mode='global'\) under backward_pipeline.*use mode='rolling'"),
    ("rolling", False, r"per_layer=False\) under backward_pipeline.*use per_layer=True"),
    ("micro_batch", False, r"per_layer=False\) under backward_pipeline.*use per_layer=True"),
])
def test_backward_pipeline_refuses_what_a_balance_cannot_do_there_before_anything_changes(
        mode, per_layer, match):
    # "global" needs a pre-pass of the whole window through the schedule, the pooled loss every
    # stage's counts in each stage's backward: refused on every rank alike (the rolling and
    # micro_batch modes with per_layer=True run: tests/distributed/test_moe_pipeline.py)
    model, acc, balance = setup(mode=mode, per_layer=per_layer)
    before = snapshot(model)
    for window in balance.windows(batches(0)[:3], acc, n_items=count):
        with pytest.raises(ValueError, match=match):
            acc.backward_pipeline(_Schedule(), window[0]["input_ids"], target=window[0]["labels"])
        break
    assert_unchanged(model, acc, before)
    balance.remove()
    with pytest.raises(RuntimeError, match="schedule internals"):
        acc.backward_pipeline(_Schedule(), batches(0)[0]["input_ids"])  # the twin: on to its checks


def test_backward_pipeline_refuses_a_balance_over_data_parallel_stages_before_anything_changes():
    # a stage's counts would need an all-reduce over its replicas inside the schedule's backward
    from torch.nn.parallel import DistributedDataParallel

    class Replicated(DistributedDataParallel):  # a DDP stage module, as far as the refusal reads it
        def __init__(self):
            torch.nn.Module.__init__(self)

    class Stage:
        submod, group = Replicated(), None

    class Schedule(_Schedule):
        _stage = Stage()

    model, acc, balance = setup(mode="rolling", per_layer=True)
    before = snapshot(model)
    for window in balance.windows(batches(0)[:3], acc, n_items=count):
        with pytest.raises(NotImplementedError, match="data-parallel replicas of a stage"):
            acc.backward_pipeline(Schedule(), window[0]["input_ids"], target=window[0]["labels"])
        with pytest.raises(AttributeError):  # the twin: a plain stage passes the refusals
            acc.backward_pipeline(_Schedule(), window[0]["input_ids"], target=window[0]["labels"])
        break
    assert_unchanged(model, acc, before)
