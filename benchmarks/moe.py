"""Mixture-of-experts under accumulation: gradaccum.moe's three modes against hand loops, on a tiny
Hugging Face Qwen3-MoE (no download), for docs/MOE.md.

Four parts, one results file:

- ``exactness`` (the "Why" table): float64, 8 experts, top-2, 2 layers, padded sequences, 2 windows
  of 4 micro-batches, SGD; each loop's largest parameter difference from one process on the whole
  window with the whole window's balancing loss written out in float64, at two ``coef``.
- ``cost``: float32, time per window of "global", "rolling" and "micro_batch" against the plain
  Hugging Face loop by hand (and the two passes by hand), medians of windows run interleaved
  round by round in one process (the order rotating), after warm-up.
- ``memory``: the tensor memory a window holds at its peak (the allocator's, through the
  profiler's memory events on CPU), "global" (its pre-pass included) against the hand loop and
  against "rolling" (the same loop without a pre-pass).
- ``training``: "global" against "micro_batch", the same initial weights and data, on micro-batches
  that each hold one domain (:func:`gradaccum.bench.moe.domain_batches`): per window, the load
  balance (max over mean expert load, each layer, the window's routes) and the language-model loss;
  at the end, the loss on held-out windows.

    python benchmarks/moe.py --json docs/results/moe.json
    python benchmarks/moe.py --rounds 5 --train-windows 20   # a quick check
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import allocator_memory, interleaved
from gradaccum.bench.moe import (
    Batch,
    TokenMoE,
    domain_batches,
    hand_loop,
    lm_sum,
    padded_batches,
    rolling_loop,
    tiny_qwen3_moe,
    two_pass_loop,
    window_reference,
)
from gradaccum.bench.results_file import write_results

MODES = ("global", "rolling", "micro_batch")
PARTS = ("exactness", "cost", "memory", "training")
Loop = Callable[[nn.Module, Sequence[Batch], torch.optim.Optimizer], None]


def tokens(batch: Batch) -> torch.Tensor:
    return gradaccum.count_tokens(batch["labels"], shift=True)


def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Hugging Face's ``outputs.loss`` (computed in float32 whatever the model's dtype)."""
    return model(**batch).loss  # type: ignore[no-any-return]


def wide_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The same mean token loss in the model's dtype (float64 for the exactness table)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return lm_sum(logits, batch["labels"]) / tokens(batch)


class Library:
    """gradaccum.moe on one model: a ``LoadBalance`` and an ``Accumulator`` of ``steps``, fed one
    window per call through ``balance.windows`` (the loop of docs/MOE.md)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, steps: int, mode: str,
                 loss: Callable[[nn.Module, Batch], torch.Tensor] = hf_loss,
                 forward: Callable[[Batch], Any] | None = None, mask: Callable[[Batch], Any] | None = None,
                 **kw: Any) -> None:
        from gradaccum.moe import LoadBalance

        self.model, self.loss, self.forward, self.mask = model, loss, forward, mask
        self.balance = LoadBalance(model, mode=mode, **kw)
        self.acc = gradaccum.Accumulator(opt, steps)

    def __call__(self, model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer) -> None:
        summed = counted = 0.0
        parts = self.balance.windows(window, self.acc, n_items=tokens, forward=self.forward, mask=self.mask)
        for part in parts:
            for batch in part:
                loss, n = self.loss(self.model, batch), tokens(batch)
                self.acc.backward(loss, n_items=n)
                summed, counted = summed + float(loss.detach()) * float(n), counted + float(n)
        self.lm_loss = summed / counted  # the window's token-weighted LM loss, for the training run


def per_microbatch_mean(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer) -> None:
    """``loss / k`` per micro-batch, Hugging Face's balancing loss inside each."""
    for b in window:
        (model(**b, output_router_logits=True).loss / len(window)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_today(steps: int) -> Callable[[nn.Module, torch.optim.Optimizer], Loop]:
    """gradaccum without gradaccum.moe: ``acc.backward(outputs.loss, n_items=count_tokens(...))``."""
    def build(model: nn.Module, opt: torch.optim.Optimizer) -> Loop:
        acc = gradaccum.Accumulator(opt, steps)

        def loop(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer) -> None:
            for b in window:
                acc.backward(model(**b, output_router_logits=True).loss, n_items=tokens(b))
        return loop
    return build


Builder = Callable[[nn.Module, torch.optim.Optimizer], Loop]


def fixed(loop: Loop) -> Builder:
    """A builder of a loop that keeps no state of its own."""
    return lambda model, opt: loop


def trained(base: nn.Module, build: Builder, data: Sequence[Sequence[Batch]], lr: float = 0.1) -> nn.Module:
    """A copy of ``base`` trained by the loop ``build`` makes, one call per window, SGD."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loop = build(model, opt)
    for window in data:
        loop(model, window, opt)
    return model


def param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference of two models' parameters."""
    return max(float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def make_plain(steps: int) -> Callable[[nn.Module, torch.optim.Optimizer], Loop]:
    """The language-model loss alone (float64) through ``acc.backward(..., n_items=...)``."""
    def build(model: nn.Module, opt: torch.optim.Optimizer) -> Loop:
        acc = gradaccum.Accumulator(opt, steps)

        def loop(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer) -> None:
            for b in window:
                acc.backward(wide_loss(model, b), n_items=tokens(b))
        return loop
    return build


def exactness(args: argparse.Namespace) -> dict[str, Any]:
    """Each loop's largest parameter difference from one process on the whole window."""
    k = 4
    data = [padded_batches([3, 3, 2, 3], 7, 32, seed=w) for w in range(2)]
    out: dict[str, Any] = {}
    loops: dict[str, Builder] = {
        "loss_over_k": fixed(per_microbatch_mean), "today": make_today(k),
        "rolling_by_hand": fixed(rolling_loop), "two_passes_by_hand": fixed(two_pass_loop),
        **{mode: partial(Library, steps=k, mode=mode, loss=wide_loss) for mode in MODES}}
    out["coefs"] = [0.5, 0.01]
    out["rows"] = {name: {} for name in loops}
    for coef in out["coefs"]:
        base = tiny_qwen3_moe(torch.float64, coef=coef)
        ref = trained(base, fixed(window_reference), data)
        for name, build in loops.items():
            out["rows"][name][f"coef{out['coefs'].index(coef)}"] = param_diff(trained(base, build, data), ref)
    # The floor of any accumulator on this model: no balancing loss (coef 0), the LM loss alone
    # through Accumulator.backward against the whole window (Hugging Face's float32 attention
    # softmax rounds its gradient with the scale of the backward's seed)
    base = tiny_qwen3_moe(torch.float64, coef=0.0)
    out["accumulator_floor"] = param_diff(trained(base, fixed(window_reference), data),
                                          trained(base, make_plain(k), data))
    # Hugging Face's own balancing loss is float32 inside a float64 model: its distance from float64
    model = tiny_qwen3_moe(torch.float64, coef=0.5)
    from gradaccum.bench.moe import aux_terms, route_counts, window_aux

    b = data[0][0]
    with torch.no_grad():
        o = model(**b, output_router_logits=True)
        c, r = route_counts(o.router_logits, b["attention_mask"], 8, 2)
        out["hf_float32_aux"] = abs(float(o.aux_loss) - float(window_aux(c, r, aux_terms(o.router_logits,
                                                                                         b["attention_mask"]))))
    return out


def cost_model(args: argparse.Namespace) -> nn.Module:
    return tiny_qwen3_moe(torch.float32, experts=args.experts, hidden=args.hidden, vocab=args.vocab,
                          layers=args.layers, coef=0.01)


def cost_windows(args: argparse.Namespace, n: int) -> list[list[Batch]]:
    return [padded_batches([args.batch] * args.steps, args.seq, args.vocab, seed=100 + w) for w in range(n)]


def contenders(args: argparse.Namespace) -> dict[str, Callable[[Sequence[Batch]], None]]:
    """Each loop on its own copy of the model and its own SGD: ``window -> None``."""
    base = cost_model(args)
    out: dict[str, Callable[[Sequence[Batch]], None]] = {}
    builders: dict[str, Builder] = {
        "hand loop": fixed(hand_loop), "two passes by hand": fixed(two_pass_loop),
        **{mode: partial(Library, steps=args.steps, mode=mode) for mode in MODES}}
    for name, build in builders.items():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        out[name] = partial(build(model, opt), model, opt=opt)
    return out


def cost(args: argparse.Namespace) -> dict[str, Any]:
    """Time per window, medians of interleaved rounds."""
    loops = contenders(args)
    data = cost_windows(args, 4)
    step = {"i": 0}

    def each(run: Callable[[Sequence[Batch]], None]) -> Callable[[], None]:
        def call() -> None:
            run(data[step["i"] % len(data)])
        return call
    fns = {name: each(run) for name, run in loops.items()}
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    timings = interleaved(fns, repeats=args.rounds, calls=1, warmup=False)
    return {name: {"ms_per_window": round(timings.median(name) * 1e3, 2),
                   "vs_hand_loop": round(timings.ratio(name, "hand loop"), 3)} for name in loops}


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """The peak tensor memory of one window (after one warm-up window each, so that the optimizer
    and gradients exist), "global" against the hand loop."""
    loops = contenders(args)
    data = cost_windows(args, 2)
    out = {}
    for name in ("hand loop", "rolling", "global"):
        loops[name](data[0])
        _, mem = allocator_memory(lambda name=name: loops[name](data[1]), torch.device("cpu"))
        out[name] = {"peak_bytes": mem.peak}
    for base in ("hand loop", "rolling"):
        ratio = out["global"]["peak_bytes"] / out[base]["peak_bytes"]
        out["global"][f"vs_{base.replace(' ', '_')}"] = round(ratio, 4)
    return out


class Loads:
    """The routes each router chose, per layer, counted by forward hooks on the routers' logits,
    for the window (the training data has no padding) and per micro-batch; the pre-pass (no grad)
    is not counted."""

    def __init__(self, routers: Sequence[nn.Module], experts: int, top_k: int) -> None:
        self.experts, self.top_k, self.micro = experts, top_k, []
        self.counts = torch.zeros(len(routers), experts, dtype=torch.float64)
        for i, router in enumerate(routers):
            router.register_forward_hook(lambda mod, inp, out, i=i: self._add(i, out))

    def _add(self, layer: int, logits: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # the training forward, not a pre-pass
            chosen = logits.detach().topk(self.top_k, dim=-1).indices
            c = torch.bincount(chosen.reshape(-1), minlength=self.experts).double()
            self.counts[layer] += c
            self.micro.append(float(c.max() / c.mean()))

    def take(self) -> tuple[list[float], float]:
        """Each layer's max over mean load of the window, and the micro-batches' mean of the same."""
        balance = (self.counts.max(1).values / self.counts.mean(1)).tolist()
        micro = statistics.fmean(self.micro) if self.micro else float("nan")
        self.counts.zero_()
        self.micro = []
        return balance, micro


def next_token_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The mean next-token loss of :class:`gradaccum.bench.moe.TokenMoE` over a micro-batch."""
    return lm_sum(model(batch["input_ids"]), batch["labels"]) / tokens(batch)


def heldout_loss(model: nn.Module, windows: Sequence[Sequence[Batch]]) -> float:
    total = n = 0.0
    with torch.no_grad():
        for window in windows:
            for b in window:
                t = float(tokens(b))
                total, n = total + float(next_token_loss(model, b)) * t, n + t
    return total / n


def training(args: argparse.Namespace) -> dict[str, Any]:
    """"global" against "micro_batch" on domain-structured micro-batches, AdamW, same start."""
    base = TokenMoE(args.train_vocab, args.hidden, args.experts, 2, args.layers, seed=1)
    n = args.train_windows * args.steps
    data = domain_batches(n, args.batch, args.seq, args.train_vocab, args.domains, seed=7)
    windows = [data[i: i + args.steps] for i in range(0, n, args.steps)]
    held = domain_batches(8 * args.steps, args.batch, args.seq, args.train_vocab, args.domains, seed=8)
    held_windows = [held[i: i + args.steps] for i in range(0, len(held), args.steps)]
    out: dict[str, Any] = {}
    for mode in ("global", "micro_batch"):
        torch.manual_seed(0)
        model = copy.deepcopy(base)
        routers = list(model.routers)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        loop = Library(model, opt, args.steps, mode, loss=next_token_loss, routers=routers, top_k=2,
                       coef=args.train_coef, forward=lambda b, model=model: model(b["input_ids"]),
                       mask=lambda b: b["attention_mask"])
        loads = Loads(routers, args.experts, 2)
        curve = []
        for window in windows:
            loop(model, window, opt)
            balance, micro = loads.take()
            curve.append({"loss": round(loop.lm_loss, 4), "balance": [round(x, 3) for x in balance],
                          "micro_balance": round(micro, 3)})
        last = curve[-args.tail:]
        out[mode] = {
            "heldout_loss": round(heldout_loss(model, held_windows), 4),
            "tail_loss": round(statistics.fmean(c["loss"] for c in last), 4),
            "tail_balance": round(statistics.fmean(statistics.fmean(c["balance"]) for c in last), 3),
            "tail_worst_layer_balance": round(statistics.fmean(max(c["balance"]) for c in last), 3),
            "tail_micro_balance": round(statistics.fmean(c["micro_balance"] for c in last), 3),
            "curve": curve,
        }
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="rerun some (the file keeps the others)")
    parser.add_argument("--steps", type=int, default=4, help="micro-batches per window")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-windows", type=int, default=200)
    parser.add_argument("--train-vocab", type=int, default=64)
    parser.add_argument("--train-coef", type=float, default=0.01)
    parser.add_argument("--domains", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tail", type=int, default=50, help="the last windows the summary averages")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = describe_machine()
    for key, value in machine.items():
        print(f"{key:>14}: {value}")
    parts = args.parts.split(",")
    results: dict[str, Any] = {"source": "python benchmarks/moe.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"), "machine": machine}
    if "exactness" in parts:
        results["exactness"] = ex = exactness(args)
        print("\n| loop | coef 0.5 | coef 0.01 |\n|---|---|---|")
        for name, row in ex["rows"].items():
            print(f"| {name} | {row['coef0']:.1e} | {row['coef1']:.1e} |")
        print(f"(Hugging Face's float32 balancing loss, from float64: {ex['hf_float32_aux']:.1e}; "
              f"any accumulator without a balancing loss: {ex['accumulator_floor']:.1e})")
    if "cost" in parts:
        results["cost"] = cost(args)
        print(f"\n{args.steps} x {args.batch} sequences of {args.seq}, {args.experts} experts, "
              f"{args.layers} layers, hidden {args.hidden}, float32, {args.rounds} interleaved rounds, "
              f"{args.threads} thread(s)")
        print("| loop | ms / window (median) | vs hand loop |\n|---|---|---|")
        for name, row in results["cost"].items():
            print(f"| {name} | {row['ms_per_window']:.2f} | {row['vs_hand_loop']:.3f}x |")
    if "memory" in parts:
        results["memory"] = mem = memory(args)
        print("\n| loop | peak tensor memory of a window (KiB) |\n|---|---|")
        for name, row in mem.items():
            print(f"| {name} | {row['peak_bytes'] / 1024:.1f} |")
        print(f"global / hand loop: {mem['global']['vs_hand_loop']:.4f}x, global / rolling (the same "
              f"loop without the pre-pass): {mem['global']['vs_rolling']:.4f}x")
    if "training" in parts:
        results["training"] = training(args)
        print(f"\n{args.train_windows} windows, {args.domains} domains (one per micro-batch), "
              f"last {args.tail}:")
        print("| mode | LM loss | held-out loss | window balance (mean of layers) | worst layer "
              "| micro-batch balance |\n|---|---|---|---|---|---|")
        for mode, row in results["training"].items():
            print(f"| {mode} | {row['tail_loss']:.4f} | {row['heldout_loss']:.4f} | "
                  f"{row['tail_balance']:.3f} | {row['tail_worst_layer_balance']:.3f} | "
                  f"{row['tail_micro_balance']:.3f} |")
    results["setup"] = {k: v for k, v in vars(args).items() if k not in ("json", "parts")}
    if args.json is not None:
        if args.json.exists() and set(parts) != set(PARTS):  # a part rerun: the others kept
            kept = json.loads(args.json.read_text())
            results = {**kept, **{k: v for k, v in results.items() if k in parts}}
        write_results(args.json, results)
    return results


if __name__ == "__main__":
    main()
