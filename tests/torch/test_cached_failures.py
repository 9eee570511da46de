"""backward_cached's bad input and failures, at each point of the call.

Up to the second pass's first backward (the first pass, the checks, ``loss_fn`` and its backward,
the first chunk's second forward) an exception leaves the gradients, the window, the BatchNorm
statistics and the RNG as they were, mid-window too: the gradient of ``loss_fn``'s own parameters
is held out of ``.grad`` until the last chunk. After it, the call has added into the window's
gradients in place (no second gradient set is held): on a window's first micro-batch the new
gradients are set back to None (nothing is left), later the window is partly accumulated and the
accumulator refuses to feed, flush or save it until ``discard()``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradaccum
from tests.contrastive import (
    Towers,
    clip_loss,
    full_batch_grads,
    grads,
    largest_difference,
    pairs,
    step_pre_grads,
)

N = 24
BATCH = 8  # chunks of 8: three chunks; encode's calls 0-2 are the first pass, 3-5 the second


def loss_of(model):
    return lambda i, t: clip_loss(i, t, model.logit_scale)


def mid_window(model, **options):
    """An accumulator one cached batch into a window of 2."""
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model, **options)
    acc.backward_cached(lambda c: model(*c), loss_of(model), gradaccum.chunks(pairs(N, seed=5), 10))
    return acc


def snapshot(model, acc):
    return {"grads": grads(model), "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "rng": torch.get_rng_state(), "micro_step": acc.micro_step, "window": acc._window}


def assert_unchanged(model, acc, before, *, grads_too=True):
    after = snapshot(model, acc)
    if grads_too:
        assert largest_difference(after["grads"], before["grads"]) == 0
    assert all(torch.equal(after["buffers"][k], v) for k, v in before["buffers"].items())
    assert torch.equal(after["rng"], before["rng"])
    assert after["micro_step"] == before["micro_step"] and after["window"] is before["window"]


class Counting:
    """``encode`` wrapped: call ``k`` (from 0) does ``bad(model, chunk)`` instead."""

    def __init__(self, model, bad_at, bad):
        self.model, self.bad_at, self.bad, self.calls = model, bad_at, bad, 0

    def __call__(self, chunk):
        k, self.calls = self.calls, self.calls + 1
        return self.bad(self.model, chunk) if k in self.bad_at else self.model(*chunk)


def _raise(model, chunk):
    raise RuntimeError("encode failed")


def _other_shape(model, chunk):
    i, t = model(*chunk)
    return i[:2], t


def _detached(model, chunk):
    return tuple(z.detach() for z in model(*chunk))


def raising_backward(x):
    """``x`` in the forward; its backward raises (a custom function's bug)."""

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("backward failed")

    return Fails.apply(x)


def _backward_fails(model, chunk):
    i, t = model(*chunk)
    return raising_backward(i), t


BEFORE = {  # name: (encode's misbehaviour, the calls it happens at, error, message)
    "not-a-tensor": (lambda m, c: {"z": m(*c)[0]}, {0}, TypeError, "returned a dict"),
    "list-of-strings": (lambda m, c: ["a", "b"], {1}, TypeError, "returned a str as output 0"),
    "varying-outputs": (lambda m, c: m(*c)[:1], {2}, ValueError, "2 output\\(s\\) for chunk 0 and 1"),
    "no-batch-dim": (lambda m, c: (m(*c)[0], m.logit_scale * 1), {0, 1, 2}, ValueError, "no batch dimension"),
    "wrong-rows": (lambda m, c: (m(*c)[0][:1], m(*c)[1]), {1}, ValueError,
                   "output 0 of encode for chunk 1 has 1 row\\(s\\), its chunk 8 example\\(s\\)"),
    "raises-first-pass": (_raise, {1}, RuntimeError, "encode failed"),
    "other-shape-second-pass": (_other_shape, {3}, ValueError, "chunk 0 is .* in the second pass"),
    "detached-second-pass": (_detached, {3}, ValueError,
                             "requires grad in the second pass for chunk 0 \\(outputs \\[0, 1\\]\\)"),
    "raises-second-pass": (_raise, {3}, RuntimeError, "encode failed"),
}
AFTER = {  # the same misbehaviours after the first chunk's backward, and a chunk's backward that raises
    "other-shape-second-pass": (_other_shape, {4}, ValueError, "chunk 1 is .* in the second pass"),
    "detached-second-pass": (_detached, {4}, ValueError, "requires grad in the second pass for chunk 1"),
    "raises-second-pass": (_raise, {4}, RuntimeError, "encode failed"),
    "raises-last-chunk": (_raise, {5}, RuntimeError, "encode failed"),
    "raises-in-a-chunks-backward": (_backward_fails, {4}, RuntimeError, "backward failed"),
}


@pytest.mark.parametrize("case", list(BEFORE))
def test_bad_encode_before_the_first_backward_raises_with_everything_as_it_was(case):
    bad, at, error, match = BEFORE[case]
    model = Towers(dropout=0.3, batchnorm=True)
    acc = mid_window(model)
    before = snapshot(model, acc)
    with pytest.raises(error, match=match):
        acc.backward_cached(Counting(model, at, bad), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    assert_unchanged(model, acc, before)
    acc.backward_cached(lambda c: model(*c), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    assert acc.optimizer_steps == 1  # nothing was left behind: the window goes on


LOSSES = {
    "not-scalar": (lambda m: (lambda i, t: (i * t).sum(1)), ValueError, "floating scalar"),
    "not-a-tensor": (lambda m: (lambda i, t: 3.0), TypeError, "got a float"),
    "no-grad": (lambda m: (lambda i, t: clip_loss(i, t, m.logit_scale).detach()), ValueError, "require grad"),
    "ignores-reps": (lambda m: (lambda i, t: m.logit_scale * 2), ValueError, "does not depend"),
    "raises": (lambda m: (lambda i, t: 1 / 0), ZeroDivisionError, "division"),
    "raises-in-its-backward": (lambda m: (lambda i, t: clip_loss(raising_backward(i), t, m.logit_scale)),
                               RuntimeError, "backward failed"),
}


@pytest.mark.parametrize("case", list(LOSSES))
def test_bad_loss_fn_raises_with_everything_as_it_was(case):
    make, error, match = LOSSES[case]
    model = Towers(dropout=0.3, batchnorm=True)
    acc = mid_window(model)
    before = snapshot(model, acc)
    with pytest.raises(error, match=match):
        acc.backward_cached(lambda c: model(*c), make(model), gradaccum.chunks(pairs(N), BATCH))
    assert_unchanged(model, acc, before)


def test_a_failure_in_the_first_chunks_second_forward_keeps_the_temperatures_gradient_out():
    # loss_fn's backward has given logit_scale its gradient; the window's own stays as it was.
    model = Towers()
    acc = mid_window(model)
    held = model.logit_scale.grad.clone()
    with pytest.raises(RuntimeError, match="encode failed"):
        acc.backward_cached(Counting(model, {3}, _raise), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    assert torch.equal(model.logit_scale.grad, held)


@pytest.mark.parametrize("case", list(AFTER))
def test_on_a_windows_first_micro_batch_a_later_failure_leaves_nothing(case):
    bad, at, error, match = AFTER[case]
    model = Towers(dropout=0.3, batchnorm=True)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    before = snapshot(model, acc)
    with pytest.raises(error, match=match):
        acc.backward_cached(Counting(model, at, bad), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    assert all(p.grad is None for p in model.parameters())  # set back to None: nothing costs a copy
    assert_unchanged(model, acc, before)
    acc.backward_cached(lambda c: model(*c), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    assert acc.micro_step == 1  # not refused


def feed(acc, model, chunks):
    return acc.backward_cached(lambda c: model(*c), loss_of(model), chunks)


@pytest.mark.parametrize("case", list(AFTER))
def test_later_in_a_window_a_failure_leaves_it_partly_accumulated_and_refused_until_discard(case):
    bad, at, error, match = AFTER[case]
    model = Towers(dropout=0.3, batchnorm=True)
    acc = mid_window(model)
    before = snapshot(model, acc)
    with pytest.raises(error, match=match):
        acc.backward_cached(Counting(model, at, bad), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    # What it leaves: the window record, the statistics and the RNG as they were; the gradients
    # added into (the chunks' before it; at the last chunk, the temperature's too).
    assert_unchanged(model, acc, before, grads_too=False)
    assert largest_difference(grads(model), before["grads"]) > 1e-3
    refusal = "partly accumulated: a backward_cached call raised .*acc.discard\\(\\)"
    x, t = pairs(4, seed=9)
    with pytest.raises(RuntimeError, match=refusal):
        feed(acc, model, gradaccum.chunks(pairs(N), BATCH))
    with pytest.raises(RuntimeError, match=refusal):
        acc.backward(clip_loss(*model(x, t), model.logit_scale))
    with pytest.raises(RuntimeError, match=refusal), acc.micro_batch() as mb:
        mb.backward(clip_loss(*model(x, t), model.logit_scale))
    with pytest.raises(RuntimeError, match=refusal):
        acc.flush()
    with pytest.raises(RuntimeError, match=refusal):
        acc.state_dict()
    assert acc.optimizer_steps == 0 and acc.micro_step == 1  # nothing stepped the half window
    acc.discard()
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    assert not feed(acc, model, gradaccum.chunks(pairs(N), BATCH))  # the next window runs


def test_after_discard_a_call_refused_by_its_input_checks_leaves_the_window_whole():
    # A call that fails before anything runs (encode not callable, empty chunks) must not carry
    # over the "partly accumulated" mark of an earlier, discarded window.
    model = Towers(dropout=0.3, batchnorm=True)
    acc = mid_window(model)
    with pytest.raises(RuntimeError):
        acc.backward_cached(Counting(model, {4}, _raise), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    acc.discard()
    for bad in ((None, loss_of(model), gradaccum.chunks(pairs(N), BATCH)),
                (lambda c: model(*c), loss_of(model), [])):
        with pytest.raises((TypeError, ValueError)):
            acc.backward_cached(*bad)
        assert acc.micro_step == 0
    assert not feed(acc, model, gradaccum.chunks(pairs(N), BATCH))  # not refused as partial


def test_after_a_discarded_window_the_next_one_is_exact():
    base = Towers(dropout=0.3)
    model = copy.deepcopy(base)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    seen = step_pre_grads(acc, model)
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2)]
    feed(acc, model, batches[0])
    with pytest.raises(RuntimeError):
        acc.backward_cached(Counting(model, {4}, _raise), loss_of(model), batches[1])
    acc.discard()
    torch.manual_seed(3)
    for chunks in batches:
        feed(acc, model, chunks)
    torch.manual_seed(3)
    ref = copy.deepcopy(base)
    assert largest_difference(seen[0], full_batch_grads(ref, batches, loss_of(ref))) < 1e-12


def test_a_failure_before_the_first_backward_lets_the_window_continue_exactly():
    base = Towers(dropout=0.3)
    model = copy.deepcopy(base)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)
    seen = step_pre_grads(acc, model)
    batches = [gradaccum.chunks(pairs(N, seed=s), 10) for s in (1, 2)]
    torch.manual_seed(3)
    feed(acc, model, batches[0])
    with pytest.raises(RuntimeError):
        acc.backward_cached(Counting(model, {3}, _raise), loss_of(model), batches[1])
    feed(acc, model, batches[1])
    torch.manual_seed(3)
    ref = copy.deepcopy(base)
    assert largest_difference(seen[0], full_batch_grads(ref, batches, loss_of(ref))) < 1e-12


def test_loading_a_checkpoint_replaces_a_partly_accumulated_window():
    model = Towers()
    acc = mid_window(model)
    state = acc.state_dict()
    with pytest.raises(RuntimeError):
        acc.backward_cached(Counting(model, {4}, _raise), loss_of(model), gradaccum.chunks(pairs(N), BATCH))
    acc.load_state_dict(state)
    assert largest_difference(grads(model), dict(zip(grads(model), state["grads"], strict=True))) == 0
    feed(acc, model, gradaccum.chunks(pairs(N), BATCH))
    assert acc.optimizer_steps == 1


def test_with_accum_dtype_a_later_failure_changes_nothing():
    # The window's gradients live in the float32 buffers; the call's .grad did not exist before
    # it, so setting it back to None restores everything.
    model = Towers(dtype=torch.bfloat16)
    batch = gradaccum.chunks(pairs(N, dtype=torch.bfloat16), 8)
    loss = lambda i, t: clip_loss(i.float(), t.float(), model.logit_scale.float())  # noqa: E731
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model,
                                accum_dtype=torch.float32)
    acc.backward_cached(lambda c: model(*c), loss, gradaccum.chunks(pairs(N, dtype=torch.bfloat16), 10))
    buffers = [b.clone() for b in acc._precision.buffers.grads()]
    with pytest.raises(RuntimeError, match="encode failed"):
        acc.backward_cached(Counting(model, {5}, _raise), loss, batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(acc._precision.buffers.grads(), buffers, strict=True))
    assert acc.backward_cached(lambda c: model(*c), loss, batch)


@pytest.mark.parametrize("chunks, error, match", [
    ([], ValueError, "chunks is empty"),
    (iter(()), ValueError, "chunks is empty"),
    (torch.zeros(3, 2), TypeError, "iterable of micro-batches"),
    ({"x": 1}, TypeError, "iterable of micro-batches"),
    (5, TypeError, "got a int"),
])
def test_bad_chunks_raise_before_anything_changes(chunks, error, match):
    model = Towers(batchnorm=True)
    acc = mid_window(model)
    before = snapshot(model, acc)
    with pytest.raises(error, match=match):
        acc.backward_cached(lambda c: model(*c), loss_of(model), chunks)
    assert_unchanged(model, acc, before)


def test_bad_arguments_raise_before_anything_changes():
    model = Towers()
    acc = mid_window(model)
    before = snapshot(model, acc)
    batch = gradaccum.chunks(pairs(N), 8)
    loss = loss_of(model)
    with pytest.raises(TypeError, match="encode must be callable"):
        acc.backward_cached("model", loss, batch)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        acc.backward_cached(lambda c: model(*c), None, batch)
    with pytest.raises(ValueError, match="n_items=0 with reduction='mean'"):
        acc.backward_cached(lambda c: model(*c), loss, batch, 0)
    with pytest.raises(ValueError, match="mixes weightings"):
        acc.backward_cached(lambda c: model(*c), loss, batch, 24)
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs grad mode"):
        acc.backward_cached(lambda c: model(*c), loss, batch)
    assert_unchanged(model, acc, before)
