"""Common mistakes, each with the first words of its message and the fix the message names.

The table is the contract of docs/GUIDE.md's "Errors" section: every message says what is wrong
*and* what to do. A mistake raises before anything changes (checked by the last column's
``unchanged`` flag where the accumulator already holds a micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum


def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    return {"model": model, "opt": opt, "x": x, "acc": gradaccum.Accumulator(opt, 4)}


def fed(s: dict[str, Any]) -> dict[str, Any]:
    """The accumulator holding one micro-batch."""
    s["acc"].backward(s["model"](s["x"]).pow(2).mean())
    return s


def loss(s: dict[str, Any]) -> torch.Tensor:
    return s["model"](s["x"]).pow(2).mean()


class Recipe(torch.nn.Module):
    pass


MISTAKES: list[tuple[str, Callable[[dict[str, Any]], Any], type[Exception], str, str]] = [
    # (mistake, the call, exception, the message's first words, the fix it names)
    ("the model passed as the optimizer", lambda s: gradaccum.Accumulator(s["model"], 4),
     TypeError, "optimizer must be a torch.optim.Optimizer, got the model", "SGD(model.parameters()"),
    ("model.parameters() passed as the optimizer",
     lambda s: gradaccum.Accumulator(s["model"].parameters(), 4),
     TypeError, "optimizer must be a torch.optim.Optimizer, got parameters", "SGD(model.parameters()"),
    ("clip_norm passed positionally (the seed tutorial's signature)",
     lambda s: gradaccum.Accumulator(s["opt"], 4, 1.0),
     TypeError, "Accumulator takes optimizer and steps positionally", "clip_norm=1.0"),
    ("a scheduler bound to another optimizer",
     lambda s: gradaccum.Accumulator(s["opt"], 4, scheduler=torch.optim.lr_scheduler.StepLR(
         torch.optim.SGD(s["model"].parameters(), lr=0.1), 1)),
     ValueError, "scheduler is bound to another optimizer", "StepLR(optimizer"),
    ("a scheduler that needs a metric", lambda s: gradaccum.Accumulator(
        s["opt"], 4, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(s["opt"])),
     TypeError, "scheduler ReduceLROnPlateau.step needs metrics", "scheduler.step(metric)"),
    ("an optimizer that needs a closure",
     lambda s: gradaccum.Accumulator(torch.optim.LBFGS(s["model"].parameters()), 4),
     TypeError, "optimizer LBFGS needs a closure", "cannot step once per accumulated window"),
    ("steps=0", lambda s: gradaccum.Accumulator(s["opt"], 0), ValueError, "steps must be", ">= 1"),
    ("a per-sample loss", lambda s: s["acc"].backward(s["model"](s["x"]).pow(2).mean(1)),
     ValueError, "loss must be a scalar", "loss.mean()"),
    ("loss.item()", lambda s: s["acc"].backward(loss(s).item()),
     TypeError, "loss must be a torch.Tensor (a scalar), got a float", "not loss.item()"),
    ("a list of two losses", lambda s: s["acc"].backward([loss(s), loss(s)]),
     TypeError, "loss must be a scalar tensor, got a list of 2 losses", "acc.micro_batch()"),
    ("nanoGPT's (logits, loss)", lambda s: s["acc"].backward((s["model"](s["x"]), loss(s))),
     TypeError, "loss must be a scalar tensor, got a tuple of 2", "logits, loss = model(x, y)"),
    ("a Hugging Face model output", lambda s: s["acc"].backward({"loss": loss(s)}),
     TypeError, "loss must be a scalar tensor, got a dict (a model output)", "acc.backward(outputs.loss)"),
    ("a loss computed under no_grad", lambda s: s["acc"].backward(loss(s).detach()),
     ValueError, "loss does not require grad", "torch.no_grad()"),
    ("a bool mask as n_items", lambda s: s["acc"].backward(loss(s), torch.ones(4, dtype=torch.bool).any()),
     TypeError, "n_items must be a count or a weight, got a torch.bool tensor", "mask.sum()"),
    ("n_items=0 for a mean", lambda s: s["acc"].backward(loss(s), 0),
     ValueError, "n_items=0 with reduction='mean'", "reduction='sum'"),
    ("n_items=None for a sum", lambda s: s["acc"].backward(loss(s), reduction="sum"),
     ValueError, "n_items=None with reduction='sum'", "it may be 0"),
    ("count_tokens of a list", lambda s: gradaccum.count_tokens([[1, 2, -100]]),
     TypeError, "labels must be a torch.Tensor, got a list", "torch.tensor(labels)"),
    ("count_tokens of a mask", lambda s: gradaccum.count_tokens(torch.ones(2, 3, dtype=torch.bool)),
     TypeError, "labels must be an integer tensor", "mask.sum()"),
    ("load_state_dict with other steps",
     lambda s: gradaccum.Accumulator(s["opt"], 2).load_state_dict(s["acc"].state_dict()),
     ValueError, "state was saved with steps=4, this accumulator has steps=2", "steps=4 to resume"),
    ("n_items on one micro-batch of a window only", lambda s: fed(s)["acc"].backward(loss(s), 4),
     ValueError, "n_items=4 mixes weightings", "on every micro-batch of a window or on none"),
    ("your own optimizer.step() inside the window", lambda s: fed(s)["opt"].step(),
     RuntimeError, "optimizer.step() was called inside an open window", "Remove your optimizer.step()"),
    ("your own optimizer.zero_grad() inside the window",
     lambda s: (fed(s)["opt"].zero_grad(), s["acc"].backward(loss(s))),
     RuntimeError, "the window's gradients were cleared outside the accumulator", "acc.discard()"),
    ("zero_grad(set_to_none=False) inside the window",
     lambda s: (fed(s)["opt"].zero_grad(set_to_none=False), s["acc"].backward(loss(s))),
     RuntimeError, "the window's gradients were changed in place outside", "remove those calls"),
    ("clipping every micro-batch yourself",
     lambda s: (nn.utils.clip_grad_norm_(fed(s)["model"].parameters(), 1e-3), s["acc"].backward(loss(s))),
     RuntimeError, "the window's gradients were changed in place outside", "clips and steps once per window"),
]


@pytest.mark.parametrize("mistake, call, kind, first_words, fix", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_gets_one_message_that_names_the_fix(mistake, call, kind, first_words, fix):
    s = setup()
    with pytest.raises(kind) as err:
        call(s)
    message = str(err.value)
    assert message.startswith(first_words), message
    assert fix in message, message
    assert "\n" not in message


def test_a_refused_optimizer_step_changed_nothing():
    s = fed(setup())
    before = [p.detach().clone() for p in s["model"].parameters()]
    with pytest.raises(RuntimeError):
        s["opt"].step()
    assert all(torch.equal(p, q) for p, q in zip(s["model"].parameters(), before, strict=True))
    assert s["acc"].micro_step == 1
    for _ in range(3):
        s["acc"].backward(loss(s))
    assert s["acc"].optimizer_steps == 1  # the window completes as it should


def test_the_guards_stay_quiet_where_nothing_is_wrong():
    # The negative twins: an optimizer step after a boundary (no gradient left), reading .grad
    # between micro-batches, and an accumulator dropped while the optimizer lives on.
    s = setup()
    for _ in range(4):
        s["acc"].backward(loss(s))
        _ = [p.grad.norm() for p in s["model"].parameters() if p.grad is not None]
    s["opt"].step()
    old = s.pop("acc")
    del old
    acc = gradaccum.Accumulator(s["opt"], 2)
    acc.backward(loss(s))
    acc.backward(loss(s))
    assert acc.optimizer_steps == 1
