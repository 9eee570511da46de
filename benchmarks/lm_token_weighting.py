"""Token weighting on a small causal LM: the naive ``loss / N`` loop drifts, gradaccum does not.

A nanoGPT-style GPT (``gradaccum.demos.gpt``, byte-level, 253 k parameters) learns Python:
the text is the standard library's own sources (``*.py`` beside ``os.py``), which every machine
with Python has offline. Each optimizer step takes 16 sequences of 8 to 48 bytes, right-padded
(labels -100 at padding); the loss is a Hugging Face causal LM's: the mean cross-entropy over
the *shifted* labels (``logits[:, :-1]`` against ``labels[:, 1:]``). Four runs start from the
same weights, see the same sequences in the same order and take AdamW steps (nanoGPT's betas and
weight decay, gradient clipping at 1.0), interleaved step by step in one process:

* ``full batch``: the 16 sequences at once (the reference);
* ``naive loss / N``: 4 micro-batches of 4, each loss divided by 4 (the seeds', nanoGPT's and
  Accelerate's documented loop), then clip and step;
* ``n_items without shift``: gradaccum, ``n_items=count_tokens(labels)`` (one token per sequence
  too many: the old README's count);
* ``gradaccum``: ``n_items=count_tokens(labels, shift=True)``.

It prints the machine, versions and threads, and a table of the largest absolute parameter
difference from the full batch after some steps, and the mean training loss of the last steps;
``--plot`` draws the loss curves, and the loss and parameter differences over the steps;
``--json`` writes the table, the settings and the machine as a results file.

    python benchmarks/lm_token_weighting.py [--steps 200] [--micro 4] [--accum 4] [--dtype float64]
        [--threads 1] [--layers 2] [--width 96] [--seq 48] [--plot docs/lm_token_weighting.png]
        [--json docs/results/lm_token_weighting.json]
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.demos.gpt import GPT, GPTConfig

Batch = tuple[torch.Tensor, torch.Tensor]  # (token ids, labels with -100 at padding)
ARMS = ("full batch", "naive loss / N", "n_items without shift", "gradaccum")


def corpus(min_bytes: int) -> tuple[bytes, int]:
    """The standard library's ``*.py`` files, in name order, until ``min_bytes``; and the count."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    chunks, size = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
        if size >= min_bytes:
            break
    if size < min_bytes:
        raise RuntimeError(f"the standard library's sources hold {size} bytes, fewer than {min_bytes}")
    return b"".join(chunks), len(chunks)


def batches(text: bytes, batch: int, seq: int, seed: int) -> Iterator[Batch]:
    """Consecutive pieces of ``text`` of 8 to ``seq`` bytes, ``batch`` at a time, right-padded."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    at = 0
    while True:
        lengths = torch.randint(8, seq + 1, (batch,), generator=gen).tolist()
        ids = torch.zeros(batch, seq, dtype=torch.long)
        for i, n in enumerate(lengths):
            if at + n > len(data):
                at = 0
            ids[i, :n] = data[at:at + n]
            at += n
        labels = ids.masked_fill(torch.arange(seq) >= torch.tensor(lengths)[:, None], -100)
        yield ids, labels


def causal_lm_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's loss: position t predicts label t + 1; the mean over those."""
    logits, _ = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@dataclass
class Arm:
    """One training run: its model, optimizer, how it takes a step, what it recorded."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    step: Callable[[Arm, Batch], None]
    acc: gradaccum.Accumulator | None = None
    losses: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)


def full_step(arm: Arm, batch: Batch) -> None:
    loss = causal_lm_loss(arm.model, *batch)
    loss.backward()
    nn.utils.clip_grad_norm_(arm.model.parameters(), 1.0)
    arm.opt.step()
    arm.opt.zero_grad(set_to_none=True)
    arm.losses.append(float(loss.detach()))


def micro_steps(accum: int, shift: bool | None) -> Callable[[Arm, Batch], None]:
    """A window of ``accum`` micro-batches: naive ``loss / N`` (``shift=None``) or gradaccum."""

    def step(arm: Arm, batch: Batch) -> None:
        total, tokens = 0.0, 0
        for ids, labels in zip(*(t.chunk(accum) for t in batch), strict=True):
            loss = causal_lm_loss(arm.model, ids, labels)
            n = int(gradaccum.count_tokens(labels, shift=True))
            total, tokens = total + float(loss.detach()) * n, tokens + n  # the window's token mean, to plot
            if arm.acc is None:
                (loss / accum).backward()
            else:
                arm.acc.backward(loss, n_items=gradaccum.count_tokens(labels, shift=bool(shift)))
        if arm.acc is None:
            nn.utils.clip_grad_norm_(arm.model.parameters(), 1.0)
            arm.opt.step()
            arm.opt.zero_grad(set_to_none=True)
        arm.losses.append(total / tokens)

    return step


def max_diff(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def run(steps: int, micro: int, accum: int, dtype: torch.dtype, config: GPTConfig,
        seed: int = 0) -> list[Arm]:
    """Train the four arms for ``steps`` optimizer steps; each records losses and diffs per step."""
    torch.manual_seed(seed)
    base = GPT(config).to(dtype)
    arms = []
    for name, shift in zip(ARMS, (None, None, False, True), strict=True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        acc = gradaccum.Accumulator(opt, accum, clip_norm=1.0) if name in ARMS[2:] else None
        step = full_step if name == ARMS[0] else micro_steps(accum, shift)
        arms.append(Arm(name, model, opt, step, acc))
    text, _ = corpus(steps * micro * accum * config.block_size)
    data = batches(text, micro * accum, config.block_size, seed)
    for _ in range(steps):
        batch = next(data)
        for arm in arms:
            arm.step(arm, batch)
        for arm in arms:
            arm.diffs.append(max_diff(arm.model, arms[0].model))
    return arms


def table(arms: Sequence[Arm], marks: Sequence[int], last: int) -> str:
    """Markdown: max |parameter - full batch's| after each mark, and the mean loss of the last steps."""
    head = ["run", *(f"after {m} step{'s' if m > 1 else ''}" for m in marks), f"loss, last {last} steps"]
    rows = [head, ["---"] * len(head)]
    for arm in arms:
        loss = sum(arm.losses[-last:]) / len(arm.losses[-last:])
        diffs = ["0 (reference)" if arm is arms[0] else f"{arm.diffs[m - 1]:.1e}" for m in marks]
        rows.append([arm.name, *diffs, f"{loss:.4f}"])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def write_json(path: str, arms: Sequence[Arm], marks: Sequence[int], machine: dict[str, str],
               settings: dict[str, object]) -> None:
    """The table as a results file: each run's parameter difference after each mark (by step
    count), its mean loss over the last steps, and the range of its loss gap to the full batch."""
    last = int(settings["last"])  # type: ignore[call-overload]
    runs = {}
    for arm in arms:
        gaps = [abs(a - b) for a, b in zip(arm.losses, arms[0].losses, strict=True)]
        runs[arm.name] = {"diff_after": {str(m): arm.diffs[m - 1] for m in marks},
                          "loss_last": sum(arm.losses[-last:]) / len(arm.losses[-last:]),
                          "loss_gap_min": min(gaps), "loss_gap_max": max(gaps)}
    final = str(marks[-1])
    ratio = runs["naive loss / N"]["diff_after"][final] / runs["gradaccum"]["diff_after"][final]
    with open(path, "w") as f:
        json.dump({"machine": machine, "settings": settings, "runs": runs,
                   "naive_over_gradaccum_final": ratio}, f, indent=2)
        f.write("\n")


def plot(arms: Sequence[Arm], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    styles = {"full batch": ("black", "-", 3.0), "naive loss / N": ("tab:red", "-", 1.2),
              "n_items without shift": ("tab:orange", "--", 1.2), "gradaccum": ("tab:blue", ":", 2.0)}
    for arm in arms:
        color, line, width = styles[arm.name]
        steps = range(1, len(arm.losses) + 1)
        left.plot(steps, arm.losses, line, color=color, lw=width, label=arm.name)
        if arm is not arms[0]:
            gaps = [max(abs(a - b), 1e-18) for a, b in zip(arm.losses, arms[0].losses, strict=True)]
            middle.semilogy(steps, gaps, line, color=color, lw=width, label=arm.name)
            right.semilogy(steps, [max(d, 1e-18) for d in arm.diffs], line, color=color, lw=width,
                           label=arm.name)
    left.set(xlabel="optimizer step", ylabel="training loss (mean over the batch's tokens)",
             title="loss curves")
    middle.set(xlabel="optimizer step", ylabel="|loss - full batch's loss|",
               title="loss difference from the full batch")
    right.set(xlabel="optimizer step", ylabel="max |parameter - full batch's|",
              title="parameter difference from the full batch")
    for ax in (left, middle, right):
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> list[Arm]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step, N (default 4)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: faster than 2 for matrices this small)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--width", type=int, default=96, help="n_embd (default 96)")
    p.add_argument("--seq", type=int, default=48, help="the longest sequence, >= 8 (default 48)")
    p.add_argument("--plot", help="write the loss curves and differences to this PNG")
    p.add_argument("--json", help="write the table, settings and machine to this results file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4,
                       n_embd=args.width)
    params = sum(p.numel() for p in GPT(config).parameters())
    machine = describe_machine()
    _, files = corpus(args.steps * args.micro * args.accum * config.block_size)
    print(f"# {__doc__.splitlines()[0]}\n")
    print(" | ".join(f"{k}: {v}" for k, v in machine.items()))
    print(f"model: GPT {args.layers} layers x {args.width}, {params:,} parameters, {args.dtype}; "
          f"data: {files} standard-library files of Python {machine['python']}, sequences of 8 to "
          f"{args.seq} bytes; {args.micro} x {args.accum} against {args.micro * args.accum}; AdamW lr 1e-3, "
          f"clip 1.0; {args.steps} steps\n")
    start, cpu = time.perf_counter(), time.process_time()
    arms = run(args.steps, args.micro, args.accum, getattr(torch, args.dtype), config)
    marks = sorted({m for m in (1, 10, 50, 100, args.steps) if m <= args.steps})
    print(table(arms, marks, min(20, args.steps)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"\n{wall:.0f} s wall, {cpu:.0f} s of process CPU time")
    if args.json:
        settings = {**vars(args), "params": params, "files": files, "last": min(20, args.steps),
                    "batch": args.micro * args.accum, "wall_s": wall, "cpu_s": cpu}
        write_json(args.json, arms, marks, machine, settings)
    if args.plot:
        plot(arms, args.plot, f"GPT, {params:,} parameters, {args.dtype}: {args.micro} x {args.accum} "
                              f"micro-batches against a batch of {args.micro * args.accum}")
        print(f"wrote {args.plot}")
    return arms


if __name__ == "__main__":
    main(sys.argv[1:])
