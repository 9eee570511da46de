"""Which probe sizes predict a CUDA training peak: the planner's line against measured peaks.

On CUDA (the benchmark CNN, Adam, float32) this measures, at micro-batches 1 to 256, the peak of
a probe window (``window_peaks``, a fresh model each size, twice in a row) and of real training
(the GPU check's ``training_peak``: an Accumulator, 4 micro-batches), with cuDNN on and off; then
``estimate_memory`` with several probe sets, and each set's error against the training peak.
It is the evidence for ``gradaccum plan``'s default probes (docs/MEMORY.md): on an H200 a probe's
peak moves by a few MiB with cuDNN's algorithm for that size, so a line through two small probes
misses far sizes by several percent. CUDA only (on the CPU the peaks are profiler sums, exact).

    python benchmarks/plan_probes.py --json docs/results/plan_probes.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PROBE_SETS = ((4, 8), (8, 16), (16, 32), (8, 32), (2, 4, 8, 16))
SHAPE = (3, 64, 64)


def _fresh(device: Any) -> tuple[Any, Any]:
    import torch

    from gradaccum.demos.models import build_model

    gc.collect()
    torch.cuda.empty_cache()
    model = build_model("bench-cnn", seed=0).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def peaks(device: Any) -> dict[str, dict[int, dict[str, int]]]:
    """Probe-window and training peaks at every size, with cuDNN on and off (bytes)."""
    import torch

    from gradaccum.bench.gpu.check import Context
    from gradaccum.bench.gpu.planner import training_peak
    from gradaccum.torch.memory.probe import window_peaks

    ctx = Context(device=device, deadline=time.time() + 3600)
    out: dict[str, dict[int, dict[str, int]]] = {}
    for label, enabled in (("cudnn", True), ("no_cudnn", False)):
        torch.backends.cudnn.enabled = enabled
        rows = {}
        for m in SIZES:
            model, opt = _fresh(device)
            window_peaks(model, opt, SHAPE, 1)  # the optimizer state, as estimate_memory's warm-up
            first, update = window_peaks(model, opt, SHAPE, m)
            again, _ = window_peaks(model, opt, SHAPE, m)
            del model, opt
            rows[m] = {"probe": first, "probe_again": again, "update": update,
                       "train": training_peak(ctx, "bench-cnn", m)}
            print(label, m, rows[m], flush=True)
        out[label] = rows
    torch.backends.cudnn.enabled = True
    return out


def estimates(device: Any) -> dict[str, dict[int, int]]:
    """``estimate_memory``'s predicted peak at every size, for each probe set (cuDNN on)."""
    from gradaccum.torch.memory.probe import estimate_memory

    result = {}
    for probes in PROBE_SETS:
        model, opt = _fresh(device)
        est = estimate_memory(model, opt, SHAPE, probes)
        result[",".join(map(str, probes))] = {m: est.peak(m) for m in SIZES}
    return result


def errors(predicted: dict[str, dict[Any, int]], train: dict[Any, dict[str, int]]) -> dict[str, Any]:
    """Each probe set's error (percent, predicted - measured over measured) at 32, 96 and 256."""
    return {name: {m: 100 * (p[m] - train[m]["train"]) / train[m]["train"] for m in (32, 96, 256)}
            for name, p in predicted.items()}


def main() -> int:
    import torch

    from gradaccum.bench.machine import describe_machine
    from gradaccum.bench.results_file import write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("plan_probes.py: error: needs a CUDA device (the CPU's peaks are exact sums)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    start = time.perf_counter()
    measured = peaks(device)
    predicted = estimates(device)
    result = {"machine": describe_machine(), "model": "bench-cnn", "optimizer": "adam",
              "sizes": list(SIZES), "peaks": measured, "estimates": predicted,
              "error_percent": errors(predicted, measured["cudnn"]),
              "benchmark_seconds": time.perf_counter() - start}
    write_results(args.json, result)
    print(json.dumps(result["error_percent"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
