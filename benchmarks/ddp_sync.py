"""DDP on gloo: one gradient sync per window against syncing every micro-batch.

Two identical DDP models train side by side in the same processes, one through
``Accumulator(..., sync="window")`` (the default) and one through ``sync="micro_batch"`` (what a
loop that never skips DDP's all-reduce does). Their windows alternate (A B, then B A, ...), each
timed from a barrier to the optimizer step; a DDP comm hook counts the gradient all-reduces and
their payload, and a wrapper around the accumulator's own collective counts its all-reduces (the
window's loss sum, and item total under item weighting). Prints a table: median ms per optimizer
step, all-reduces and payload per step, and the time ratio, under the machine, versions and
thread count; ``--json`` also writes it, with the machine, as a results file.

Usage:
    python benchmarks/ddp_sync.py --json docs/results/ddp_sync.json   # 2 processes, steps 8
    python benchmarks/ddp_sync.py --width 64 --depth 2 --windows 3 --warmup 1   # a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results
from gradaccum.torch.check.spawn import free_port
from gradaccum.torch.distributed.collectives import RankGroups

MODES = ("window", "micro_batch")


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def counted(ddp: DDP) -> dict[str, int]:
    count = {"calls": 0, "bytes": 0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
        count["calls"] += 1
        count["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return count


def count_own(runs: dict[str, Any]) -> None:
    """Count the accumulator's own all-reduces (every one goes through ``RankGroups.all_reduce``)
    into the run whose window is open (``runs["current"]``)."""
    real = RankGroups.all_reduce

    def all_reduce(self: RankGroups, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        own = runs[runs["current"]]["own"]
        own["calls"] += 1
        own["bytes"] += tensor.numel() * tensor.element_size()
        real(self, tensor, op)

    RankGroups.all_reduce = all_reduce  # type: ignore[method-assign]


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timedelta(minutes=5))
    runs: dict[str, Any] = {}
    for mode in MODES:
        ddp = DDP(build(args.width, args.depth))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        runs[mode] = {"ddp": ddp, "count": counted(ddp), "times": [], "calls": [], "bytes": [],
                      "own": {"calls": 0, "bytes": 0}, "own_calls": [], "own_bytes": [],
                      "acc": gradaccum.Accumulator(opt, args.steps, model=ddp, sync=mode)}
    count_own(runs)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.micro_batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.micro_batch,), generator=g)
    for w in range(args.warmup + args.windows):
        for mode in MODES if w % 2 == 0 else MODES[::-1]:
            run, runs["current"] = runs[mode], mode
            calls, sent = run["count"]["calls"], run["count"]["bytes"]
            own_calls, own_sent = run["own"]["calls"], run["own"]["bytes"]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                run["acc"].backward(nn.functional.cross_entropy(run["ddp"](x), y))
            elapsed = time.perf_counter() - start
            if w >= args.warmup:
                run["times"].append(elapsed)
                run["calls"].append(run["count"]["calls"] - calls)
                run["bytes"].append(run["count"]["bytes"] - sent)
                run["own_calls"].append(run["own"]["calls"] - own_calls)
                run["own_bytes"].append(run["own"]["bytes"] - own_sent)
    if rank == 0:
        report(args, runs)
    dist.destroy_process_group()


def report(args: argparse.Namespace, runs: dict[str, Any]) -> None:
    params = sum(p.numel() for p in runs["window"]["ddp"].parameters())
    machine = describe_machine()
    for key, value in machine.items():
        print(f"{key:>14}: {value}")
    setup = (f"gloo, {args.world} processes x {args.threads} thread(s), steps {args.steps}, "
             f"micro-batch {args.micro_batch}, MLP {args.depth}x{args.width} ({params / 1e6:.2f} M "
             f"params, fp32), {args.windows} timed windows per mode after {args.warmup} warm-up, "
             "interleaved")
    print(f"{'setup':>14}: {setup}")
    base = statistics.median(runs["window"]["times"])
    rows = []
    for mode in MODES:
        run = runs[mode]
        med = statistics.median(run["times"])
        rows.append({"sync": mode, "ms_per_step_median": med * 1e3,
                     "grad_all_reduces_per_step": statistics.median(run["calls"]),
                     "payload_mib_per_step": statistics.median(run["bytes"]) / 2**20,
                     "accumulator_all_reduces_per_step": statistics.median(run["own_calls"]),
                     "accumulator_bytes_per_step": statistics.median(run["own_bytes"]),
                     "time_vs_window": med / base})
    print()
    print("| sync | ms / optimizer step (median) | DDP gradient all-reduces / step | payload MiB / step "
          "| accumulator all-reduces / step (bytes) | time vs window |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['sync']} | {row['ms_per_step_median']:.1f} | {row['grad_all_reduces_per_step']:.0f} | "
              f"{row['payload_mib_per_step']:.2f} | {row['accumulator_all_reduces_per_step']:.0f} "
              f"({row['accumulator_bytes_per_step']:.0f}) | {row['time_vs_window']:.2f}x |")
    print("\n(DDP's gradient all-reduces: one per bucket, counted by a comm hook; the accumulator's: "
          "the window's loss sum, and its item total under item weighting)")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        ratios = {"payload": rows[1]["payload_mib_per_step"] / rows[0]["payload_mib_per_step"],
                  "calls": rows[1]["grad_all_reduces_per_step"] / rows[0]["grad_all_reduces_per_step"]}
        write_results(args.json, {"machine": machine, "setup": setup, "settings": settings,
                                  "params_millions": params / 1e6, "rows": rows,
                                  "micro_batch_over_window": ratios}, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=8, help="micro-batches per window (default 8)")
    p.add_argument("--windows", type=int, default=20, help="timed windows per mode (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed windows per mode first (default 3)")
    p.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per micro-batch (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the table and the machine here")
    args = p.parse_args()
    port = free_port()
    mp.spawn(worker, args=(args, port), nprocs=args.world)


if __name__ == "__main__":
    main()
