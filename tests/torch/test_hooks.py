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
