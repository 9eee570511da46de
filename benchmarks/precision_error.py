"""Error of the accumulated gradient of a bf16 model: bf16 accumulation against float32 buffers.

For each number of micro-batches N, the seed's MLP in bfloat16 computes the gradients of N
MNIST micro-batches once; both accumulators then sum *the same* micro-batch gradients (each fed
through a surrogate loss whose gradient is exactly that micro-batch's gradient), so the table
isolates the accumulation:

* ``bf16 .grad``: plain accumulation in ``.grad`` (gradaccum's default);
* ``fp32 buffer``: ``accum_dtype=torch.float32``, the float32 sum before it is cast;
* ``fp32 -> .grad``: what the optimizer receives from it (the sum rounded to bf16 once).

Errors are relative L2 norms over all parameters, against the float64 sum of the same micro-batch
gradients (medians over ``--windows`` windows of data). The last two columns compare with the
float64 gradient of the same window computed by a float64 copy of the model: the bf16 forward and
backward's own error, which no accumulator removes. Memory: bytes of the float32 buffers, computed
(4 bytes per bf16 trainable element) and measured (the storage the accumulator allocated; on CUDA
also the allocator's peak, against plain bf16 accumulation).

    python benchmarks/precision_error.py [--steps 4 16 64] [--micro 32] [--windows 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradaccum import Accumulator
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.demos.models import build_model

Grads = list[torch.Tensor]


def micro_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int) -> list[Grads]:
    """Each micro-batch's gradient of its mean loss, as bf16 autograd gives it."""
    out = []
    for xb, yb in zip(x.split(micro), y.split(micro), strict=True):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb).float(), yb).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return out


def accumulate(model: nn.Module, parts: Sequence[Grads], accum_dtype: torch.dtype | None
               ) -> tuple[Grads, Grads | None, int, int]:
    """Feed the micro-batch gradients through an Accumulator; return what the optimizer got.

    Returns:
        ``(grads at the step, float32 buffers or None, buffer bytes, CUDA peak bytes or 0)``.
    """
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    acc = Accumulator(opt, len(parts), accum_dtype=accum_dtype)
    wide = acc._precision.buffers  # None without accum_dtype
    seen: list[Grads] = []
    buffers: list[Grads] = []

    def record(*_: object) -> None:
        seen.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        if wide is not None:  # the float32 sum, before the window is cleared
            buffers.append([b.clone() for b in wide.grads()])

    opt.register_step_pre_hook(record)
    cuda = params[0].device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for grads in parts:
        # d/dp sum(p * g) = g exactly: both accumulators sum identical terms.
        acc.backward(sum((p * g).sum() for p, g in zip(params, grads, strict=True)))  # type: ignore[arg-type]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return seen[0], (buffers[0] if buffers else None), (0 if wide is None else wide.nbytes), peak


def rel_error(grads: Sequence[torch.Tensor], exact: Sequence[torch.Tensor]) -> float:
    """Global relative L2 error over all parameters."""
    num = sum(float((g.double() - e).pow(2).sum()) for g, e in zip(grads, exact, strict=True))
    den = sum(float(e.pow(2).sum()) for e in exact)
    return (num / den) ** 0.5


def window_errors(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, micro: int
                  ) -> tuple[dict[str, float], tuple[int, int, int]]:
    parts = micro_grads(model, x, y, micro)
    exact = [torch.stack([g[i].double() for g in parts]).sum(0) / steps for i in range(len(parts[0]))]
    narrow, _, _, peak_narrow = accumulate(model, parts, None)
    handed, buffers, nbytes, peak_wide = accumulate(model, parts, torch.float32)
    assert buffers is not None
    model64 = copy.deepcopy(model).double()
    model64.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model64(x.double()), y).backward()
    true = [p.grad for p in model64.parameters()]
    errors = {
        "bf16 .grad": rel_error(narrow, exact),
        "fp32 buffer": rel_error(buffers, exact),
        "fp32 -> .grad": rel_error(handed, exact),
        "model: bf16 acc": rel_error(narrow, true),  # type: ignore[arg-type]
        "model: fp32 acc": rel_error(handed, true),  # type: ignore[arg-type]
    }
    return errors, (nbytes, peak_narrow, peak_wide)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every number printed here (docs/results/precision_error.json)")
    args = parser.parse_args()

    machine = describe_machine()
    results: dict[str, Any] = {"machine": machine, "command": " ".join(["python", *sys.argv]),
                               "settings": vars(args) | {"json": None}, "rows": []}
    for key, value in machine.items():
        print(f"{key:>14}: {value}")
    device = torch.device(args.device)
    model = build_model(args.model, seed=0).to(device=device, dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = max(args.steps) * args.micro * args.windows
    x_all, y_all = mnist_tensors("train", limit=need)
    x_all, y_all = x_all.to(device), y_all.to(device)
    print(f"\nmodel {args.model} in bfloat16, {numel} trainable elements; micro-batch {args.micro}; "
          f"relative L2 error, median of {args.windows} windows\n")
    columns = ["bf16 .grad", "fp32 buffer", "fp32 -> .grad", "model: bf16 acc", "model: fp32 acc"]
    print(f"{'steps':>5} | " + " | ".join(f"{c:>15}" for c in columns)
          + " | bf16/fp32 buf | bf16/fp32 ->.grad")
    memory = None
    for steps in args.steps:
        rows: dict[str, list[float]] = {c: [] for c in columns}
        for w in range(args.windows):
            lo = w * steps * args.micro
            x, y = x_all[lo:lo + steps * args.micro], y_all[lo:lo + steps * args.micro]
            errors, memory = window_errors(model, x.to(torch.bfloat16), y, steps, args.micro)
            for c in columns:
                rows[c].append(errors[c])
        med = {c: statistics.median(v) for c, v in rows.items()}
        results["rows"].append({"steps": steps, **med,
                                "bf16 / fp32 buffer": med["bf16 .grad"] / med["fp32 buffer"],
                                "bf16 / fp32 -> .grad": med["bf16 .grad"] / med["fp32 -> .grad"]})
        print(f"{steps:>5} | " + " | ".join(f"{med[c]:>15.3e}" for c in columns)
              + f" | {med['bf16 .grad'] / med['fp32 buffer']:>12.0f}x"
              + f" | {med['bf16 .grad'] / med['fp32 -> .grad']:>16.1f}x")
    assert memory is not None
    nbytes, peak_narrow, peak_wide = memory
    print(f"\nfloat32 buffers: computed {4 * numel} bytes (4 x {numel}; the bf16 parameters take "
          f"{2 * numel}), measured {nbytes} bytes allocated")
    results["memory"] = {"elements": numel, "computed_bytes": 4 * numel, "bf16_param_bytes": 2 * numel,
                         "measured_bytes": nbytes}
    if args.json is not None:
        write_results(args.json, results, default=str)
    if device.type == "cuda":
        print(f"CUDA peak while accumulating: bf16 {peak_narrow} bytes, fp32 buffers {peak_wide} bytes, "
              f"difference {peak_wide - peak_narrow}")


if __name__ == "__main__":
    main()
