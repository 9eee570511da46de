"""GPU check: a real CUDA out-of-memory, AutoBatch's recovery from it, and the planner on CUDA.

Caps this process's CUDA memory (``torch.cuda.set_per_process_memory_fraction``) so that the
benchmark CNN runs out at a known size even on a large GPU, then:

1. measures the peak (``max_memory_allocated``) of a training window at several micro-batches
   and prints it beside the planner's prediction (``gradaccum plan``'s probes, on CUDA);
2. triggers a real CUDA OOM and checks that ``gradaccum.is_oom_error`` recognizes it;
3. trains a few global batches with ``AutoBatch(micro_batch="auto")`` starting from the whole
   global batch: it runs out, halves, reruns; prints each size tried, and compares the final
   parameters with a clean run at the size it settled on (``torch.equal``, deterministic cuDNN).

Runs in well under 5 minutes on one GPU. Without CUDA it prints a line and exits 0.
``--cpu-smoke`` runs the same code on the CPU at tiny sizes with the OOM *simulated* (a forward
hook raises ``torch.OutOfMemoryError`` above a size): it checks the script, not the GPU.

    python benchmarks/gpu_oom_check.py               # on a GPU machine
    python benchmarks/gpu_oom_check.py --cpu-smoke   # anywhere
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA

import torch

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.core.memory import format_bytes
from gradaccum.demos.models import MODELS, build_model
from gradaccum.torch.memory.probe import estimate_memory, measure_peak

SHAPE = MODELS["bench-cnn"][1]


def make_model(device: torch.device, fail_above: int | None) -> torch.nn.Module:
    model = build_model("bench-cnn", seed=0).to(device)
    if fail_above is not None:  # --cpu-smoke: a simulated OOM above a size
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if args[0].shape[0] > fail_above:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory (--cpu-smoke)")
        model.register_forward_pre_hook(hook)
    return model


def peaks_table(device: torch.device, sizes: list[int], probes: tuple[int, int]) -> None:
    model = make_model(device, None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    est = estimate_memory(model, opt, SHAPE, probes)
    print(f"\n1. peak per micro-batch (window of 2 micro-batches, Adam); planner probes at {probes}")
    print(f"   activations {format_bytes(est.activation_bytes_per_sample)} per sample, "
          f"floor {format_bytes(est.floor)}")
    print(f"   {'micro-batch':>11}  {'predicted':>11}  {'measured':>11}  {'error':>7}")
    for m in sizes:
        measured = measure_peak(model, opt, SHAPE, m, steps=2)
        predicted = est.peak(m)
        print(f"   {m:>11}  {format_bytes(predicted):>11}  {format_bytes(measured):>11}  "
              f"{100 * (predicted - measured) / measured:>+6.1f}%")


def real_oom(device: torch.device, fail_above: int | None, size: int) -> None:
    model = make_model(device, fail_above)
    print(f"\n2. one forward/backward at micro-batch {size}, beyond the cap")
    try:
        x = torch.randn(size, *SHAPE, device=device)
        model(x).square().mean().backward()
        print("   no OOM: raise --global-batch or lower --cap-gib")
    except Exception as error:
        print(f"   {type(error).__name__}: {str(error).splitlines()[0][:100]}")
        print(f"   gradaccum.is_oom_error: {gradaccum.is_oom_error(error)}")
    del model
    gradaccum.torch.memory.oom.release_memory()


def train(device: torch.device, fail_above: int | None, micro: int | str, global_batch: int,
          batches: int) -> tuple[torch.nn.Module, gradaccum.AutoBatch, float]:
    model = make_model(device, fail_above)
    acc = gradaccum.Accumulator(torch.optim.Adam(model.parameters(), lr=1e-4), 1, model=model)
    auto = gradaccum.AutoBatch(acc, micro)
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(batches):
        x = torch.randn(global_batch, *SHAPE, generator=g).to(device)
        y = torch.randint(0, 10, (global_batch,), generator=g).to(device)
        before = auto.ooms
        auto.step((x, y), lambda mb: torch.nn.functional.cross_entropy(model(mb[0]), mb[1]))
        if auto.ooms > before:
            print(f"   micro-batch {micro}: global batch done at {auto.micro_batch} "
                  f"({auto.ooms} OOMs so far)")
    return model, auto, time.perf_counter() - start


def recovery(device: torch.device, fail_above: int | None, global_batch: int, batches: int) -> bool:
    print(f"\n3. AutoBatch('auto') from the whole global batch {global_batch}, {batches} batches")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, auto, seconds = train(device, fail_above, "auto", global_batch, batches)
    peak = (format_bytes(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
            else "not tracked on the CPU")
    print(f"   settled at micro-batch {auto.micro_batch} after {auto.ooms} OOMs, {seconds:.1f} s; "
          f"peak {peak}")
    clean, _, _ = train(device, fail_above, auto.micro_batch or global_batch, global_batch, batches)
    pairs = [(a.detach(), b.detach()) for a, b in zip(model.parameters(), clean.parameters(), strict=True)]
    same = all(torch.equal(a, b) for a, b in pairs)
    worst = max(float((a - b).abs().max()) for a, b in pairs)
    print(f"   parameters equal a clean run at micro-batch {auto.micro_batch}: {same} "
          f"(max |diff| {worst:.3g})")
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-gib", type=float, default=1.5, help="CUDA memory cap for this process")
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny sizes, simulated OOM")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        device, fail_above = torch.device("cpu"), 4
        sizes, probes, global_batch, oom_size = [3, 6], (2, 4), 16, 8
    elif not torch.cuda.is_available():
        print("gpu_oom_check: no CUDA device: skipped")
        return 0
    else:
        device, fail_above = torch.device("cuda"), None
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
        sizes, probes, global_batch, oom_size = [32, 64, 128, 256], (8, 16), args.global_batch, 4096
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    for key, value in describe_machine().items():
        print(f"{key:>14}: {value}")
    print(f"{'memory cap':>14}: {args.cap_gib} GiB" if device.type == "cuda" else
          f"{'memory cap':>14}: simulated, OOM above micro-batch {fail_above}")
    peaks_table(device, sizes, probes)
    real_oom(device, fail_above, oom_size)
    same = recovery(device, fail_above, global_batch, args.batches)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
