"""The memory a window's later ``backward_cached`` call adds over its first: the set-aside.

0.3.0 set the window's gradients aside during a call and built the call's own gradient from
zero, adding the two before the last chunk: from the window's second call on, two parameter-sized
gradient sets were alive at once. Now the call adds into ``.grad`` in place.

One two-tower model of about 16.8 M parameters (:class:`gradaccum.bench.towers.TwoTowers`: two
pre-norm transformers of width 384, 5 and 4 layers, OpenCLIP's loss with a learnable
``logit_scale``), float32, on the CPU; batches of ``--pairs`` pairs in chunks of ``--chunk``;
one Accumulator with ``steps=3`` and SGD, so that neither measured call closes the window.

Method: the allocator's tensor memory from the PyTorch profiler's memory events
(:func:`gradaccum.bench.measure.allocator_memory`: one event per allocation and per free, their
running sum). Call 1 is profiled from the window's start: its peak ``P1`` and what it leaves
held, ``E1`` (its gradients). Call 2 is profiled from there: its peak over that start, ``P2``.
Both peaks relative to the window's start: ``P1`` and ``E1 + P2``; the difference over the
parameters' bytes is the set-aside. The median over ``--rounds`` windows, after one warm-up
window.

    python benchmarks/cached_set_aside.py [--pairs 64] [--chunk 16] [--rounds 3] [--threads 1]
                                          [--label now] [--json docs/results/cached_set_aside.json]

``docs/results/cached_set_aside_0.3.0.json`` is the same script run against 0.3.0's library, the
commit before the set-aside was removed (its ``src`` exported with ``git archive``, put first on
``PYTHONPATH``), ``--label 0.3.0``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch

from gradaccum import Accumulator, chunks
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import allocator_memory
from gradaccum.bench.results_file import write_results
from gradaccum.bench.towers import TOWERS_BENCH, TwoTowers, clip_loss, pair_batch

MIB = 2**20
SIZES = dataclasses.replace(TOWERS_BENCH, vision_width=384, text_width=384, vision_layers=5, text_layers=4,
                            vocab=1700, embed=128)
CPU = torch.device("cpu")


def one_window(model: TwoTowers, acc: Accumulator, parts: list[Any]) -> tuple[int, int, int]:
    """Feed one window of three calls; return call 1's peak and end and call 2's peak (bytes)."""

    def encode(chunk: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        image_features, text_features, _ = model(*chunk)
        return image_features, text_features

    def loss_fn(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        return clip_loss(image_features, text_features, model.logit_scale.exp())

    def call() -> None:
        acc.backward_cached(encode, loss_fn, parts)

    _, first = allocator_memory(call, CPU)
    _, second = allocator_memory(call, CPU)
    call()  # the window's last: it steps (lr 0) and clears
    assert acc.micro_step == 0
    return first.peak, first.end, second.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="now", help="which library ran (recorded in the JSON)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TwoTowers(SIZES)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.0), 3, model=model)
    parts = chunks(pair_batch(SIZES, args.pairs), args.chunk)
    one_window(model, acc, parts)  # warm-up
    rounds = [one_window(model, acc, parts) for _ in range(args.rounds)]
    first = statistics.median(r[0] for r in rounds)
    second = statistics.median(r[1] + r[2] for r in rounds)
    over = statistics.median(r[1] + r[2] - r[0] for r in rounds)
    machine = describe_machine()
    print(f"machine: {machine['cpu']} ({machine['cpu_count']} CPUs); torch {machine['torch']}; "
          f"gradaccum {machine['gradaccum']} ({args.label}); threads: {args.threads}")
    print(f"model: {params:,} parameters ({param_bytes / MIB:.1f} MiB float32); {args.pairs} pairs in "
          f"chunks of {args.chunk}; median of {args.rounds} windows\n")
    print("| call of the window | peak over the window's start (MiB) |")
    print("|---|---|")
    print(f"| first | {first / MIB:.1f} |")
    print(f"| second | {second / MIB:.1f} |")
    print(f"\nsecond over first: {over / MIB:+.1f} MiB = {over / param_bytes:+.3f}x the parameters' bytes")
    if args.json is not None:
        write_results(args.json, {
            "machine": machine, "label": args.label,
            "settings": {"pairs": args.pairs, "chunk": args.chunk, "rounds": args.rounds,
                         "threads": args.threads, "sizes": dataclasses.asdict(SIZES)},
            "parameters": params, "parameter_mib": param_bytes / MIB,
            "first_call_peak_mib": first / MIB, "second_call_peak_mib": second / MIB,
            "second_over_first_mib": over / MIB, "second_over_first_vs_parameters": over / param_bytes,
            "rounds": [{"first_peak": a, "first_end": b, "second_peak": c} for a, b, c in rounds]})


if __name__ == "__main__":
    main()
