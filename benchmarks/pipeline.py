"""Pipeline parallelism (2 CPU stages, gloo): gradaccum's backward_pipeline against a correct hand loop,
and torchtitan's two accumulation bugs measured.

Two processes, one stage each (``Schedule1F1B``, summed token losses, padded labels). Part 1 times
windows of the hand loop (``scale_grads=False``, the loss divided by the window's known token
total, the clip norm all-reduced over the stages) against ``Accumulator.backward_pipeline``, and
against the same with the per-call agreement (``TORCH_DISTRIBUTED_DEBUG``), interleaved window by
window (the order rotating, a barrier before each), in ``--rounds`` rounds after warm-up: each
round's medians give one ratio to the hand loop, the table the median ratio and the rounds'
range (the shared machine's load drifts between rounds). It counts every
``all_reduce`` and the aten ops (a TorchDispatchMode) of one window per loop and rank. Part 2 trains
the float64 model of the tests (2 windows of 2 batches x 4 pipeline micro-batches) through the
four loops of :mod:`gradaccum.bench.pipeline`, with clipping that acts and without, and gives
each one's largest parameter difference from one process on the full batch.

Usage:
    python benchmarks/pipeline.py --json docs/results/pipeline.json
    python benchmarks/pipeline.py --windows 5 --rounds 2 --warmup 1   # a quick check
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

from gradaccum.bench.hot_path import OpCounter
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.pipeline import (
    LOOPS,
    PAD,
    PipelineLoop,
    full_model,
    max_diff,
    reference,
    sgd,
    stage_params,
    token_sum,
)
from gradaccum.bench.pipeline import window_batches as batches_of
from gradaccum.bench.results_file import write_results
from gradaccum.torch.check.spawn import free_port

TIMED = ("hand", "gradaccum", "gradaccum checked")
BUG_CLIP = 0.05  # below the reference's gradient norms: clipping acts in every window


def count_all_reduces() -> dict[str, int]:
    """Count every ``dist.all_reduce`` (the hand loop's and the accumulator's) per running loop."""
    counts: dict[str, Any] = {"current": None}
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts[counts["current"]] = counts.get(counts["current"], 0) + 1
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    return counts


def timed(args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds of ``--windows`` windows per loop, after ``--warmup``; within a round the
    loops alternate window by window (the order rotating, a barrier before each)."""
    shape = {"seq": args.seq, "vocab": args.vocab}
    full = full_model(2, torch.float32, hidden=args.hidden, vocab=args.vocab)
    loops = {name: PipelineLoop("hand" if name == "hand" else "gradaccum", full, args.n_mb, args.steps,
                                args.clip) for name in TIMED}
    counts = count_all_reduces()
    rounds: list[dict[str, dict[str, list[float]]]] = []
    reduces: dict[str, list[int]] = {name: [] for name in TIMED}
    total = args.warmup + args.rounds * args.windows
    for w in range(total):
        data = batches_of(w, args.steps, 1, args.batch, **shape)[0]
        order = TIMED[w % 3:] + TIMED[:w % 3]
        timed_window = w >= args.warmup
        if timed_window and (w - args.warmup) % args.windows == 0:
            rounds.append({"times": {name: [] for name in TIMED}, "cpu": {name: [] for name in TIMED}})
        for name in order:
            counts["current"] = name
            before = counts.get(name, 0)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loops[name].window(data)
            elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
            if timed_window:
                rounds[-1]["times"][name].append(elapsed)
                rounds[-1]["cpu"][name].append(used)
                reduces[name].append(counts.get(name, 0) - before)
        if w == 0:
            acc = loops["gradaccum checked"].acc
            assert acc is not None
            acc._sync.every_call = True  # type: ignore[attr-defined]  # what TORCH_DISTRIBUTED_DEBUG sets
    ops = {}
    for name in TIMED:
        data = batches_of(10_000, args.steps, 1, args.batch, **shape)[0]
        dist.barrier()
        with OpCounter() as counter:
            loops[name].window(data)
        ops[name] = counter.count
    return {"rounds": rounds, "all_reduces": reduces, "ops": ops}


def round_figures(ranks: list[dict[str, Any]], name: str) -> list[tuple[float, float, float, float]]:
    """Per round: (ms per window, its ratio to the hand loop) on rank 0, and (CPU ms per window,
    its ratio) of both ranks together; each a median over the round's windows."""
    out = []
    for i in range(len(ranks[0]["rounds"])):
        med = statistics.median(ranks[0]["rounds"][i]["times"][name])
        base = statistics.median(ranks[0]["rounds"][i]["times"]["hand"])
        used = sum(statistics.median(r["rounds"][i]["cpu"][name]) for r in ranks)
        base_cpu = sum(statistics.median(r["rounds"][i]["cpu"]["hand"]) for r in ranks)
        out.append((med * 1e3, med / base, used * 1e3, used / base_cpu))
    return out


def bugs() -> dict[str, dict[str, float]]:
    """Each loop's largest parameter difference from one process (max over the two stages)."""
    out: dict[str, dict[str, float]] = {}
    windows = [batches_of(w, 2, 1, 8) for w in range(2)]
    for clip in (BUG_CLIP, None):
        ref, _ = reference(2, windows, sgd, clip)
        want = stage_params(ref, dist.get_rank(), 2)
        for loop in LOOPS:
            run = PipelineLoop(loop, full_model(2), 4, 2, clip)
            for window in windows:
                run.window(window[0])
            diff = torch.tensor(max_diff([run.mod], want), dtype=torch.float64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            out.setdefault(loop, {})["clip" if clip is not None else "no_clip"] = float(diff)
    full = full_model(2)  # the reference's first-window gradient norm: clipping acts below it
    tokens = torch.cat([t for t, _ in windows[0][0]])
    labels = torch.cat([y for _, y in windows[0][0]])
    (token_sum(full(tokens), labels) / (labels != PAD).sum()).backward()
    out["reference"] = {"grad_norm": float(torch.nn.utils.get_total_norm(
        [p.grad for p in full.parameters() if p.grad is not None])), "clip": BUG_CLIP}
    return out


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    found = bugs()
    measured = timed(args)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        report(args, gathered, found)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, ranks: list[dict[str, Any]], found: dict[str, Any]) -> None:
    machine = describe_machine()
    setup = (f"gloo, 2 processes x {args.threads} thread(s), Schedule1F1B, 2 stages of a token model "
             f"(hidden {args.hidden}, vocab {args.vocab}, float32), batch {args.batch} x {args.seq} tokens, "
             f"{args.n_mb} pipeline micro-batches per step(), {args.steps} step() per window, "
             f"clip_norm {args.clip}, {args.rounds} rounds of {args.windows} timed windows per loop after "
             f"{args.warmup} warm-up, interleaved window by window (order rotating)")
    for key, value in {**machine, "setup": setup}.items():
        print(f"{key:>14}: {value}")
    rows = []
    print(f"\nMedians over {args.rounds} rounds of each round's median; in brackets the rounds' lowest "
          "and highest.")
    print("\n| loop | ms / window (rank 0) | vs hand | CPU ms / window (both ranks) | vs hand "
          "| all-reduces / window | aten ops / window (rank 0, rank 1) | ops vs hand |")
    print("|---|---|---|---|---|---|---|---|")
    for name in TIMED:
        per_round = round_figures(ranks, name)
        ms, ratio, cpu_ms, cpu_ratio = ([f[i] for f in per_round] for i in range(4))
        ops = [r["ops"][name] for r in ranks]
        row = {"loop": name, "ms_per_window": round(statistics.median(ms), 2),
               "time_vs_hand": round(statistics.median(ratio), 3),
               "time_vs_hand_range": [round(min(ratio), 3), round(max(ratio), 3)],
               "cpu_ms_per_window": round(statistics.median(cpu_ms), 2),
               "cpu_vs_hand": round(statistics.median(cpu_ratio), 3),
               "cpu_vs_hand_range": [round(min(cpu_ratio), 3), round(max(cpu_ratio), 3)],
               "rounds": [[round(x, 4) for x in f] for f in per_round],
               "all_reduces_per_window": statistics.median(ranks[0]["all_reduces"][name]),
               "ops_per_window": ops,
               "ops_vs_hand": [o - r["ops"]["hand"] for o, r in zip(ops, ranks, strict=True)]}
        rows.append(row)
        spread = ["", ""] if name == "hand" else [  # the hand loop's ratios are 1 in every round
            " [{:.3f}, {:.3f}]".format(*row[key]) for key in ("time_vs_hand_range", "cpu_vs_hand_range")]
        print(f"| {name} | {row['ms_per_window']:.2f} | {row['time_vs_hand']:.3f}x{spread[0]} | "
              f"{row['cpu_ms_per_window']:.2f} | {row['cpu_vs_hand']:.3f}x{spread[1]} | "
              f"{row['all_reduces_per_window']:g} | {ops[0]}, {ops[1]} | "
              f"{row['ops_vs_hand'][0]:+d}, {row['ops_vs_hand'][1]:+d} |")
    print(f"\nParameter error against one process on the full batch (float64, 2 windows of 2 batches x 4 "
          f"pipeline micro-batches; the reference's gradient norm {found['reference']['grad_norm']:.3f}, "
          f"clip_norm {BUG_CLIP}):\n")
    print("| loop | with clipping | without |")
    print("|---|---|---|")
    for loop in LOOPS:
        print(f"| {loop} | {found[loop]['clip']:.2g} | {found[loop]['no_clip']:.2g} |")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        write_results(args.json, {"source": "python benchmarks/pipeline.py", "machine": machine,
                                  "setup": setup, "settings": settings, "rows": {r["loop"]: r for r in rows},
                                  "bugs": found}, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=30, help="timed windows per loop (default 30)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of --windows windows; each gives a ratio, the table their median and range")
    p.add_argument("--warmup", type=int, default=3, help="untimed windows per loop first (default 3)")
    p.add_argument("--steps", type=int, default=4, help="step() calls per window (default 4)")
    p.add_argument("--n-mb", type=int, default=4, help="pipeline micro-batches per step() (default 4)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step() (default 16)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (default 512)")
    p.add_argument("--clip", type=float, default=1.0, help="clip_norm (default 1.0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the tables and the machine here")
    args = p.parse_args()
    port = free_port()
    mp.spawn(worker, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
