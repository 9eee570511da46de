"""A torch.compile'd model trains through the Accumulator without recompiling.

The counting backends (``CompileCounter``: no compiler at all; ``aot_eager``: traces the backward
too) keep these tests fast; inductor behaves the same but compiles for tens of seconds on a CPU.
"""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import gradaccum
from tests.reference import assert_params_close, clone_model

SEQ, D_IN, CLASSES = 5, 6, 3


def token_model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, CLASSES)).to(dtype)


def batches(n, dtype=torch.float32):
    """Padded "sequences" of SEQ tokens whose real length varies: n_items changes every micro-step."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, SEQ, D_IN, generator=g, dtype=dtype)
    y = torch.randint(0, CLASSES, (n, SEQ), generator=g)
    lengths = [1 + (3 * i) % SEQ for i in range(n)]
    return [(x[i], y[i], torch.arange(SEQ) < lengths[i]) for i in range(n)]


def train(model, data, steps, **options):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(opt, steps, scheduler=sched, **options)
    for x, y, mask in data:
        loss = nn.functional.cross_entropy(model(x)[mask].float(), y[mask])
        acc.backward(loss, n_items=int(mask.sum()))
    acc.flush()
    return acc


def fresh(backend):
    torch._dynamo.reset()
    return CompileCounter() if backend == "counter" else CompileCounterWithBackend(backend)


@pytest.mark.parametrize("backend", ["counter", "aot_eager"])
@pytest.mark.parametrize("options", [
    {"clip_norm": 1.0},
    {"scaler": "cpu", "skip_nonfinite": True},
    {"accum_dtype": torch.float64},
], ids=["clip", "scaler", "accum_dtype"])
def test_compiled_model_compiles_once_across_micro_steps_boundaries_and_flush(backend, options):
    options = dict(options)
    if options.get("scaler") == "cpu":
        options["scaler"] = torch.amp.GradScaler("cpu")
    eager = token_model()
    model = clone_model(eager)
    counter = fresh(backend)
    compiled = torch.compile(model, backend=counter)
    data = batches(11)  # 3 windows of 3, then a flushed window of 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        acc = train(compiled, data, 3, **options)
    assert (acc.optimizer_steps, acc.micro_step) == (4, 0)
    assert counter.frame_count == 1
    options.pop("scaler", None)
    train(eager, data, 3, **options)
    assert_params_close(model, eager, torch.float32)


def test_compiled_bf16_model_with_float32_accumulation_compiles_once():
    model = token_model(torch.bfloat16)
    counter = fresh("aot_eager")
    compiled = torch.compile(model, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        acc = train(compiled, batches(8, torch.bfloat16), 4, accum_dtype=torch.float32)
    assert acc.optimizer_steps == 2 and counter.frame_count == 1


def test_compiled_model_under_bf16_autocast_compiles_once():
    model = token_model()
    counter = fresh("aot_eager")
    compiled = torch.compile(model, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        acc = train(compiled, batches(6), 3)
    assert acc.optimizer_steps == 2 and counter.frame_count == 1


def test_recompile_counter_sees_a_shape_change():
    # The negative twin: a change the guards do see (another micro-batch shape) is counted, so a
    # recompile caused by the accumulator could not go unnoticed.
    counter = fresh("counter")
    compiled = torch.compile(token_model(), backend=counter, dynamic=False)
    acc = gradaccum.Accumulator(torch.optim.SGD(compiled.parameters(), lr=0.1), 2)
    for n in (4, 3):
        acc.backward(compiled(torch.randn(n, D_IN)).pow(2).mean())
    assert counter.frame_count == 2
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(Exception, match="ecompil"):
        compiled(torch.randn(2, D_IN))
