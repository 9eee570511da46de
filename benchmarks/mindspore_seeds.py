"""The seed experiment on both backends, and under msrun (docs/MINDSPORE.md), as a results file.

- ``seeds``: ``gradaccum compare --backends torch,mindspore --init mindspore --seed S`` for seeds 0
  to 4 at 32x2 (and 64x1 for seed 0): each backend's accuracy and test loss per epoch, and the
  largest parameter difference between the backends at each setting.
- ``msrun``: ``python -m gradaccum train --backend mindspore --init mindspore --micro-batch 16
  --steps 2`` on 2 CPU ranks under msrun, against one MindSpore process of 32x2 (the seeds part's
  seed 0 run): accuracies, test loss, optimizer steps, the largest parameter difference, times.

    python benchmarks/mindspore_seeds.py --json docs/results/mindspore_seeds.json

Runs for about an hour on 2 CPU cores (the MindSpore runs are the slow ones).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL_REPORTED = [84.8, 90.1, 92.0]  # the MindSpore tutorial's accuracies (cited, not measured)


def _diff(a: Path, b: Path) -> float:
    with np.load(a / "params.npz") as pa, np.load(b / "params.npz") as pb:
        return max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa.files)


def _epochs(run: Path) -> list[dict[str, Any]]:
    return json.loads((run / "summary.json").read_text())["epochs"]


def part_seeds(work: Path, extra: list[str]) -> dict[str, Any]:
    seeds: dict[str, Any] = {}
    for seed in range(5):
        out = work / f"seed{seed}"
        settings = "64x1,32x2" if seed == 0 else "32x2"
        cmd = [sys.executable, "-m", "gradaccum", "compare", "--settings", settings, "--backends",
               "torch,mindspore", "--init", "mindspore", "--seed", str(seed), "--out", str(out),
               "--no-progress", *extra]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, capture_output=True)
        runs = {}
        for setting in settings.split(","):
            pair = {b: _epochs(out / f"{setting}-{b}") for b in ("torch", "mindspore")}
            runs[setting] = {
                **{f"{b}_accuracy": [e["test_accuracy"] for e in pair[b]] for b in pair},
                **{f"{b}_loss": [e["test_loss"] for e in pair[b]] for b in pair},
                "optimizer_steps": pair["torch"][-1]["optimizer_steps"],  # cumulative
                "backend_diff": _diff(out / f"{setting}-torch", out / f"{setting}-mindspore"),
            }
        if seed == 0:
            base = out / "64x1-torch"
            runs["diff_vs_64x1_torch"] = {f"{s}-{b}": _diff(base, out / f"{s}-{b}")
                                          for s in ("64x1", "32x2") for b in ("torch", "mindspore")}
        seeds[str(seed)] = runs
    rows = [s["32x2"] for s in seeds.values()]
    acc_pairs = [(t, m) for r in rows for t, m in zip(r["torch_accuracy"], r["mindspore_accuracy"],
                                                       strict=True)]
    return {"seeds": seeds,
            "mean": {b: [statistics.fmean(r[f"{b}_accuracy"][e] for r in rows) for e in range(3)]
                     for b in ("torch", "mindspore")},
            "accuracies_equal": sum(t == m for t, m in acc_pairs), "accuracies": len(acc_pairs),
            "largest_backend_diff": max(r["backend_diff"] for r in rows),
            "largest_loss_gap": max(abs(t - m) for r in rows
                                    for t, m in zip(r["torch_loss"], r["mindspore_loss"], strict=True)),
            "tutorial_reported": TUTORIAL_REPORTED}


def part_msrun(work: Path, extra: list[str]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.ranks import msrun_command

    out = work / "msrun"
    args = ["python", "-m", "gradaccum", "train", "--backend", "mindspore", "--init", "mindspore",
            "--micro-batch", "16", "--steps", "2", "--out", str(out / "run"), "--no-progress", *extra]
    command, env = msrun_command(args, out)
    print("$ msrun --worker_num 2", " ".join(args), flush=True)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    one = work / "seed0" / "32x2-mindspore"  # one MindSpore process, 32x2, seed 0
    ranks, single = _epochs(out / "run"), _epochs(one)
    rank1 = [p for p in (out / "logs").glob("worker_1*.log")]
    rank1_lines = sum("gradaccum" in line for p in rank1 for line in p.read_text().splitlines())
    return {"two_ranks": {"accuracy": [e["test_accuracy"] for e in ranks],
                          "loss": [e["test_loss"] for e in ranks],
                          "optimizer_steps": ranks[-1]["optimizer_steps"], "seconds": seconds},
            "one_process": {"accuracy": [e["test_accuracy"] for e in single],
                            "loss": [e["test_loss"] for e in single],
                            "optimizer_steps": single[-1]["optimizer_steps"],
                            "seconds": json.loads((one / "summary.json").read_text())["seconds"]},
            "max_param_diff": _diff(out / "run", one), "rank1_gradaccum_lines": rank1_lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--limit-train", type=int, default=None, help="a quick check on fewer items")
    args = parser.parse_args()
    extra = [] if args.limit_train is None else ["--limit-train", str(args.limit_train), "--epochs", "3",
                                                 "--limit-test", "500"]
    import mindspore

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result: dict[str, Any] = {"machine": {**describe_machine(), "mindspore": mindspore.__version__}}
        result |= part_seeds(work, extra)
        result["msrun"] = part_msrun(work, extra)
    result["benchmark_seconds"] = time.perf_counter() - start
    write_results(args.json, result, indent=2)
    print(f"wrote {args.json} in {result['benchmark_seconds']:.0f} s")


if __name__ == "__main__":
    main()
