"""``gradaccum plan``'s prediction against the measured peak (docs/MEMORY.md), as a results file.

Runs ``gradaccum plan --global-batch 256 --budget 512MiB`` on the benchmark CNN with ``--check``
(the recommendation), ``--check 24`` and ``--check 64 --check-steps 2``, each in a fresh process
as a user would, and keeps what each printed: every line with its numbers (a page quoting a line
binds each number to its key), and each check's predicted and measured bytes and error. It also
sums the bytes autograd saves for one sample's forward (the activations the probes' slope should
match).

    python benchmarks/plan_accuracy.py --json docs/results/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.doc_binding import cited  # the numbers of a line as a page's test reads them

BASE = ["--global-batch", "256", "--budget", "512MiB"]
CHECKS = {"recommended": ["--check"], "24x4": ["--check", "24"],
          "64x2": ["--check", "64", "--check-steps", "2"]}
CHECK = re.compile(r"check at micro-batch (\d+) x (\d+) steps: predicted .*?\((\d+) B\), "
                   r"measured .*?\((\d+) B\), error ([-+]\d+\.\d)%")


def _numbers(line: str) -> list[float]:
    """The numbers of a printed line, found as tests/test_doc_numbers.py finds them in a quote."""
    return [float(token.replace(",", "")) for token, _ in cited("```\n" + line + "\n```")]


def run_plan(options: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gradaccum", "plan", *BASE, *options]
    print("$", "gradaccum", *cmd[3:], flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    lines = [{"text": line, "numbers": _numbers(line)} for line in out.splitlines()]
    micro, steps, predicted, measured, error = CHECK.search(out).groups()  # type: ignore[union-attr]
    return {"command": "gradaccum plan " + " ".join(BASE + options), "lines": lines,
            "check": {"micro_batch": int(micro), "steps": int(steps), "predicted_bytes": int(predicted),
                      "measured_bytes": int(measured), "predicted_mib": int(predicted) / 2**20,
                      "measured_mib": int(measured) / 2**20, "error_percent": float(error),
                      "error_exact_percent": 100 * (int(predicted) - int(measured)) / int(measured)}}


def saved_bytes_per_sample() -> float:
    """Bytes autograd saves for the backward of one bench-cnn sample (storages counted once)."""
    import torch

    from gradaccum.cli.plan import load_model

    model, shape = load_model("bench-cnn")
    assert shape is not None
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().data_ptr() not in seen:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    per = []
    for batch in (4, 8):
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(batch, *shape)).sum()
        per.append(sum(seen.values()))
    return (per[1] - per[0]) / 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    runs = {name: run_plan(options) for name, options in CHECKS.items()}
    saved = saved_bytes_per_sample()
    result = {"machine": describe_machine(), "model": "bench-cnn", "runs": runs,
              "saved_tensor_mib_per_sample": saved / 2**20, "benchmark_seconds": time.perf_counter() - start}
    write_results(args.json, result, indent=2)
    print(f"wrote {args.json} in {result['benchmark_seconds']:.0f} s")


if __name__ == "__main__":
    main()
