"""The seed run on 2 DDP ranks against one process (docs/DISTRIBUTED.md), as a results file.

Runs ``torchrun --nproc-per-node 2 -m gradaccum train --micro-batch 16 --steps 2`` (gloo on the
CPU) and ``gradaccum train --micro-batch 32 --steps 2`` (the same windows: 64 items per optimizer
step), each in a fresh process, and keeps each epoch's test accuracy and loss, the optimizer
steps, and the largest parameter difference between the two runs (with the largest parameter).

    python benchmarks/seed_ddp.py --json docs/results/seed_ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results

RUNS = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "-m", "gradaccum", "train", "--micro-batch", "16", "--steps", "2"],
        "one_process": [sys.executable, "-m", "gradaccum", "train", "--micro-batch", "32", "--steps", "2"]}


def run(cmd: list[str], out: Path, extra: list[str]) -> dict[str, Any]:
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run([*cmd, "--out", str(out), "--no-progress", *extra], check=True, capture_output=True,
                   env={"GLOO_SOCKET_IFNAME": "lo", **os.environ})
    summary = json.loads((out / "summary.json").read_text())
    return {"epochs": summary["epochs"], "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--limit-train", type=int, default=None, help="a quick check on fewer items")
    args = parser.parse_args()
    extra = [] if args.limit_train is None else ["--limit-train", str(args.limit_train), "--epochs", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(cmd, Path(tmp) / name, extra) for name, cmd in RUNS.items()}
        a, b = (np.load(Path(tmp) / name / "params.npz") for name in RUNS)
        diff = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
        largest = max(float(np.abs(b[k]).max()) for k in b.files)
    steps = runs["one_process"]["epochs"][-1]["optimizer_steps"]  # cumulative
    result = {"machine": describe_machine(), "commands": {k: " ".join(v[1:]) for k, v in RUNS.items()},
              "runs": runs, "max_param_diff": diff, "largest_param": largest, "optimizer_steps": steps}
    write_results(args.json, result, indent=2)
    print(f"wrote {args.json}: max param diff {diff:.1e}")


if __name__ == "__main__":
    main()
