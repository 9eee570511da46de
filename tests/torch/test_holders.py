"""Accumulators sharing parameters: no window is fed on top of another's, and none is left behind.

* two live accumulators: the second one's first micro-batch is refused before its backward,
  and flush() or discard() of either one recovers;
* a dropped accumulator (garbage-collected, or built per epoch and never flushed) leaves its
  partial window in .grad: the next accumulator warns once and discards it, so its own window is
  exactly the full-batch update of its own data.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import assert_params_close, clone_model, data, mlp, reference_steps, snapshot

LR = 0.1


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def feed(acc: gradaccum.Accumulator, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> bool:
    return acc.backward(nn.functional.cross_entropy(model(x), y))


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
               for u, v in zip(a, b, strict=True))


def test_a_second_accumulator_is_refused_before_its_backward_and_nothing_changes():
    model = mlp()
    x, y = data(8)
    first, second = gradaccum.Accumulator(sgd(model), 2), gradaccum.Accumulator(sgd(model), 2)
    feed(first, model, x[:4], y[:4])
    before, held = snapshot(model), grads(model)
    with pytest.raises(RuntimeError, match="holds a partial window of 1 micro-batch") as err:
        feed(second, model, x[4:], y[4:])
    assert f"id {id(first):#x}" in str(err.value) and "Nothing has changed" in str(err.value)
    assert (first.micro_step, second.micro_step) == (1, 0)
    assert same(grads(model), held)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(RuntimeError, match="holds a partial window"), second.micro_batch() as mb:
        mb.backward(nn.functional.cross_entropy(model(x), y))
    assert same(grads(model), held)


@pytest.mark.parametrize("recover", ["flush the holder", "discard the holder", "discard the refused"])
def test_after_the_refusal_flush_or_discard_on_either_one_recovers(recover):
    model = mlp()
    ref = clone_model(model)
    x, y = data(8)
    first, second = gradaccum.Accumulator(sgd(model), 2), gradaccum.Accumulator(sgd(model), 2)
    feed(first, model, x[:4], y[:4])
    with pytest.raises(RuntimeError):
        feed(second, model, x[4:], y[4:])
    ropt = sgd(ref)
    if recover == "flush the holder":
        assert first.flush()  # its own window, as its own mean: one step on x[:4]
        reference_steps(ref, ropt, [(x[:4], y[:4])])
    elif recover == "discard the holder":
        first.discard()
    else:
        with pytest.warns(UserWarning, match="also discards"):
            second.discard()  # the shared .grad goes: so does the window that lived in it
    assert first.micro_step == 0 and all(p.grad is None for p in model.parameters())
    # The refused accumulator now runs a whole window of its own, exactly.
    assert not feed(second, model, x[4:6], y[4:6])
    assert feed(second, model, x[6:], y[6:])
    reference_steps(ref, ropt, [(x[4:], y[4:])])
    assert_params_close(model, ref, torch.float64)


def test_a_garbage_collected_partial_window_is_discarded_with_a_warning():
    model = mlp()
    ref = clone_model(model)
    x, y = data(12)
    dropped = gradaccum.Accumulator(sgd(model), 4)
    feed(dropped, model, x[:4], y[:4])
    del dropped
    gc.collect()
    acc = gradaccum.Accumulator(sgd(model), 2)
    dropped_msg = r"dropped with a partial window \(1 of 4 micro-batches\).*flush\(\)"
    with pytest.warns(UserWarning, match=dropped_msg):
        feed(acc, model, x[4:8], y[4:8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next window does not warn again
        assert feed(acc, model, x[8:], y[8:])
    reference_steps(ref, sgd(ref), [(x[4:], y[4:])])
    assert_params_close(model, ref, torch.float64)


def test_an_accumulator_built_per_epoch_and_never_flushed_leaves_nothing_behind():
    # The loop that applied the last epoch's partial window silently (5e-2 off before).
    model = mlp()
    ref = clone_model(model)
    x, y = data(20)
    epochs = [(x[:10], y[:10]), (x[10:], y[10:])]
    with pytest.warns(UserWarning, match="dropped with a partial window") as seen:
        for ex, ey in epochs:
            acc = gradaccum.Accumulator(sgd(model), 4)  # 5 micro-batches of 2: one left over
            for xb, yb in zip(ex.split(2), ey.split(2), strict=True):
                feed(acc, model, xb, yb)
    assert len(seen) == 1
    ropt = sgd(ref)
    reference_steps(ref, ropt, [(x[:8], y[:8]), (x[10:18], y[10:18])])
    assert_params_close(model, ref, torch.float64)


def test_a_reference_cycle_does_not_hide_the_dropped_window():
    model = mlp()
    x, y = data(8)
    dropped = gradaccum.Accumulator(sgd(model), 4)
    dropped.cycle = dropped  # lives until the collector runs
    feed(dropped, model, x[:4], y[:4])
    del dropped
    acc = gradaccum.Accumulator(sgd(model), 1)
    with pytest.warns(UserWarning, match="dropped with a partial window"):
        feed(acc, model, x[4:], y[4:])


def test_a_checkpoint_loaded_into_a_fresh_accumulator_is_not_taken_for_a_dropped_one():
    model = mlp()
    ref = clone_model(model)
    x, y = data(8)
    acc = gradaccum.Accumulator(sgd(model), 2)
    feed(acc, model, x[:4], y[:4])
    state = acc.state_dict()
    del acc
    acc = gradaccum.Accumulator(sgd(model), 2)
    acc.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert feed(acc, model, x[4:], y[4:])
    reference_steps(ref, sgd(ref), [(x, y)])
    assert_params_close(model, ref, torch.float64)


def test_loading_a_partial_window_beside_a_live_holder_is_refused_before_any_change():
    model = mlp()
    x, y = data(8)
    first = gradaccum.Accumulator(sgd(model), 2)
    feed(first, model, x[:4], y[:4])
    state = first.state_dict()
    second = gradaccum.Accumulator(sgd(model), 2)
    held = grads(model)
    with pytest.raises(RuntimeError, match="cannot load a partial window"):
        second.load_state_dict(state)
    assert second.micro_step == 0 and same(grads(model), held)


def test_accumulators_over_different_parameters_do_not_interfere():
    # The negative twin: a GAN's two accumulators, each mid-window, each exact.
    g, d = mlp(seed=1), mlp(seed=2)
    g_ref, d_ref = clone_model(g), clone_model(d)
    x, y = data(8)
    acc_g, acc_d = gradaccum.Accumulator(sgd(g), 2), gradaccum.Accumulator(sgd(d), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xb, yb in zip(x.split(4), y.split(4), strict=True):
            feed(acc_g, g, xb, yb)
            feed(acc_d, d, xb, yb)
    reference_steps(g_ref, sgd(g_ref), [(x, y)])
    reference_steps(d_ref, sgd(d_ref), [(x, y)])
    assert_params_close(g, g_ref, torch.float64)
    assert_params_close(d, d_ref, torch.float64)


def test_loading_an_empty_window_beside_a_live_holder_is_refused_before_any_change():
    # Accepted before: the load set the shared .grad to None, and the holder then "stepped" with
    # nothing (its window's first micro-batch lost, silently).
    model = mlp()
    ref = clone_model(model)
    x, y = data(8)
    empty = gradaccum.Accumulator(sgd(model), 2).state_dict()
    first = gradaccum.Accumulator(sgd(model), 2)
    feed(first, model, x[:4], y[:4])
    second = gradaccum.Accumulator(sgd(model), 2)
    held = grads(model)
    with pytest.raises(RuntimeError, match=r"cannot load a state with an empty window: .* holds a partial "
                                           r"window of 1 micro-batch.*would overwrite"):
        second.load_state_dict(empty)
    assert second.micro_step == 0 and same(grads(model), held)
    assert feed(first, model, x[4:], y[4:])  # the holder's window is whole
    reference_steps(ref, sgd(ref), [(x, y)])
    assert_params_close(model, ref, torch.float64)
