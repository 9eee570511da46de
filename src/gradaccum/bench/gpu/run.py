"""``python -m gradaccum.bench.gpu``: every GPU check, each time-boxed in a process of its own
(:mod:`gradaccum.bench.gpu.child`, forked from a server that has imported torch once).

With CUDA, each check runs at its real size within its time box (the boxes add up to 630 s);
without CUDA (or with ``--smoke``), each runs its CPU smoke: tiny sizes, the same code. A check
that runs out is killed (with any process it started) and its row says so; the next one runs.
Prints the table and writes ``report.md``, ``report.json`` and ``logs/`` into ``--out``.

Exit status: 0 when every check returned its figures, PASS or FAIL (a missed target is the
report's news, not a failed command); 1 when a check raised, or when a smoke check ran out of time
(the smoke takes seconds: it hung); 2 for bad usage.

    python -m gradaccum.bench.gpu [--out runs/gpu_check] [--smoke] [--only overhead,oom]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradaccum.bench.gpu.child import PRELOAD, child_main, probe_device
from gradaccum.bench.gpu.report import Row, exit_status, write_report
from gradaccum.bench.machine import describe_machine

__all__ = ["CHECKS", "CheckSpec", "main", "run_check", "run_checks"]

SMOKE_BUDGET_S = 150.0  # seconds of work on a loaded CI machine; more means it hangs
MARGIN_S = 8.0  # the check's own deadline comes this much before the kill (start-up, write-out)


@dataclass(frozen=True)
class CheckSpec:
    """One check: its name, module (with ``run(ctx)``), row title, CUDA time box and environment.

    Attributes:
        env: variables its process needs from the start (before CUDA initializes).
    """

    name: str
    module: str
    title: str
    budget_s: float
    env: dict[str, str] = field(default_factory=dict)


CHECKS = (
    CheckSpec("overhead", "gradaccum.bench.gpu.overhead",
              "overhead: ~100 M GPT, bf16 autocast, vs nanoGPT's loop", 100),
    CheckSpec("host_sync", "gradaccum.bench.gpu.host_sync",
              "no host sync in a window (sync debug mode 'error')", 30),
    CheckSpec("fp16_scaler", "gradaccum.bench.gpu.fp16_scaler",
              "fp16 + GradScaler: skipped windows with n_items", 35),
    CheckSpec("oom", "gradaccum.bench.gpu.oom",
              "OOM: AutoBatch('auto') recovers from a real CUDA OOM", 50,
              env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),  # deterministic cuBLAS: torch.equal
    CheckSpec("planner", "gradaccum.bench.gpu.planner",
              "planner: `gradaccum plan` vs max_memory_allocated", 40),
    CheckSpec("accum_dtype", "gradaccum.bench.gpu.accum_dtype",
              "accum_dtype=float32 with bf16 parameters", 30),
    CheckSpec("compiled", "gradaccum.bench.gpu.compiled",
              "torch.compile (inductor): recompiles, vs eager", 100),
    CheckSpec("ddp", "gradaccum.bench.gpu.ddp",
              "DDP over gloo, 2 processes on one GPU", 55),
    CheckSpec("contrastive", "gradaccum.bench.gpu.contrastive",
              "backward_cached: CLIP-sized two-tower, bf16, vs the full batch", 40),
    CheckSpec("contrastive_tiled", "gradaccum.bench.gpu.contrastive_tiled",
              "tiled CLIP loss: 1,048,576 pairs through backward_cached, bf16", 150),
)


def _read(path: Path) -> dict[str, object]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


@functools.cache
def _processes(device: str) -> Any:
    """How each check's process starts: forked from a server that has imported torch once, if a
    child forked there can use ``device``; else ``spawn`` (a fresh interpreter per check)."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    probe = forkserver.Process(target=probe_device, args=(device,), name="gpu-check-probe")
    probe.start()
    probe.join(120)
    if probe.exitcode == 0:
        return forkserver
    if probe.is_alive():
        probe.kill()
        probe.join()
    print(f"gpu check: a forked child cannot use {device} (exit {probe.exitcode}): spawning instead",
          file=sys.stderr)
    return multiprocessing.get_context("spawn")


def _kill(proc: Any) -> None:
    """Kill a check's process and its session (DDP's rank processes)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet its own session leader
        proc.kill()
    proc.join()


def run_check(spec: CheckSpec, out: Path, device: str, budget_s: float) -> Row:
    """Run one check in a child process, killed (with its session) after ``budget_s``.

    Returns:
        Its :class:`Row`: done, timeout or crashed, with whatever raw numbers it wrote.
    """
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result, log_path = logs / f"{spec.name}.json", logs / f"{spec.name}.log"
    result.unlink(missing_ok=True)
    processes = _processes(device)  # the first call starts the fork server: not the check's time
    start = time.time()
    deadline = start + max(1.0, budget_s - MARGIN_S)
    proc = processes.Process(
        target=child_main, name=f"gpu-check-{spec.name}",
        args=(spec.module, str(result), device, deadline, spec.env, str(log_path), list(sys.path)))
    proc.start()
    proc.join(budget_s)
    rc = proc.exitcode
    if proc.is_alive():
        _kill(proc)
        rc = None
    got = _read(result)
    raw = got.get("raw")
    row = Row(spec.name, spec.title, "crashed", smoke=device != "cuda", budget_s=budget_s,
              seconds=round(time.time() - start, 1), log=str(log_path),
              raw=raw if isinstance(raw, dict) else {})
    if rc is None:
        row.status = "timeout"
    elif rc == 0 and got.get("status") == "done":
        row.status = "done"
        row.measured, row.target = str(got.get("measured", "")), str(got.get("target", ""))
        met = got.get("met")
        row.met = met if isinstance(met, bool) else None
    else:
        row.error = str(got.get("error") or f"exit status {rc}")
    return row


def run_checks(specs: Sequence[CheckSpec], out: Path, device: str,
               log: Callable[[str], None] = print) -> list[Row]:
    """Run ``specs`` one after the other; a smoke run gives each :data:`SMOKE_BUDGET_S`."""
    rows = []
    for spec in specs:
        budget = spec.budget_s if device == "cuda" else SMOKE_BUDGET_S
        log(f"gpu check {spec.name}: running (time box {budget:.0f} s)")
        row = run_check(spec, out, device, budget)
        log(f"gpu check {spec.name}: {row.status} in {row.seconds:.1f} s"
            + (f": {row.error}; log: {row.log}" if row.status == "crashed" else ""))
        if row.status == "crashed":
            tail = Path(row.log).read_text(errors="replace").splitlines()[-25:]
            log("\n".join(f"    {line}" for line in tail))
        rows.append(row)
    return rows


def _select(only: str | None) -> list[CheckSpec]:
    if not only:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {c.name: c for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--only {only!r}: unknown check(s) {unknown}; the checks are {list(known)}")
    return [known[n] for n in names]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks, print the table, write the report; the exit status is described above."""
    p = argparse.ArgumentParser(prog="python -m gradaccum.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="report folder")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke even where CUDA is present")
    p.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    args = p.parse_args(argv)
    try:
        specs = _select(args.only)
    except ValueError as error:
        print(f"gpu check: error: {error}", file=sys.stderr)
        return 2
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    mode = "cuda" if device == "cuda" else "no CUDA: CPU smoke (tiny sizes; checks the code, not a GPU)"
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows = run_checks(specs, args.out, device)
    machine = {**describe_machine(), "device": device,
               "check_threads": "1 (smoke)" if device == "cpu" else "torch's default",
               "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    print(write_report(args.out, rows, machine, mode, time.time() - start))
    print(f"written: {args.out / 'report.md'}, {args.out / 'report.json'}")
    return exit_status(rows)
