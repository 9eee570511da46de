"""Check 4, OOM: ``AutoBatch(acc, "auto")`` recovers from a real CUDA out-of-memory, exactly.

This process's CUDA memory is capped (``set_per_process_memory_fraction``, 1.5 GiB) so that the
benchmark CNN runs out at a known size even on a large GPU. Then:

1. one forward and backward far beyond the cap: the error must be a real CUDA OOM that
   ``gradaccum.is_oom_error`` recognizes;
2. ``AutoBatch(acc, "auto")`` trains 3 global batches of 1,024 images from the whole global batch:
   it runs out, halves and reruns the global batch, until a size fits;
3. a clean run at the sizes it trained each global batch at (a fixed ``micro_batch`` per global
   batch: the first may have fit at a larger size than a later one), from the same weights and
   data: the parameters must be ``torch.equal`` (deterministic cuDNN and cuBLAS). A reference at
   the last size alone would sum the first global batch in another order. The clean run is not
   capped: under the cap a size the recovery trained at can still run out there (on an H200 the
   first global batch fit at 256 inside the recovery and ran out at 256 in the clean run, the
   allocator's cache holding other blocks), and the reference must train, not recover.

The smoke has no CUDA memory to exhaust: a forward pre-hook raises ``torch.OutOfMemoryError``
above 4 images (the error a real OOM raises), on the MNIST CNN, global batches of 16.
"""

from __future__ import annotations

import gc

import torch

import gradaccum
from gradaccum.bench.gpu.check import Context, Outcome
from gradaccum.demos.models import MODELS, build_model

__all__ = ["run"]

CAP_GIB = 1.5
BATCHES = 3


def _model(ctx: Context, fail_above: int | None) -> torch.nn.Module:
    model = build_model("cnn" if ctx.smoke else "bench-cnn", seed=0).to(ctx.device)
    if fail_above is not None:
        def simulated_oom(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if args[0].shape[0] > fail_above:
                raise torch.OutOfMemoryError("simulated (smoke): CUDA out of memory")
        model.register_forward_pre_hook(simulated_oom)
    return model


def _release() -> None:
    gc.collect()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def _real_oom(ctx: Context, fail_above: int | None, shape: tuple[int, ...]) -> tuple[str, bool]:
    """One step far above the cap: the error's first line, and whether is_oom_error knows it."""
    model: torch.nn.Module | None = _model(ctx, fail_above)
    x: torch.Tensor | None = torch.randn(8 if ctx.smoke else 8192, *shape, device=ctx.device)
    try:
        model(x).square().mean().backward()  # type: ignore[misc]
        return "no error", False
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:90]}", gradaccum.is_oom_error(error)
    finally:
        model = x = None  # the step's tensors go before the cache is emptied
        _release()


def _train(ctx: Context, fail_above: int | None, micro: str | list[int], shape: tuple[int, ...],
           global_batch: int) -> tuple[list[torch.Tensor], int, int, list[int]]:
    """Train BATCHES global batches (``"auto"``, or a fixed micro-batch per global batch): the
    parameters (copied to the CPU), the last micro-batch, the OOMs recovered, and the micro-batch
    each global batch was trained at."""
    model = _model(ctx, fail_above)
    acc = gradaccum.Accumulator(torch.optim.Adam(model.parameters(), lr=1e-4), 1, model=model)
    auto = gradaccum.AutoBatch(acc, "auto") if micro == "auto" else None
    g = torch.Generator().manual_seed(0)
    tried = []
    for i in range(BATCHES):
        x = torch.randn(global_batch, *shape, generator=g).to(ctx.device)
        y = torch.randint(0, 10, (global_batch,), generator=g).to(ctx.device)
        step = auto if auto is not None else gradaccum.AutoBatch(acc, micro[i])
        step.step((x, y), lambda mb: torch.nn.functional.cross_entropy(model(mb[0]), mb[1]))
        tried.append(step.micro_batch or global_batch)
    ooms = auto.ooms if auto is not None else 0
    return [p.detach().cpu().clone() for p in model.parameters()], tried[-1], ooms, tried


def run(ctx: Context) -> Outcome:
    """The real OOM, the recovery, and the clean run at the settled size."""
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    fail_above = 4 if ctx.smoke else None
    shape = MODELS["cnn" if ctx.smoke else "bench-cnn"][1]
    global_batch = 16 if ctx.smoke else 1024
    if not ctx.smoke:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB * 2**30 / total), ctx.device)
    ctx.record(cap="simulated: OOM above 4 images" if ctx.smoke else f"{CAP_GIB} GiB",
               model="cnn" if ctx.smoke else "bench-cnn", global_batch=global_batch, batches=BATCHES)
    message, recognized = _real_oom(ctx, fail_above, shape)
    ctx.record(oom_error=message, is_oom_error=recognized)
    auto_params, settled, ooms, tried = _train(ctx, fail_above, "auto", shape, global_batch)
    _release()  # its model is gone: the clean run gets the memory back
    ctx.record(settled=settled, ooms=ooms, micro_batch_after_each_global_batch=tried)
    if not ctx.smoke:  # the reference trains at those sizes without the cap (see the docstring)
        torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        ctx.record(reference_capped=False)
    clean_params, _, _, _ = _train(ctx, fail_above, tried, shape, global_batch)
    equal = all(torch.equal(a, b) for a, b in zip(auto_params, clean_params, strict=True))
    worst = max(float((a - b).abs().max()) for a, b in zip(auto_params, clean_params, strict=True))
    ctx.record(params_equal=equal, max_abs_diff=worst)
    measured = (f"{message[:60]}; is_oom_error {recognized}; from {global_batch}: {ooms} OOMs, "
                f"settled at {settled}; params equal a clean run at {'/'.join(map(str, tried))}: {equal} "
                f"(max |diff| {worst:.3g})")
    met = recognized and ooms > 0 and equal
    return Outcome(measured, "OOM recognized, recovers, torch.equal clean run", met)
