"""The accumulator's per-micro-step cost against hand-written loops: aten ops and time.

Five loops over the same micro-batches, ``STEPS`` per window, each a callable that runs one
window (``benchmarks/hot_path.py`` times them; ``tests/bench/test_hot_path.py`` counts ops):

- ``hand mean``: the seed's loop, ``(loss / N).backward()``, step and ``zero_grad`` every N;
- ``gradaccum mean``: ``acc.backward(loss)``;
- ``hand tokens``: the hand token-weighted loop, ``loss_sum.backward(); total += n``, then
  ``p.grad.div_(total)`` and the step at the boundary;
- ``gradaccum int`` / ``gradaccum tensor``: ``acc.backward(loss, n_items=n)`` with ``n`` a Python
  int known up front (a data loader's count) or the 0-dim tensor of
  :func:`gradaccum.count_tokens` (made inside the loop, as in the hand token loop).

Ops are counted with a ``TorchDispatchMode``: each is a kernel launch on a GPU, so the count is
the machine-independent half of the cost. :func:`window_checks` gives the Python time of the
accumulator's once-per-window gradient checks (no aten op: they read attributes only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradaccum

__all__ = ["GPT_CONFIG", "LOOPS", "STEPS", "OpCounter", "make_loops", "ops_per_micro_step",
           "python_calls_per_micro_step", "window_checks"]

STEPS = 4
LOOPS = ("hand mean", "gradaccum mean", "hand tokens", "gradaccum int", "gradaccum tensor")
IGNORE = -100


def _gpt_config() -> Any:
    from gradaccum.demos.gpt import GPTConfig

    return GPTConfig(vocab_size=256, block_size=32, n_layer=12, n_head=2, n_embd=32)


GPT_CONFIG = _gpt_config()  # 148 parameter tensors, as GPT-2 small (a head tied to the embedding)


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count the aten ops dispatched while active (``with OpCounter() as c: ...; c.count``).

    Example:
        >>> with OpCounter() as c:
        ...     _ = torch.ones(2) + 1
        >>> c.count
        2
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _batches(model: str, micro: int) -> tuple[Callable[[], nn.Module], list[tuple[Any, ...]]]:
    """A model factory and ``STEPS`` micro-batches ``(x, y, labels)``; labels carry padding."""
    g = torch.Generator().manual_seed(0)
    if model == "gpt":
        from gradaccum.demos.gpt import GPT

        build: Callable[[], nn.Module] = lambda: _Logits(GPT(GPT_CONFIG))  # noqa: E731
        xs = [torch.randint(0, GPT_CONFIG.vocab_size, (micro, GPT_CONFIG.block_size), generator=g)
              for _ in range(STEPS)]
        classes = GPT_CONFIG.vocab_size
    elif model == "trivial":
        build = lambda: nn.Linear(4, 3)  # noqa: E731
        xs = [torch.randn(micro, 4, generator=g) for _ in range(STEPS)]
        classes = 3
    else:
        from gradaccum.demos.models import build_model

        build = lambda: build_model("mlp", seed=0)  # noqa: E731
        xs = [torch.randn(micro, 1, 28, 28, generator=g) for _ in range(STEPS)]
        classes = 10
    batches = []
    for x in xs:
        items = x.numel() if model == "gpt" else micro  # gpt: a label per token
        y = torch.randint(0, classes, (items,), generator=g)
        labels = y.clone()
        labels[: len(y) // 4] = IGNORE  # some padding, so the counts are real counts
        batches.append((x, y, labels))
    return build, batches


class _Logits(nn.Module):
    """A language model's logits flattened to ``[tokens, vocab]`` (the loops' cross-entropy)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm(idx)[0]
        return logits.reshape(-1, logits.shape[-1])


def make_loops(model: str = "trivial", micro: int = 8) -> dict[str, Callable[[], None]]:
    """The five loops of the module docstring, each running one window when called.

    Args:
        model: ``"trivial"`` (a 4-3 Linear: the overhead shows), ``"mlp"`` (the seed's MLP) or
            ``"gpt"`` (a 12-layer nanoGPT of GPT-2 small's 148 parameter tensors, narrow:
            :data:`GPT_CONFIG`; ``micro`` sequences of its block size).
        micro: items per micro-batch.
    """
    build, batches = _batches(model, micro)
    ce = nn.functional.cross_entropy
    loops: dict[str, Callable[[], None]] = {}

    def hand(mean: bool) -> Callable[[], None]:
        torch.manual_seed(0)
        m = build()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)

        def run() -> None:
            total: Any = 0
            for x, _, labels in batches:
                if mean:
                    (ce(m(x), labels) / STEPS).backward()  # type: ignore[no-untyped-call]
                else:
                    ce(m(x), labels, reduction="sum").backward()  # type: ignore[no-untyped-call]
                    total += gradaccum.count_tokens(labels)
            if not mean:
                for p in m.parameters():
                    assert p.grad is not None
                    p.grad.div_(total)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    def accumulated(kind: str) -> Callable[[], None]:
        torch.manual_seed(0)
        m = build()
        acc = gradaccum.Accumulator(torch.optim.SGD(m.parameters(), lr=0.01), STEPS)
        ints = [int((labels != IGNORE).sum()) for _, _, labels in batches]  # known up front

        def run() -> None:
            for (x, _, labels), k in zip(batches, ints, strict=True):
                n: Any = None
                if kind == "tensor":
                    n = gradaccum.count_tokens(labels)
                elif kind == "int":
                    n = k
                acc.backward(ce(m(x), labels), n)
        return run

    loops["hand mean"] = hand(True)
    loops["gradaccum mean"] = accumulated("mean")
    loops["hand tokens"] = hand(False)
    loops["gradaccum int"] = accumulated("int")
    loops["gradaccum tensor"] = accumulated("tensor")
    return loops


def python_calls_per_micro_step(run: Callable[[], None], windows: int = 2) -> float:
    """Python-level calls (functions and builtins, ``sys.setprofile``'s call events) per
    micro-step of ``run``, after one window's warm-up: what runs in Python around and inside each
    backward (a hook on a parameter shows here on every backward).

    Example:
        >>> python_calls_per_micro_step(make_loops()["hand mean"]) > 0
        True
    """
    import sys

    run()
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        for _ in range(windows):
            run()
    finally:
        sys.setprofile(None)
    return count[0] / (windows * STEPS)


def ops_per_micro_step(run: Callable[[], None], windows: int = 3) -> float:
    """Aten ops per micro-step of ``run`` (one window a call), after one window's warm-up."""
    run()
    with OpCounter() as counter:
        for _ in range(windows):
            run()
    return float(counter.count) / (windows * STEPS)


def window_checks(tensors: int, repeats: int = 2000) -> dict[str, float]:
    """Microseconds of the accumulator's gradient checks (torch/_window_grads.py) for a model of
    ``tensors`` parameter tensors, medians of ``repeats`` interleaved rounds: the stale-gradient
    check at a window's first micro-batch (every ``.grad`` None, as after a boundary), the note
    after a micro-batch, the check before a later one and the check before the last (every
    ``.grad`` present), and what a window of ``STEPS`` takes of them.

    Example:
        >>> sorted(window_checks(2, repeats=3))
        ['check', 'last check', 'note', 'per window', 'stale check']
    """
    from gradaccum.bench.measure import interleaved
    from gradaccum.torch._window_grads import WindowGrads

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(tensors // 2)], *[nn.LayerNorm(4)][: tensors % 2])
    checks = WindowGrads(list(model.parameters()), None, exact=True)  # as an accumulator's guard makes it
    model(torch.randn(2, 4)).pow(2).mean().backward()  # every .grad present
    checks.note()
    grads = [p.grad for p in model.parameters()]

    def stale() -> None:
        for p in model.parameters():
            p.grad = None
        checks.check_clean()
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g

    def unset() -> None:  # the loop of stale() without the check, subtracted from it
        for p in model.parameters():
            p.grad = None
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g

    t = interleaved({"stale": stale, "unset": unset, "note": checks.note,
                     "check": lambda: checks.check(1, STEPS, False),
                     "last": lambda: checks.check(STEPS - 1, STEPS, True)}, repeats=repeats, calls=1)
    us = {name: t.median(name) * 1e6 for name in t.samples}
    out = {"stale check": max(us["stale"] - us["unset"], 0.0), "note": us["note"], "check": us["check"],
           "last check": us["last"]}
    # A window: the stale check, a note after each micro-batch but the last, a check before each
    # later one but the last, and the last check.
    out["per window"] = (out["stale check"] + (STEPS - 1) * out["note"] + (STEPS - 2) * out["check"]
                         + out["last check"])
    return out
