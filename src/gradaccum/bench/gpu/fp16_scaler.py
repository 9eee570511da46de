"""Check 3, fp16 + GradScaler: weighting by ``n_items`` must not skip more windows.

Three runs train the same small GPT under fp16 autocast with a ``GradScaler`` whose first scale
(2^32; 2^24 in the smoke, whose tiny model overflows sooner) is far too high, on the same padded
token batches, so each must back the scale off through skipped windows before it steps:

* ``gradaccum, n_items``: ``acc.backward(loss, n_items=real tokens)``;
* ``gradaccum``: ``acc.backward(loss)`` (mean weighting: the loss is scaled by 1/N up front);
* ``hand-written``: nanoGPT's loop with the scaler (``scaler.scale(loss / N).backward()``, then
  ``unscale_``, ``step``, ``update``); a skipped window is one whose ``update`` lowered the scale.

The target is that ``n_items`` costs no extra skipped window. Were the token-weighted loss scaled
by its token count before the scaler's scale (rather than by a factor near 1/N), its gradients
would be hundreds of times larger and overflow fp16 for several more halvings of the scale.
"""

from __future__ import annotations

import math

import torch

from gradaccum import Accumulator
from gradaccum.bench.gpu.check import Context, Outcome
from gradaccum.bench.gpu.gpt import GPT_SMALL, GPT_TINY, IGNORE, gpt_loss, token_batches
from gradaccum.demos.gpt import GPT

__all__ = ["run"]

STEPS = 4
INIT_SCALE = {"cuda": 2.0**32, "smoke": 2.0**24}


def _init_scale(ctx: Context) -> float:
    return INIT_SCALE["smoke" if ctx.smoke else "cuda"]


def _skips(ctx: Context, mode: str, windows: int) -> tuple[int, float]:
    """Windows skipped by one run, and its final scale."""
    config = GPT_TINY if ctx.smoke else GPT_SMALL
    torch.manual_seed(0)
    model = GPT(config).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=_init_scale(ctx))
    batches = token_batches(config, 2 if ctx.smoke else 8, STEPS * windows, ctx.device, padded=True)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(ctx.device.type, dtype=torch.float16):
            return gpt_loss(model(x)[0], y)

    skipped = 0
    if mode == "hand-written":
        for w in range(windows):
            for x, y in batches[w * STEPS:(w + 1) * STEPS]:
                torch.autograd.backward(scaler.scale(loss_of(x, y) / STEPS))
            before = scaler.get_scale()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            opt.zero_grad(set_to_none=True)
        return skipped, scaler.get_scale()
    acc = Accumulator(opt, STEPS, scaler=scaler)
    for x, y in batches:
        n = (y != IGNORE).sum() if mode == "gradaccum, n_items" else None
        acc.backward(loss_of(x, y), n_items=n)
    if acc.windows != windows:
        raise RuntimeError(f"{mode}: {acc.windows} windows applied, expected {windows}")
    return acc.skipped_windows, scaler.get_scale()


def run(ctx: Context) -> Outcome:
    """The three runs; ``met``: n_items skipped no more windows than mean weighting."""
    windows = 16 if ctx.smoke else 64
    runs = {}
    for mode in ("gradaccum, n_items", "gradaccum", "hand-written"):
        runs[mode] = _skips(ctx, mode, windows)
        ctx.record(windows=windows, init_scale=_init_scale(ctx),
                   skipped={m: s for m, (s, _) in runs.items()},
                   final_scale={m: f for m, (_, f) in runs.items()})
    with_items, mean, hand = (runs[m][0] for m in ("gradaccum, n_items", "gradaccum", "hand-written"))
    if mean == 0:
        raise RuntimeError(f"no window was skipped from a scale of {_init_scale(ctx):.0e}: the check "
                           "would prove nothing (is the model running in fp16?)")
    measured = (f"skipped of {windows} windows from scale 2^{math.log2(_init_scale(ctx)):.0f}: "
                f"n_items {with_items}, "
                f"without {mean}, hand-written {hand}")
    return Outcome(measured, "n_items skips <= without n_items", with_items <= mean)
