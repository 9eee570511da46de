"""Accumulator hooks: boundary hooks after every applied window, discard hooks after discard()."""

from __future__ import annotations

import torch

from gradaccum import Accumulator


def test_boundary_and_discard_hooks_run_and_can_be_removed() -> None:
    model = torch.nn.Linear(2, 1)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    calls: list[str] = []
    boundary = acc.register_boundary_hook(lambda a: calls.append(f"boundary@{a.optimizer_steps}"))
    discard = acc.register_discard_hook(lambda a: calls.append(f"discard@{a.micro_step}"))
    x = torch.randn(2, 2)
    acc.backward(model(x).sum())
    acc.discard()
    acc.backward(model(x).sum())
    acc.backward(model(x).sum())
    acc.backward(model(x).sum())
    acc.flush()
    assert calls == ["discard@0", "boundary@1", "boundary@2"]
    boundary.remove()
    discard.remove()
    acc.backward(model(x).sum())
    acc.discard()
    acc.flush()
    assert len(calls) == 3


def test_feed_hooks_see_each_backward_before_it_runs_and_may_refuse_it() -> None:
    # Accumulator.register_feed_hook (gradaccum.moe's way in): the micro-batch's index, its count,
    # reduction and the seed its backward starts from; a hook that raises stops the backward
    # with nothing changed.
    model = torch.nn.Linear(2, 1)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    seen: list[tuple] = []
    handle = acc.register_feed_hook(lambda f: seen.append((f.micro_step, f.n_items, f.reduction,
                                                           None if f.seed is None else float(f.seed))))
    x = torch.randn(2, 2)
    acc.backward(model(x).sum(), n_items=3)
    with acc.micro_batch(1) as mb:
        mb.backward(model(x).sum())
        mb.backward(model(x).mean())
    assert [s[:3] for s in seen] == [(0, 3, "mean"), (1, 1, "mean"), (1, 1, "mean")]
    assert seen[0][3] == 0.5  # n / P, P = 2 x the first count (core.window's provisional total)
    acc.backward(model(x).sum(), n_items=2.0, reduction="sum")
    assert seen[-1][:3] == (0, 2.0, "sum")

    def refuse(feed: object) -> None:
        raise RuntimeError("refused")

    handle.remove()
    acc.register_feed_hook(refuse)
    grads = [p.grad.clone() for p in model.parameters()]
    try:
        acc.backward(model(x).sum(), n_items=2.0, reduction="sum")
    except RuntimeError as e:
        assert str(e) == "refused"
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
