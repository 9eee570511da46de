"""Contrastive batches of any size: the dense CLIP loss (0.3.0's ``loss_fn``) against the tiled one
(:func:`gradaccum.contrastive.clip_loss`) through ``backward_cached``, as the batch grows.

A tiny two-tower model (:mod:`gradaccum.bench.contrastive_scale`: MLPs to ``d = 64``, normalized
features, OpenCLIP's learnable ``logit_scale``), float32, chunks of 1,024 pairs. Each part runs in
fresh processes, which this script starts:

* ``points``: peak memory growth and time of one step, one fresh process per method and batch
  size; the dense loss only where its estimate (four ``B x B`` float32 matrices) stays under
  ``--dense-limit-gib``. Peak growth: ``ru_maxrss`` after the step minus before it, after a
  warm-up step on two small chunks.
* ``time_ratios``: at ``--time-pairs``, the two methods in interleaved rounds in one process (a
  warm-up round, then ``--repeats``); the median over rounds of tiled's time over dense's.
* ``exact``: float64 copies, the gradient (``logit_scale`` included) of the tiled loss through
  ``backward_cached`` in chunks of 1,024 and in one chunk, against one forward and backward of the
  whole batch with the dense loss: the largest absolute difference.
* ``ranks``: the same step under DDP on 1 and 2 gloo ranks (1 thread each), the global batch
  shared out: per rank, its time, peak growth and the loss's multiply-adds (``4 x rows x B x d``
  for the tiled loss, each rank its share of the rows; ``3 x B x B x d`` for the dense loss, every
  rank all of them); and the float64 difference from one process at ``--rank-exact-pairs`` on
  1, 2 and 4 ranks.

    python benchmarks/contrastive_scale.py [--pairs 4096 8192 ... 262144] [--threads 1]
        [--dense-limit-gib 12] [--time-pairs 8192 16384] [--repeats 5] [--exact-pairs 4096 8192]
        [--rank-pairs 8192 32768] [--rank-exact-pairs 4096]
        [--json docs/results/contrastive_scale.json] [--figure docs/contrastive_scale.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gradaccum.bench.contrastive_scale import (
    METHODS,
    ScaleSizes,
    TinyTowers,
    cached_step,
    dense_estimate,
    pair_features,
    peak_growth,
)
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import interleaved, step_grads
from gradaccum.bench.results_file import write_results
from gradaccum.bench.towers import clip_loss as dense_clip
from gradaccum.torch.check.spawn import free_port

MIB, GIB = 2**20, 2**30
SIZES = ScaleSizes()
CPU = torch.device("cpu")
TAG = "RESULT "


# ------------------------------------------------------------------------------ child processes
def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyTowers:
    torch.manual_seed(seed)
    return TinyTowers(SIZES).to(dtype)


def _warm_up(method: str, model: TinyTowers, wrapped: Any = None) -> None:
    small = pair_features(2 * min(SIZES.chunk, 256), SIZES, seed=99, dtype=next(model.parameters()).dtype)
    cached_step(method, model, small, min(SIZES.chunk, 256), wrapped=wrapped)()


def point(method: str, pairs: int) -> dict[str, Any]:
    """One step at ``pairs`` in this (fresh) process: peak growth and seconds."""
    model = _model()
    _warm_up(method, model)
    step = cached_step(method, model, pair_features(pairs, SIZES), SIZES.chunk)
    gc.collect()
    growth, seconds = peak_growth(step, CPU)
    return {"method": method, "pairs": pairs, "peak_growth_bytes": growth, "peak_growth_mib": growth / MIB,
            "seconds": seconds, "us_per_pair": 1e6 * seconds / pairs}


def interleave(pairs: int, repeats: int) -> dict[str, Any]:
    """Both methods in interleaved rounds on one model and batch: tiled's time over dense's."""
    model = _model()
    batch = pair_features(pairs, SIZES)
    timings = interleaved({m: cached_step(m, model, batch, SIZES.chunk) for m in METHODS}, repeats, calls=1)
    ratios = [t / d for t, d in zip(timings.samples["tiled"], timings.samples["dense"], strict=True)]
    q1, q3 = timings.paired_quartiles("tiled", "dense")
    return {"pairs": pairs, "rounds": repeats, "dense_seconds": timings.median("dense"),
            "tiled_seconds": timings.median("tiled"), "tiled_vs_dense": statistics.median(ratios),
            "tiled_vs_dense_q1": q1, "tiled_vs_dense_q3": q3}


def exact(pairs: int) -> dict[str, Any]:
    """float64: the tiled loss through backward_cached (chunked, unchunked) against the full batch."""
    model = _model(dtype=torch.float64)
    batch = pair_features(pairs, SIZES, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    dense_clip(*model(*batch), model.logit_scale.exp()).backward()
    want = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"pairs": pairs, "largest_grad": max(float(g.abs().max()) for g in want)}
    for name, chunk in (("chunked", SIZES.chunk), ("unchunked", pairs)):
        got = step_grads(model, cached_step("tiled", model, batch, chunk))
        out[f"{name}_max_abs_diff"] = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    return out


def rank(method: str, pairs: int) -> dict[str, Any] | None:
    """Under the torchrun environment: this rank's share of one step (``method`` ``exact``: the
    float64 difference from one process). Rank 0 returns every rank's figures, the others None."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo")
    me = dist.get_rank() if world > 1 else 0
    dtype = torch.float64 if method == "exact" else torch.float32
    model = _model(dtype=dtype)
    wrapped = DDP(model) if world > 1 else None
    batch = pair_features(pairs, SIZES, dtype=dtype)
    lo, hi = pairs * me // world, pairs * (me + 1) // world
    mine = (batch[0][lo:hi], batch[1][lo:hi])
    chunk = -(-(hi - lo) // 2) if method == "exact" else SIZES.chunk
    if method == "exact":
        step = cached_step("tiled", model, mine, chunk, wrapped=wrapped)
        got = step_grads(model, step)
        reference = _model(dtype=dtype)
        dense_clip(*reference(*batch), reference.logit_scale.exp()).backward()
        want = [p.grad for p in reference.parameters()]
        figures: dict[str, Any] = {"max_abs_diff": max(float((g - w).abs().max())  # type: ignore[operator]
                                                       for g, w in zip(got, want, strict=True))}
    else:
        _warm_up(method, model, wrapped)
        step = cached_step(method, model, mine, chunk, wrapped=wrapped)
        gc.collect()
        if world > 1:
            dist.barrier()
        growth, seconds = peak_growth(step, CPU)
        rows = hi - lo if method == "tiled" else pairs
        figures = {"peak_growth_bytes": growth, "peak_growth_mib": growth / MIB, "seconds": seconds,
                   "loss_macs": (4 if method == "tiled" else 3) * rows * pairs * SIZES.dim}
    everyone = [figures]
    if world > 1:
        everyone = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(everyone, figures)
        dist.barrier()
        dist.destroy_process_group()
    return {"method": method, "pairs": pairs, "world": world, "ranks": everyone} if me == 0 else None


def child(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec["threads"])
    kind = spec["kind"]
    if kind == "point":
        result: dict[str, Any] | None = point(spec["method"], spec["pairs"])
    elif kind == "interleave":
        result = interleave(spec["pairs"], spec["repeats"])
    elif kind == "exact":
        result = exact(spec["pairs"])
    else:
        result = rank(spec["method"], spec["pairs"])
    if result is not None:
        print(TAG + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------ the parent
def launch(spec: dict[str, Any], world: int = 0) -> dict[str, Any]:
    """Run ``spec`` in a fresh process (``world`` > 0: as that many gloo ranks); its result."""
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    if not world:
        out = subprocess.run(command, env=env, capture_output=True, text=True)
        outputs = [out]
    else:
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
                "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
        streams = [p.communicate() for p in procs]  # (reads each pipe to its end: no rank blocks on it)
        outputs = [subprocess.CompletedProcess(p.args, p.returncode, *out)
                   for p, out in zip(procs, streams, strict=True)]
    for out in outputs:
        if out.returncode:
            raise SystemExit(f"{spec} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [line for line in outputs[0].stdout.splitlines() if line.startswith(TAG)]
    return dict(json.loads(lines[-1][len(TAG):]))


def goals(points: list[dict[str, Any]], ratios: list[dict[str, Any]], exacts: list[dict[str, Any]],
          ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, from what was measured."""
    tiled = {p["pairs"]: p for p in points if p["method"] == "tiled" and "peak_growth_bytes" in p}
    out = []
    if 262144 in tiled:
        g = tiled[262144]["peak_growth_bytes"]
        out.append({"goal": "tiled at 262,144 pairs: completes, peak growth <= 2 GiB",
                    "value": g / GIB, "met": g <= 2 * GIB})
    if 262144 in tiled and 16384 in tiled:
        rise = tiled[262144]["peak_growth_bytes"] / tiled[16384]["peak_growth_bytes"]
        out.append({"goal": "peak growth from 16,384 to 262,144 pairs rises at most 20x", "value": rise,
                    "met": rise <= 20})
    for r in ratios:
        out.append({"goal": f"tiled time <= 1.3x dense at {r['pairs']:,} pairs", "value": r["tiled_vs_dense"],
                    "met": r["tiled_vs_dense"] <= 1.3})
    diffs = [e[k] for e in exacts for k in ("chunked_max_abs_diff", "unchunked_max_abs_diff")]
    diffs += [x["max_abs_diff"] for r in ranks if r["method"] == "exact" for x in r["ranks"]]
    if diffs:
        out.append({"goal": "float64 within 1e-12 of the dense full batch (1, 2, 4 ranks)",
                    "value": max(diffs), "met": max(diffs) <= 1e-12})
    return out


def figure(points: list[dict[str, Any]], path: Path) -> None:
    """Log-log: peak growth against the batch, both methods, and the dense estimate beyond."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, style in (("dense", "o-"), ("tiled", "s-")):
        done = [p for p in points if p["method"] == method and "peak_growth_bytes" in p]
        ax.plot([p["pairs"] for p in done], [p["peak_growth_bytes"] / MIB for p in done], style,
                label=f"{method} (measured)")
    every = sorted({p["pairs"] for p in points})
    ax.plot(every, [dense_estimate(b) / MIB for b in every], ":", color="C0",
            label="dense: four B x B float32 matrices")
    ax.set(xscale="log", yscale="log", xlabel="pairs B", ylabel="peak growth over one step (MiB)",
           title="backward_cached, CLIP loss, d = 64, chunks of 1,024")
    ax.set_xticks(every, [f"{b // 1024}k" for b in every])
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, nargs="+", default=[2**k for k in range(12, 19)])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dense-limit-gib", type=float, default=12.0)
    parser.add_argument("--time-pairs", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--exact-pairs", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--rank-pairs", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--rank-exact-pairs", type=int, nargs="*", default=[4096])
    parser.add_argument("--json", type=Path, default=None, help="docs/results/contrastive_scale.json")
    parser.add_argument("--figure", type=Path, default=None, help="docs/contrastive_scale.png")
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return {}
    machine = describe_machine() | {"torch_threads": str(args.threads)}
    for key, value in machine.items():
        print(f"{key:>14}: {value}")
    base = {"threads": args.threads}
    points = []
    print("\n| pairs | method | peak growth (MiB) | seconds |\n|---|---|---|---|", flush=True)
    for pairs in args.pairs:
        for method in METHODS:
            if method == "dense" and dense_estimate(pairs) > args.dense_limit_gib * GIB:
                points.append({"method": method, "pairs": pairs, "skipped": "estimate over the limit",
                               "estimate_bytes": dense_estimate(pairs)})
                print(f"| {pairs:,} | dense | (estimate {dense_estimate(pairs) / MIB:,.0f}: skipped) | |")
                continue
            p = launch({**base, "kind": "point", "method": method, "pairs": pairs})
            points.append(p)
            print(f"| {pairs:,} | {method} | {p['peak_growth_mib']:,.1f} | {p['seconds']:.2f} |", flush=True)
    ratios = [launch({**base, "kind": "interleave", "pairs": b, "repeats": args.repeats})
              for b in args.time_pairs]
    for r in ratios:
        print(f"time at {r['pairs']:,}: tiled {r['tiled_seconds']:.2f} s, dense {r['dense_seconds']:.2f} s, "
              f"tiled / dense {r['tiled_vs_dense']:.2f} [{r['tiled_vs_dense_q1']:.2f}, "
              f"{r['tiled_vs_dense_q3']:.2f}]", flush=True)
    exacts = [launch({**base, "kind": "exact", "pairs": b}) for b in args.exact_pairs]
    for e in exacts:
        print(f"exact at {e['pairs']:,}: chunked {e['chunked_max_abs_diff']:.1e}, unchunked "
              f"{e['unchunked_max_abs_diff']:.1e} (largest gradient {e['largest_grad']:.2g})", flush=True)
    ranks = []
    for pairs in args.rank_pairs:
        for method in METHODS:
            if method == "dense" and dense_estimate(pairs) * 2 > args.dense_limit_gib * GIB:
                continue
            for world in (1, 2):
                r = launch({"threads": 1, "kind": "rank", "method": method, "pairs": pairs}, world=world)
                ranks.append(r)
                per = r["ranks"][0]
                print(f"{method} at {pairs:,} on {world} rank(s): per rank {per['seconds']:.2f} s, "
                      f"{per['peak_growth_mib']:,.1f} MiB, {per['loss_macs']:.3g} loss multiply-adds",
                      flush=True)
    for pairs in args.rank_exact_pairs:
        for world in (1, 2, 4):
            r = launch({"threads": 1, "kind": "rank", "method": "exact", "pairs": pairs}, world=world)
            ranks.append(r)
            print(f"exact at {pairs:,} on {world} rank(s): "
                  f"{max(x['max_abs_diff'] for x in r['ranks']):.1e}", flush=True)
    met = goals(points, ratios, exacts, ranks)
    for g in met:
        print(f"goal: {g['goal']}: {g['value']:.3g} ({'met' if g['met'] else 'NOT met'})")
    command = ["python", "benchmarks/contrastive_scale.py", *(sys.argv[1:] if argv is None else argv)]
    results = {"machine": machine, "command": " ".join(command),
               "settings": {k: v for k, v in vars(args).items() if k not in ("json", "figure", "child")},
               "sizes": dataclasses.asdict(SIZES), "points": points, "time_ratios": ratios, "exact": exacts,
               "ranks": ranks, "goals": met}
    if args.json is not None:
        write_results(args.json, results, default=str)
    if args.figure is not None:
        figure(points, args.figure)
    return results


if __name__ == "__main__":
    main()
