"""The seed experiment's figures (README, docs/SEED_EXPERIMENT.md), written as results files.

Three parts, each a results file of its own (every figure the pages cite, under one key):

- ``compare``: ``gradaccum compare`` (64x1, 32x2, 8x8; PyTorch's initialization, seed 0): each
  setting's accuracy and test loss per epoch, its largest parameter difference from 64x1, time
  and peak RSS, and the 32x2 run's log lines as printed (text and numbers).
- ``tutorial``: ``--init mindspore`` (the tutorial's initialization) at 32x2 for seeds 0 to 4,
  and 64x1 and 8x8 for seed 0; each seed's distance from the tutorial's reported accuracies.
- ``rss``: ``gradaccum compare --epochs 1`` run ``--runs`` times: each setting's peak RSS per run.

    python benchmarks/seed_experiment.py compare --json docs/results/seed_compare.json
    python benchmarks/seed_experiment.py tutorial --json docs/results/seed_tutorial.json
    python benchmarks/seed_experiment.py rss --runs 10 --json docs/results/seed_rss.json

Each run is a ``gradaccum compare`` child process (its own peak memory, as a user's run).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results

MIB = 2**20
# The MindSpore tutorial's reported test accuracy (%) after epochs 1, 2, 3 (cited, not measured).
TUTORIAL_REPORTED = [84.8, 90.1, 92.0]
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _compare(out: Path, *options: str) -> tuple[dict[str, Any], str]:
    """Run ``gradaccum compare`` into ``out``; its rows by setting, and what it printed."""
    cmd = [sys.executable, "-m", "gradaccum", "compare", "--out", str(out), "--no-progress", *options]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads((out / "compare.json").read_text())
    return {row["setting"]: _row(row) for row in rows}, done.stdout


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "peak_rss_mib": row["peak_memory_bytes"] / MIB}


def _lines(stdout: str, setting: str) -> list[dict[str, Any]]:
    """One setting's printed lines (between its ``===`` header and its ``Done`` line), each with
    the numbers it holds, so that a page quoting a line binds each number to its own key."""
    section = stdout.split(f"=== {setting}:", 1)[1].split("\n=== ", 1)[0]
    lines = [line for line in section.splitlines()[1:] if line.strip()]
    return [{"text": line, "numbers": [float(n) for n in NUMBER.findall(line)]} for line in lines]


def part_compare(work: Path) -> dict[str, Any]:
    rows, stdout = _compare(work / "compare")
    accs = {s: [e["test_accuracy"] for e in r["epochs"]] for s, r in rows.items()}
    losses = {s: [e["test_loss"] for e in r["epochs"]] for s, r in rows.items()}
    return {
        "command": "gradaccum compare",
        "settings": {"epochs": len(accs["64x1"]), "seed": 0, "init": "torch", "lr": 0.01,
                     "test_images": 10_000},
        "rows": rows,
        # How far 32x2 and 8x8 are from 64x1, in accuracy points and test loss, at each epoch.
        "largest_accuracy_gap": max(abs(a - b) for s in ("32x2", "8x8")
                                    for a, b in zip(accs[s], accs["64x1"], strict=True)),
        "largest_loss_gap": max(abs(a - b) for s in ("32x2", "8x8")
                                for a, b in zip(losses[s], losses["64x1"], strict=True)),
        "log_32x2": _lines(stdout, "32x2"),
    }


def part_tutorial(work: Path) -> dict[str, Any]:
    seeds: dict[str, Any] = {}
    seed0, _ = _compare(work / "seed0", "--init", "mindspore", "--seed", "0")
    for seed in range(5):
        rows = seed0 if seed == 0 else _compare(work / f"seed{seed}", "--init", "mindspore",
                                                "--seed", str(seed), "--settings", "32x2")[0]
        accs = [e["test_accuracy"] for e in rows["32x2"]["epochs"]]
        seeds[str(seed)] = {"accuracy": accs,
                            "above_tutorial": [a - t for a, t in zip(accs, TUTORIAL_REPORTED, strict=True)]}
    mean = [statistics.fmean(s["accuracy"][e] for s in seeds.values()) for e in range(3)]
    epoch1 = [s["accuracy"][0] for s in seeds.values()]
    return {
        "command": "gradaccum compare --init mindspore --seed S (--settings 32x2 for S > 0)",
        "settings": {"init": "mindspore", "seeds": 5, "setting": "32x2", "epochs": 3},
        "tutorial_reported": TUTORIAL_REPORTED,
        "seeds": seeds,
        "mean": {"accuracy": mean,
                 "above_tutorial": [m - t for m, t in zip(mean, TUTORIAL_REPORTED, strict=True)]},
        "epoch1_range": [min(epoch1), max(epoch1)],
        "largest_gap_epochs_2_3": max(abs(a) for s in seeds.values() for a in s["above_tutorial"][1:]),
        "seeds_within_1_point_at_epoch_1": sum(abs(s["above_tutorial"][0]) <= 1.0 for s in seeds.values()),
        "seed0_settings": {s: [e["test_accuracy"] for e in r["epochs"]] for s, r in seed0.items()},
    }


def part_rss(work: Path, runs: int) -> dict[str, Any]:
    peaks: dict[str, list[float]] = {}
    for k in range(runs):
        rows, _ = _compare(work / f"rss{k}", "--epochs", "1")
        for setting, row in rows.items():
            peaks.setdefault(setting, []).append(row["peak_rss_mib"])
    every = [p for values in peaks.values() for p in values]
    return {
        "command": f"gradaccum compare --epochs 1, {runs} times",
        "settings": {"runs": runs, "epochs": 1},
        "peak_rss_mib": {s: {"runs": v, "min": min(v), "max": max(v)} for s, v in peaks.items()},
        "all": {"count": len(every), "min": min(every), "max": max(every),
                "spread_percent": 100 * (max(every) - min(every)) / min(every)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["compare", "tutorial", "rss"])
    parser.add_argument("--runs", type=int, default=10, help="rss: compare runs (default 10)")
    parser.add_argument("--json", type=Path, required=True, help="the results file to write")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.part == "compare":
            result = part_compare(work)
        elif args.part == "tutorial":
            result = part_tutorial(work)
        else:
            result = part_rss(work, args.runs)
    result = {"machine": describe_machine(), **result,
              "benchmark_seconds": time.perf_counter() - start}
    write_results(args.json, result, indent=2)
    print(f"wrote {args.json} in {result['benchmark_seconds']:.0f} s")


if __name__ == "__main__":
    main()
