"""FSDP2 memory: gradients held between micro-batches, window sync against every-micro-batch sync.

``Accumulator(..., sync="window")`` turns FSDP2's gradient reduction off until the window's last
backward, so each rank holds the *unsharded* sum of the window's gradients (the whole model's
gradient size) between micro-batches; ``sync="micro_batch"`` reduce-scatters every backward and
holds only this rank's shard (1/world of it). Each mode runs in fresh processes (2 gloo ranks,
CPU) and reports, per rank, the largest number of gradient bytes alive after a mid-window
backward (counted from FSDP2's gradient tensors: the sharded ``.grad`` DTensors' local shards and
FSDP2's internal unsharded gradients) and the growth of peak RSS from before the first backward
to the end.

Usage:
    python benchmarks/fsdp_memory.py                       # MLP 4x2048, steps 4
    python benchmarks/fsdp_memory.py --width 256 --depth 2  # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.torch.check.spawn import free_port

MODES = ("window", "micro_batch")
MIB = 2**20


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def grad_bytes(model: Any) -> int:
    """Bytes of every gradient tensor FSDP2 holds for ``model`` on this rank right now."""
    total = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
    for state in model._get_fsdp_state()._state_ctx.all_states:  # FSDP2 internals, measuring only
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                pending = [getattr(fp, "_unsharded_param", None), fp.unsharded_accumulated_grad]
                grads = [pending[0].grad if pending[0] is not None else None, pending[1]]
                total += sum(g.nbytes for g in grads if g is not None)
    return int(total)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(rank: int, args: argparse.Namespace, mode: str, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timedelta(minutes=5))
    model = build(args.width, args.depth)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=1e-3), args.steps, model=model,
                                sync=mode)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.micro_batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.micro_batch,), generator=g)
    with torch.no_grad():
        model(x)  # lazy init and the forward's own buffers, before the baseline
    base, held = peak_rss_mib(), 0
    for _ in range(args.windows * args.steps):
        if not acc.backward(nn.functional.cross_entropy(model(x), y)):
            held = max(held, grad_bytes(model))
    params = sum(p.numel() for p in model.parameters())
    out.put((rank, held, peak_rss_mib() - base, params))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=4, help="micro-batches per window (default 4)")
    p.add_argument("--windows", type=int, default=2, help="windows per mode (default 2)")
    p.add_argument("--width", type=int, default=2048, help="MLP width (default 2048)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the table and the machine here")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for mode in MODES:
        port = free_port()
        out = ctx.SimpleQueue()
        mp.spawn(worker, args=(args, mode, port, out), nprocs=args.world)
        got = sorted(out.get() for _ in range(args.world))
        rows.append((mode, max(r[1] for r in got), max(r[2] for r in got), got[0][3]))
    machine = describe_machine()
    for key, value in machine.items():
        print(f"{key:>14}: {value}")
    params = rows[0][3]
    print(f"{'setup':>14}: FSDP2 fully_shard per Linear + root, gloo, {args.world} processes, steps "
          f"{args.steps}, MLP {args.depth}x{args.width} ({params / 1e6:.2f} M params, fp32 = "
          f"{params * 4 / MIB:.1f} MiB of gradients unsharded)")
    print()
    print("| sync | gradient MiB held mid-window, per rank | peak RSS growth MiB, per rank (max) |")
    print("|---|---|---|")
    for mode, held, rss, _ in rows:
        print(f"| {mode} | {held / MIB:.1f} | {rss:.1f} |")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({
            "machine": machine, "settings": settings, "params_millions": params / 1e6,
            "unsharded_grad_mib": params * 4 / MIB,
            "rows": {mode: {"held_mib": held / MIB, "peak_rss_growth_mib": rss}
                     for mode, held, rss, _ in rows},
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
