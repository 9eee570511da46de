"""Contrastive losses over chunks: the full batch, naive accumulation, ``backward_cached`` and
sentence-transformers' ``CachedMultipleNegativesRankingLoss``: exactness, memory and time.

Two models, each with one batch cut into 1, 4 and 16 chunks (``--chunks``):

* ``clip``: a CLIP-shaped two-tower model (:mod:`gradaccum.bench.towers`: two small transformers,
  OpenCLIP's loss with its learnable ``logit_scale``): encoder-dominated, as CLIP is;
* ``mnrl``: a small BERT under sentence-transformers (:mod:`gradaccum.bench.sentence`, built from a
  config, no download) with in-batch negatives (``MultipleNegativesRankingLoss``), where
  sentence-transformers' own cached loss applies. Texts have one length, so that its trimming of
  padding per mini-batch does not change the work.

For each method and number of chunks, one optimizer step of the batch (SGD with lr 0, through an
Accumulator, so the model does not move):

* ``max_abs_grad_diff``: the largest absolute difference of the gradient the optimizer sees from
  the full batch's, computed on float64 copies (the full batch's own row is 0);
* ``saved_activations_bytes``: the most bytes autograd holds for backward at once (distinct
  storages, parameters excluded: :func:`gradaccum.bench.measure.saved_activations`);
* ``allocator_peak_bytes``: the allocator's peak during the step, above what was allocated before it
  (profiler memory events on the CPU, ``max_memory_allocated`` on CUDA);
* ``seconds_per_step``: the median of ``--repeats`` interleaved rounds (after a warm-up round), each
  running every method once in rotating order; ``time_vs_naive``: the median over rounds of the
  method's time over naive accumulation's of the same chunks in the same round (quartiles in
  ``time_vs_naive_q1``/``_q3``); on ``mnrl``, ``time_vs_sentence_transformers`` likewise (and
  its quartiles).

    python benchmarks/contrastive.py [--chunks 1 4 16] [--repeats 9] [--threads 1] [--device cpu]
                                     [--models clip mnrl] [--json docs/results/contrastive.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import Timings, allocator_memory, device_sync, interleaved, saved_activations
from gradaccum.bench.results_file import write_results
from gradaccum.bench.sentence import BERT_BENCH, mnrl_contenders, sentence_model, sentence_pairs, write_bert
from gradaccum.bench.towers import TOWERS_BENCH, TwoTowers, contenders, pair_batch

MIB = 2**20
WORDS = 24  # per text: one length, so that sentence-transformers' padding trim changes nothing
Contenders = Callable[[torch.nn.Module, int], dict[str, Callable[[], None]]]


class Model:
    """One benchmarked model: how to copy it and its batch, and its contenders for ``pieces`` chunks."""

    def __init__(self, name: str, model: torch.nn.Module, make: Contenders, pairs: int) -> None:
        self.name, self.model, self.make, self.pairs = name, model, make, pairs

    def copy(self, dtype: torch.dtype) -> torch.nn.Module:
        return copy.deepcopy(self.model).to(dtype)


def clip_model(pairs: int, device: torch.device) -> Model:
    torch.manual_seed(0)
    model = TwoTowers(TOWERS_BENCH).to(device)
    images, texts = pair_batch(TOWERS_BENCH, pairs, device)

    def make(m: torch.nn.Module, pieces: int) -> dict[str, Callable[[], None]]:
        dtype = next(m.parameters()).dtype
        return contenders(m, (images.to(dtype), texts), pieces)

    return Model("clip", model, make, pairs)


def mnrl_model(pairs: int, folder: Path) -> Model:
    model = sentence_model(write_bert(folder, BERT_BENCH))
    anchors, positives = sentence_pairs(pairs, BERT_BENCH, length=WORDS)
    return Model("mnrl", model, lambda m, pieces: mnrl_contenders(m, anchors, positives, pieces), pairs)


def step_grads(model: torch.nn.Module, fn: Callable[[], None]) -> list[torch.Tensor | None]:
    """The gradients the optimizer sees at the step ``fn`` takes."""
    seen: list[list[torch.Tensor | None]] = []
    params = list(model.parameters())
    handle = register_optimizer_step_pre_hook(
        lambda *_: seen.append([None if p.grad is None else p.grad.clone() for p in params]))
    try:
        fn()
    finally:
        handle.remove()
    assert len(seen) == 1, f"expected one optimizer step, got {len(seen)}"
    return seen[0]


def largest_difference(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is not None or y is not None:
            assert x is not None and y is not None
            worst = max(worst, float((x - y).abs().max()))
    return worst


def exactness(bench: Model, pieces: int) -> tuple[dict[str, float], float]:
    """Each method's max abs gradient difference from the full batch (float64), and the largest
    gradient element of the full batch."""
    grads = {}
    for name in bench.make(bench.copy(torch.float64), pieces):
        model = bench.copy(torch.float64)  # a fresh copy per method: each sees the same weights
        grads[name] = step_grads(model, bench.make(model, pieces)[name])
    full = grads["full batch"]
    largest = max(float(g.abs().max()) for g in full if g is not None)
    return {name: largest_difference(g, full) for name, g in grads.items()}, largest


def memory(bench: Model, pieces: int, device: torch.device) -> dict[str, tuple[int, int]]:
    """Each method's (saved activations peak, allocator peak) in bytes, after a warm-up step."""
    out = {}
    model = bench.copy(torch.float32)
    fns = bench.make(model, pieces)
    for name, fn in fns.items():
        fn()  # warm-up: lazy state (the optimizer's, the tokenizer's caches) is not the step's
        _, held = saved_activations(fn, model.parameters())
        _, mem = allocator_memory(fn, device)
        out[name] = (held, mem.peak)
    return out


def measure(bench: Model, chunk_counts: Sequence[int], repeats: int, device: torch.device,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for pieces in chunk_counts:
        diffs, largest = exactness(bench, pieces)
        mem = memory(bench, pieces, device)
        model = bench.copy(torch.float32)
        timings = interleaved(bench.make(model, pieces), repeats, calls=1, sync=device_sync(device))
        for name in diffs:
            held, peak = mem[name]
            rows.append({
                "model": bench.name, "pairs": bench.pairs, "chunks": pieces,
                "chunk_pairs": -(-bench.pairs // pieces), "method": name,
                "max_abs_grad_diff": diffs[name], "largest_grad": largest,
                "saved_activations_bytes": held, "saved_activations_mib": held / MIB,
                "allocator_peak_bytes": peak, "allocator_peak_mib": peak / MIB,
                "seconds_per_step": timings.median(name),
                "time_vs_naive": paired_median(timings, name, "naive"),
            })
            q1, q3 = timings.paired_quartiles(name, "naive")
            rows[-1] |= {"time_vs_naive_q1": q1, "time_vs_naive_q3": q3}
            st = "sentence-transformers cached"
            if st in timings.samples:
                q1, q3 = timings.paired_quartiles(name, st)
                rows[-1] |= {"time_vs_sentence_transformers": paired_median(timings, name, st),
                             "time_vs_sentence_transformers_q1": q1, "time_vs_sentence_transformers_q3": q3}
            log(table_row(rows[-1]))
    return rows


def paired_median(timings: Timings, name: str, base: str) -> float:
    """The median over rounds of ``name``'s time over ``base``'s in the same round: a change of
    load on a shared machine between rounds hits both."""
    return statistics.median(a / b for a, b in zip(timings.samples[name], timings.samples[base], strict=True))


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two goals, per number of chunks: ``backward_cached`` at most 1.5x naive
    accumulation on the encoder-dominated model, and no slower than sentence-transformers'."""
    out = []
    by = {(r["model"], r["chunks"], r["method"]): r for r in rows}
    for (model, pieces, method), row in by.items():
        if method != "backward_cached" or pieces == 1:
            continue
        if model == "clip":
            ratio = row["time_vs_naive"]
            out.append({"goal": "clip: backward_cached / naive <= 1.5", "chunks": pieces,
                        "ratio": ratio, "met": ratio <= 1.5})
        if "time_vs_sentence_transformers" in row:
            ratio = row["time_vs_sentence_transformers"]
            out.append({"goal": f"{model}: backward_cached / sentence-transformers cached <= 1",
                        "chunks": pieces, "ratio": ratio, "met": ratio <= 1.0})
    return out


HEAD = ("| model | chunks | method | max abs grad diff | saved activations (MiB) | allocator peak (MiB) "
        "| time / naive |")


def table_row(r: dict[str, Any]) -> str:
    return (f"| {r['model']} | {r['chunks']} | {r['method']} | {r['max_abs_grad_diff']:.1e} | "
            f"{r['saved_activations_mib']:.1f} | {r['allocator_peak_mib']:.1f} | {r['time_vs_naive']:.2f} |")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--models", nargs="+", default=["clip", "mnrl"], choices=["clip", "mnrl"])
    parser.add_argument("--clip-pairs", type=int, default=256)
    parser.add_argument("--mnrl-pairs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every number (docs/results/contrastive.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = describe_machine()
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "sentence-transformers")}
    for key, value in {**machine, **versions}.items():
        print(f"{key:>21}: {value}")
    print(f"\n{HEAD}\n|---|---|---|---|---|---|---|", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            if name == "clip":
                bench = clip_model(args.clip_pairs, device)
            else:
                if device.type != "cpu":
                    raise SystemExit("--models mnrl runs on the CPU only (sentence_model)")
                bench = mnrl_model(args.mnrl_pairs, Path(folder) / "bert")
            rows += measure(bench, args.chunks, args.repeats, device, lambda s: print(s, flush=True))
    met = goals(rows)
    print()
    for g in met:
        verdict = "met" if g["met"] else "NOT met"
        print(f"goal {g['goal']} at {g['chunks']} chunks: {g['ratio']:.2f} ({verdict})")
    command = ["python", *sys.argv] if argv is None else ["python", "benchmarks/contrastive.py", *argv]
    results = {"machine": machine, "command": " ".join(command),
               "settings": {k: v for k, v in vars(args).items() if k != "json"}, "versions": versions,
               "models": {"clip": dataclasses.asdict(TOWERS_BENCH),
                          "mnrl": {**dataclasses.asdict(BERT_BENCH), "words_per_text": WORDS}},
               "rows": rows,
               "goals": met}
    if args.json is not None:
        write_results(args.json, results, default=str)
    return results


if __name__ == "__main__":
    main()
