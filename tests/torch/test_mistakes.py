"""Common mistakes, each with the first words of its message and the fix the message names.

The table is the contract of docs/GUIDE.md's "Errors" section: every message says what is wrong
*and* what to do. A mistake raises before anything changes (checked by the last column's
``unchanged`` flag where the accumulator already holds a micro-batch).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
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


def damaged(s: dict[str, Any], where: tuple[str, ...], value: Any) -> None:
    """Load the fed accumulator's state with one field edited (a damaged checkpoint)."""
    state = fed(s)["acc"].state_dict()
    *path, key = where
    box = state
    for k in path:
        box = box[k]
    box[key] = value
    gradaccum.Accumulator(s["opt"], 4).load_state_dict(state)


def fill(s: dict[str, Any], make_loss: Callable[[dict[str, Any]], torch.Tensor]) -> None:
    """A whole window of ``make_loss``'s losses (a warning comes at its boundary)."""
    for _ in range(4):
        s["acc"].backward(make_loss(s))


def under_a_group_of_two(call: Callable[[], Any]) -> Callable[[dict[str, Any]], Any]:
    """``call`` as if a process group of 2 ranks were initialized (the check reads only these),
    and ``torch.distributed.pipelining`` not imported (where it is, the refusal waits for the first
    micro-batch: a pipeline stage's module; this worker may have imported it for another test)."""
    def run(s: dict[str, Any]) -> Any:
        with mock.patch.object(dist, "is_initialized", lambda: True), \
                mock.patch.object(dist, "get_world_size", lambda *a: 2), mock.patch.dict(sys.modules):
            sys.modules.pop("torch.distributed.pipelining", None)
            return call()
    return run


def no_grad_loss(s: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return loss(s)


# Every mistake of docs/GUIDE.md's "Errors" and "Failures" (and of its guards against your own
# step and zero_grad), with the fix its message names: a call or a setting to copy, never only
# the allowed range. (A forward around DDP's wrapper, the one more, needs two ranks:
# tests/distributed/test_items_ddp.py.)
MISTAKES: list[tuple[str, Callable[[dict[str, Any]], Any], type[Exception] | type[Warning], str, str]] = [
    # (mistake, the call, exception or warning, the message's first words, the fix it names)
    ("steps=0", lambda s: gradaccum.Accumulator(s["opt"], 0),
     ValueError, "steps must be a positive integer (>= 1), got 0",
     "steps=1, or a schedule such as steps={0: 4"),
    ("steps=-1", lambda s: gradaccum.Accumulator(s["opt"], -1),
     ValueError, "steps must be a positive integer (>= 1), got -1", "such as steps=1,"),
    ("steps=2.5", lambda s: gradaccum.Accumulator(s["opt"], 2.5),
     TypeError, "steps must be a positive integer, got 2.5 (float)", "such as steps=2,"),
    ('steps="2"', lambda s: gradaccum.Accumulator(s["opt"], "2"),
     TypeError, "steps must be a positive integer, got '2' (str)", "such as steps=2,"),
    ("steps=True", lambda s: gradaccum.Accumulator(s["opt"], True),
     TypeError, "steps must be a positive integer, got True (bool)", "such as steps=4,"),
    ("steps=None", lambda s: gradaccum.Accumulator(s["opt"], None),
     TypeError, "steps must be a positive integer, got None", "such as steps=4, or a schedule"),
    ("n_items=-1", lambda s: s["acc"].backward(loss(s), -1),
     ValueError, "n_items must be >= 0, got -1", "n_items=len(y)"),
    ("n_items=NaN", lambda s: s["acc"].backward(loss(s), float("nan")),
     ValueError, "n_items must be finite, got nan", "n_items=len(y)"),
    ("n_items=inf", lambda s: s["acc"].backward(loss(s), float("inf")),
     ValueError, "n_items must be finite, got inf", "gradaccum.count_tokens(labels)"),
    ("n_items beyond 2**53", lambda s: s["acc"].backward(loss(s), 2**53 + 1),
     ValueError, "n_items=9007199254740993 is beyond float64's exact integer range", "pass smaller counts"),
    ('n_items="4"', lambda s: s["acc"].backward(loss(s), "4"),
     TypeError, "n_items must be a number >= 0 or a 0-dim tensor, got '4'", "n_items=len(y)"),
    ("a bool mask as n_items", lambda s: s["acc"].backward(loss(s), torch.ones(4, dtype=torch.bool).any()),
     TypeError, "n_items must be a count or a weight, got a torch.bool tensor", "mask.sum()"),
    ("n_items=0 for a mean", lambda s: s["acc"].backward(loss(s), 0),
     ValueError, "n_items=0 with reduction='mean'", "reduction='sum'"),
    ("n_items=None for a sum", lambda s: s["acc"].backward(loss(s), reduction="sum"),
     ValueError, "n_items=None with reduction='sum'", "acc.backward(loss, n_items=n, reduction='sum')"),
    ("n_items on one micro-batch of a window only", lambda s: fed(s)["acc"].backward(loss(s), 4),
     ValueError, "n_items=4 mixes weightings", "on every micro-batch of a window or on none"),
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
    ("a detached loss", lambda s: s["acc"].backward(loss(s).detach()),
     ValueError, "loss does not require grad",
     "with grad enabled, and pass the tensor itself, not loss.detach()"),
    ("a loss computed under no_grad", lambda s: s["acc"].backward(no_grad_loss(s)),
     ValueError, "loss does not require grad", "compute it from the model's output with grad enabled"),
    ("the model passed as the optimizer", lambda s: gradaccum.Accumulator(s["model"], 4),
     TypeError, "optimizer must be a torch.optim.Optimizer, got the model", "SGD(model.parameters()"),
    ("model.parameters() passed as the optimizer",
     lambda s: gradaccum.Accumulator(s["model"].parameters(), 4),
     TypeError, "optimizer must be a torch.optim.Optimizer, got parameters", "SGD(model.parameters()"),
    ("clip_norm passed positionally (the seed tutorial's signature)",
     lambda s: gradaccum.Accumulator(s["opt"], 4, 1.0),
     TypeError, "Accumulator takes optimizer and steps positionally", "clip_norm=1.0"),
    ("clip_norm=0", lambda s: gradaccum.Accumulator(s["opt"], 4, clip_norm=0),
     ValueError, "clip_norm must be a finite number > 0, got 0", "clip_norm=1.0, or clip_norm=None"),
    ("clip_norm=-1", lambda s: gradaccum.Accumulator(s["opt"], 4, clip_norm=-1.0),
     ValueError, "clip_norm must be a finite number > 0, got -1.0", "clip_norm=1.0, or clip_norm=None"),
    ('clip_norm="1"', lambda s: gradaccum.Accumulator(s["opt"], 4, clip_norm="1"),
     TypeError, "clip_norm must be a positive number, got '1' (str)", "clip_norm=1.0"),
    ("a scheduler bound to another optimizer",
     lambda s: gradaccum.Accumulator(s["opt"], 4, scheduler=torch.optim.lr_scheduler.StepLR(
         torch.optim.SGD(s["model"].parameters(), lr=0.1), 1)),
     ValueError, "scheduler is bound to another optimizer", "StepLR(optimizer"),
    ("a scheduler that needs a metric", lambda s: gradaccum.Accumulator(
        s["opt"], 4, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(s["opt"])),
     TypeError, "scheduler ReduceLROnPlateau.step needs metrics", "scheduler.step(metric)"),
    ("an optimizer that needs a closure (LBFGS)",
     lambda s: gradaccum.Accumulator(torch.optim.LBFGS(s["model"].parameters()), 4),
     TypeError, "optimizer LBFGS needs a closure", "use an optimizer that steps without one (SGD, Adam"),
    ("model=None under a process group of 2 ranks", under_a_group_of_two(lambda: gradaccum.Accumulator(
        torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), 4)),
     ValueError, "model=None while a process group of 2 ranks", "sync='local'"),
    ("a checkpoint of another steps",
     lambda s: gradaccum.Accumulator(s["opt"], 2).load_state_dict(fed(s)["acc"].state_dict()),
     ValueError, "state was saved with steps=4, this accumulator has steps=2", "steps=4 to resume"),
    ("a checkpoint of another model",
     lambda s: gradaccum.Accumulator(torch.optim.SGD(nn.Linear(3, 5).parameters(), lr=0.1), 4)
     .load_state_dict(fed(s)["acc"].state_dict()),
     ValueError, "state was saved for other parameters", "optimizer holds the saved model's parameters"),
    ("a damaged checkpoint (micro_step)", lambda s: damaged(s, ("window", "micro_step"), 7),
     ValueError, "state['window']['micro_step'] must be in [0, 4)",
     "load the dict that state_dict() returned"),
    ("a damaged checkpoint (a counter)", lambda s: damaged(s, ("optimizer_steps",), -5),
     ValueError, "state['optimizer_steps'] must be a non-negative integer, got -5",
     "load the dict that state_dict() returned"),
    ("a loss from another model", lambda s: fill(s, lambda s: nn.Linear(3, 2)(s["x"]).pow(2).mean()),
     UserWarning, "no parameter of the optimizer received a gradient", "SGD(model.parameters())"),
    ("a detached graph", lambda s: fill(s, lambda s: (s["model"](s["x"]).detach()
                                                      * torch.ones(2, requires_grad=True)).pow(2).mean()),
     UserWarning, "no parameter of the optimizer received a gradient", "do not detach the model's output"),
    ("count_tokens of a list", lambda s: gradaccum.count_tokens([[1, 2, -100]]),
     TypeError, "labels must be a torch.Tensor, got a list", "torch.tensor(labels)"),
    ("count_tokens of a mask", lambda s: gradaccum.count_tokens(torch.ones(2, 3, dtype=torch.bool)),
     TypeError, "labels must be an integer tensor", "mask.sum()"),
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


def raised_or_warned(call: Callable[[dict[str, Any]], Any], kind: type) -> str:
    s = setup()
    if issubclass(kind, Warning):
        with pytest.warns(kind) as caught:
            call(s)
        return str(caught[0].message)
    with pytest.raises(kind) as err:
        call(s)
    return str(err.value)


@pytest.mark.parametrize("mistake, call, kind, first_words, fix", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_gets_one_message_that_names_the_fix(mistake, call, kind, first_words, fix):
    message = raised_or_warned(call, kind)
    assert message.startswith(first_words), message
    assert fix in message, message
    assert "\n" not in message
    # One or two sentences: what is wrong, then (after a colon, a semicolon or a full stop) what
    # to do.
    assert message.count(". ") <= 1, message
    assert re.search(r"[:;.] ", message[len(first_words):message.index(fix) + len(fix)]), message


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
