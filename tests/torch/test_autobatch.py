"""AutoBatch: a global batch per window, split exactly, and OOM recovery that keeps the batch.

Out-of-memory errors are injected: a module raises one when its input exceeds a size, or at
chosen forward calls (a chosen micro-step of the window), in its forward or its backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import assert_params_close, bitwise_equal, data, mlp, reference_steps, snapshot

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000 bytes."


class FailingLayer(nn.Module):
    """Identity that raises an out-of-memory error when its input has more than ``limit`` rows,
    or on chosen forward calls (1-based), in its forward or (``in_backward``) in its backward."""

    def __init__(self, limit: int = 10**9, calls: tuple[int, ...] = (), in_backward: bool = False,
                 error: type[Exception] = torch.OutOfMemoryError, message: str = OOM) -> None:
        super().__init__()
        self.limit, self.fail_calls, self.in_backward = limit, set(calls), in_backward
        self.error, self.message = error, message
        self.calls = 0
        self.failures = 0

    def should_fail(self, x: torch.Tensor) -> bool:
        self.calls += 1
        return x.shape[0] > self.limit or self.calls in self.fail_calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.should_fail(x):
            return x
        if not self.in_backward:
            self.failures += 1
            raise self.error(self.message)
        return _RaiseInBackward.apply(x, self)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):  # type: ignore[override]
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.layer.failures += 1
        raise ctx.layer.error(ctx.layer.message)


def build(layer: nn.Module | None = None, seed: int = 0, **acc_kw):
    net = mlp(torch.float32, seed=seed)
    # The layer sits after the first linear, so a backward reaches it.
    model = nn.Sequential(net[0], layer if layer is not None else nn.Identity(), *net[1:])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, gradaccum.Accumulator(opt, steps=1, model=model, **acc_kw)


def loss_of(model):
    return lambda mb: nn.functional.cross_entropy(model(mb[0]), mb[1])


def global_batches(n_batches: int, size: int):
    x, y = data(n_batches * size, torch.float32)
    return list(zip(x.split(size), y.split(size), strict=True))


def train(micro_batch, batches, layer=None, **kw):
    model, acc = build(layer)
    auto = gradaccum.AutoBatch(acc, micro_batch, **kw)
    steps = auto.run(batches, loss_of(model))
    return model, acc, auto, steps


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


# ---------------------------------------------------------------------- splitting
def test_global_batch_is_one_window_with_uneven_last_part_weighted_exactly():
    batches = global_batches(3, 10)
    model, acc, auto, steps = train(4, batches)
    assert steps == 3 and acc.optimizer_steps == 3 and acc.micro_step == 0
    assert auto.last_sizes == [4, 4, 2]
    ref, _ = build()
    reference_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), batches)
    assert_params_close(model, ref, torch.float32)


def test_uneven_parts_without_items_are_not_the_global_batch():
    # The negative twin: a plain mean of the 4, 4, 2 micro-batch means is another update.
    batches = global_batches(1, 10)
    model, acc = build()
    acc.resize_window(3)
    for xb, yb in zip(batches[0][0].split(4), batches[0][1].split(4), strict=True):
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
    ref, _ = build()
    reference_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), batches)
    with pytest.raises(AssertionError):
        assert_params_close(model, ref, torch.float32)


def test_dict_batch_and_loss_fn_item_counts():
    x, y = data(12, torch.float32)
    model, acc = build()
    auto = gradaccum.AutoBatch(acc, 5)
    seen = []

    def loss_fn(mb):
        seen.append(sorted(mb))
        return nn.functional.cross_entropy(model(mb["x"]), mb["y"]), mb["y"].numel()

    assert auto.step({"x": x, "y": y, "split": "train"}, loss_fn)
    ref, _ = build()
    reference_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), [(x, y)])
    assert_params_close(model, ref, torch.float32)
    assert seen == [["split", "x", "y"]] * 3


def test_split_batch_keeps_structure_and_rejects_ragged_batches():
    x = torch.arange(6)
    parts = gradaccum.split_batch({"a": (x, [x * 2]), "tag": None}, [4, 2])
    assert parts[1]["a"][0].tolist() == [4, 5] and parts[1]["a"][1][0].tolist() == [8, 10]
    assert parts[0]["tag"] is None
    with pytest.raises(ValueError, match="disagree"):
        gradaccum.batch_size((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(TypeError, match="batch"):
        gradaccum.batch_size(["no tensor"])
    with pytest.raises(ValueError, match="sum to the batch size 6"):
        gradaccum.split_batch(x, [4, 1])


# ---------------------------------------------------------------------- recovery
@pytest.mark.parametrize("in_backward", [False, True])
def test_oom_at_chosen_micro_step_drops_partial_window_and_equals_clean_run(in_backward):
    batches = global_batches(3, 12)
    # Third forward = micro-step 2 of the first window at micro-batch 4 (12 = 4 + 4 + 4).
    layer = FailingLayer(calls=(3,), in_backward=in_backward)
    model, acc = build(layer)
    auto = gradaccum.AutoBatch(acc, "auto", start=4)
    params = [p for p in model.parameters() if p.requires_grad]
    grads_none_at_call = []

    def loss_fn(mb):
        grads_none_at_call.append(all(p.grad is None for p in params))
        return nn.functional.cross_entropy(model(mb[0]), mb[1])

    assert auto.run(batches, loss_fn) == 3
    assert layer.failures == 1 and auto.ooms == 1 and auto.micro_batch == 2
    # Calls 1-3 were the failed attempt; call 4 reran the global batch from its start with the
    # partial gradients of micro-steps 0 and 1 dropped.
    assert grads_none_at_call[:4] == [True, False, False, True]
    clean, *_ = train(2, batches)
    assert_same(model, clean)


def test_oom_above_a_size_halves_until_it_fits_and_equals_clean_run():
    batches = global_batches(3, 10)
    layer = FailingLayer(limit=3)
    model, acc, auto, _ = train("auto", batches, layer)
    assert auto.micro_batch == 3 and auto.ooms == 2  # 10 -> 5 -> 3
    assert auto.last_sizes == [3, 3, 3, 1]
    clean, clean_acc, *_ = train(3, batches)
    assert_same(model, clean)
    assert acc.optimizer_steps == clean_acc.optimizer_steps == 3
    ref, _ = build()
    reference_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), batches)
    assert_params_close(model, ref, torch.float32)


def test_naive_retry_that_keeps_partial_gradients_is_not_the_clean_run():
    # The negative twin: halving and rerunning without dropping the partial window counts the
    # micro-batches before the OOM twice.
    batches = global_batches(1, 12)
    model, _ = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = batches[0]
    for i, (xb, yb) in enumerate(zip(x.split(4), y.split(4), strict=True)):
        if i == 2:
            break  # "out of memory" at micro-step 2
        (nn.functional.cross_entropy(model(xb), yb) / 3).backward()
    for xb, yb in zip(x.split(2), y.split(2), strict=True):
        (nn.functional.cross_entropy(model(xb), yb) / 6).backward()
    opt.step()
    clean, *_ = train(2, batches)
    assert not bitwise_equal(model, snapshot(clean))


def test_retry_restores_rng_and_batchnorm_statistics():
    def bn_model(layer):
        torch.manual_seed(0)
        return nn.Sequential(layer, nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3),
                             nn.Linear(8, 3))

    batches = global_batches(2, 12)

    def run(micro, layer, **kw):
        model = bn_model(layer)
        acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, model=model)
        torch.manual_seed(123)
        gradaccum.AutoBatch(acc, micro, **kw).run(batches, loss_of(model))
        return model

    recovered = run("auto", FailingLayer(calls=(2,)), start=6)
    clean = run(6 // 2, nn.Identity())
    assert_same(recovered, clean)
    for a, b in zip(recovered.buffers(), clean.buffers(), strict=True):
        assert torch.equal(a, b)


def test_recovery_under_a_grad_scaler_equals_clean_run():
    batches = global_batches(2, 8)

    def run(micro, layer, **kw):
        model, acc = build(layer, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        gradaccum.AutoBatch(acc, micro, **kw).run(batches, loss_of(model))
        return model, acc

    recovered, acc = run("auto", FailingLayer(calls=(2,)), start=4)
    clean, clean_acc = run(2, None)
    assert_same(recovered, clean)
    assert acc.scaler.get_scale() == clean_acc.scaler.get_scale()


def test_real_cpu_allocator_error_is_recovered():
    class Hungry(nn.Module):
        def forward(self, x):
            if x.shape[0] > 2:
                torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses at once
            return x

    batches = global_batches(2, 8)
    model, _, auto, _ = train("auto", batches, Hungry())
    assert auto.micro_batch == 2
    clean, *_ = train(2, batches)
    assert_same(model, clean)


def test_grow_every_tries_larger_again_and_falls_back_to_the_proven_size():
    batches = global_batches(6, 8)
    layer = FailingLayer(limit=3)
    _, _, auto, steps = train("auto", batches, layer, start=2, grow_every=2)
    # 2, 2 -> grow to 4 (below no ceiling yet): OOM -> back to 2 (proven), ceiling 4 -> grow to 3.
    assert steps == 6 and auto.ooms == 1 and auto.micro_batch == 3


# ---------------------------------------------------------------------- errors
def test_oom_at_micro_batch_one_is_a_clear_error_and_leaves_no_partial_window():
    model, acc = build(FailingLayer(limit=0))
    before = snapshot(model)
    auto = gradaccum.AutoBatch(acc, "auto", start=2)
    with pytest.raises(gradaccum.NoMicroBatchFitsError, match=r"micro-batch 1.*CUDA out of memory"):
        auto.step(global_batches(1, 4)[0], loss_of(model))
    assert acc.micro_step == 0 and acc.optimizer_steps == 0
    assert all(p.grad is None for p in model.parameters()) and bitwise_equal(model, before)


@pytest.mark.parametrize("error", [ValueError("bad label"), RuntimeError("shape mismatch")])
def test_other_errors_pass_through_unchanged(error):
    _, acc = build()
    auto = gradaccum.AutoBatch(acc, "auto")

    def loss_fn(mb):
        raise error

    with pytest.raises(type(error)) as caught:
        auto.step(global_batches(1, 4)[0], loss_fn)
    assert caught.value is error and auto.ooms == 0


def test_fixed_micro_batch_lets_an_oom_pass_through():
    model, acc = build(FailingLayer(limit=1))
    with pytest.raises(torch.OutOfMemoryError):
        gradaccum.AutoBatch(acc, 2).step(global_batches(1, 4)[0], loss_of(model))


def test_oom_errors_are_recognized():
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as real:
        assert gradaccum.is_oom_error(real)
    assert gradaccum.is_oom_error(torch.OutOfMemoryError(OOM))
    assert gradaccum.is_oom_error(RuntimeError(CPU_OOM))
    assert gradaccum.is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert gradaccum.is_oom_error(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not gradaccum.is_oom_error(RuntimeError("expected scalar type Float"))
    assert not gradaccum.is_oom_error(MemoryError())


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"micro_batch": 0}, ValueError, "micro_batch must be a positive integer.*0"),
    ({"micro_batch": "big"}, TypeError, "micro_batch.*'big'"),
    ({"micro_batch": 2.5}, TypeError, "micro_batch.*2.5"),
    ({"micro_batch": "auto", "start": 0}, ValueError, "start.*0"),
    ({"micro_batch": "auto", "grow_every": 0}, ValueError, "grow_every.*0"),
    ({"micro_batch": 4, "start": 2}, ValueError, "apply to micro_batch='auto'"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    _, acc = build()
    with pytest.raises(error, match=match):
        gradaccum.AutoBatch(acc, **kwargs)


def test_not_an_accumulator_is_rejected():
    with pytest.raises(TypeError, match="accumulator"):
        gradaccum.AutoBatch(object(), 2)  # type: ignore[arg-type]


def test_resize_window_only_on_an_empty_window():
    model, acc = build()
    acc.resize_window(3)
    assert acc.steps == 3
    x, y = data(2, torch.float32)
    acc.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(ValueError, match="needs an empty window; it holds 1 of 3"):
        acc.resize_window(3)
    with pytest.raises(ValueError, match=r"steps.*0"):
        acc.resize_window(0)
    assert acc.steps == 3 and acc.micro_step == 1


def test_a_partly_fed_window_is_not_taken_over():
    model, acc = build()
    x, y = data(2, torch.float32)
    acc.resize_window(2)
    acc.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(ValueError, match="empty window"):
        gradaccum.AutoBatch(acc, 2).step((x, y), loss_of(copy.deepcopy(model)))
