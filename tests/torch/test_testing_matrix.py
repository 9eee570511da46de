"""The detection matrix of gradaccum.testing: a correct loop and seven buggy ones, written as a user
writes them (by hand, or with an Accumulator misused), each with clipping off and on.

Expected: no false alarm, and every bug caught, either named (the evidence singles it out) or
listed among the candidates; a cause named wrongly fails. "Clipping on" clips at 0.2 where the full
batch's gradient norm is 0.275 (0.2/0.275 of it for the token model), so that the reference clips.
"Off" clips nothing, except the loop whose bug is clipping every micro-batch: it clips at 0.5,
which the full batch's gradient (0.275) never reaches, so that only the bug's clipping binds.
"""

from functools import partial

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradaccum
from gradaccum.testing import assert_accumulation_exact

CLIP_ON = 0.2 / 0.275  # of the full batch's gradient norm
CLIP_UNREACHED = 0.5 / 0.275
FIXED_N = 4
VOCAB = 11
LENGTHS = (2, 6, 2, 5, 3, 2, 4, 3, 6, 2, 2, 3)  # 40 tokens, 28 after the shift


# Regression: a linear model from zeros; each half of the batch pulls the other way, so that a
# micro-batch's gradient is far larger than the window's (and clipping it per micro-batch binds).
def linear():
    model = nn.Linear(3, 2).double()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def regression():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    y = 0.3 * torch.randn(12, 2, generator=gen, dtype=torch.float64)
    y[:6] += 3.0
    y[6:] -= 3.0
    return x, y * (0.275 / _norm(linear, mse, (x, y)))  # the full batch's gradient norm: 0.275


# Tokens: a causal language model over padded sequences (labels -100 at padding).
def language_model():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def lm_loss(model, batch, reduction="mean"):
    ids, labels = batch
    logits = model(ids)[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits, labels[:, 1:].flatten(), reduction=reduction)


def tokens():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (12, 6), generator=gen)
    labels = ids.clone()
    for i, n in enumerate(LENGTHS):
        ids[i, n:], labels[i, n:] = 0, -100
    return ids, labels


def _norm(make_model, loss_fn, batch):
    torch.manual_seed(0)
    model = make_model()
    loss_fn(model, batch).backward()
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


def clip_(model, clip):
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)


# The loops. Each takes the helper's scheduler and a clip norm (None: no clipping).
def correct(model, optimizer, micro_batches, scheduler, clip=None, loss_fn=mse):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model, clip_norm=clip,
                                scheduler=scheduler)
    for batch in micro_batches:
        n_items = None if loss_fn is mse else gradaccum.count_tokens(batch[1], shift=True)
        acc.backward(loss_fn(model, batch), n_items=n_items)


def divided_twice(model, optimizer, micro_batches, scheduler, clip=None):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model, clip_norm=clip,
                                scheduler=scheduler)
    for batch in micro_batches:
        acc.backward(mse(model, batch) / len(micro_batches))  # the Accumulator divides already


def mean_of_means(model, optimizer, micro_batches, scheduler, clip=None):
    for batch in micro_batches:
        (lm_loss(model, batch) / len(micro_batches)).backward()
    clip_(model, clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def short_window(model, optimizer, micro_batches, scheduler, clip=None):
    for batch in micro_batches:
        (mse(model, batch) / FIXED_N).backward()  # the configured N, whatever the window holds
    clip_(model, clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def scheduler_per_micro_step(model, optimizer, micro_batches, scheduler, clip=None):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model, clip_norm=clip)
    for batch in micro_batches:
        acc.backward(mse(model, batch))
        scheduler.step()  # as in the loop before accumulation: once per batch


def clip_per_micro_step(model, optimizer, micro_batches, scheduler, clip=None):
    for batch in micro_batches:
        (mse(model, batch) / len(micro_batches)).backward()
        clip_(model, clip)  # inside the loop: clips each partial sum
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def zero_grad_forgotten(model, optimizer, micro_batches, scheduler, clip=None):
    for batch in micro_batches:
        (mse(model, batch) / len(micro_batches)).backward()
    clip_(model, clip)
    optimizer.step()
    scheduler.step()


def unshifted_count(model, optimizer, micro_batches, scheduler, clip=None):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model, clip_norm=clip,
                                scheduler=scheduler)
    for batch in micro_batches:  # count_tokens(labels) counts before the shift the loss makes
        acc.backward(lm_loss(model, batch, "sum"), n_items=gradaccum.count_tokens(batch[1]),
                     reduction="sum")


# name: (loop, data, what a correct name says, what a listed candidate says, clips by hand)
BUGS = {
    "divided twice": (divided_twice, "regression", "divided by the steps twice", "the steps twice", False),
    "mean of means": (mean_of_means, "tokens", "a mean of micro-batch means", "a per-micro-batch mean", True),
    "short window divided by N": (short_window, "regression", f"a short last window divided by N={FIXED_N}",
                                  "a fixed N on a window", True),
    # Refused by the Accumulator itself since issue 41: a learning rate changed inside the window.
    "scheduler per micro-step": (scheduler_per_micro_step, "regression", "changed inside the window",
                                 "changed inside the window", False),
    "clip per micro-step": (clip_per_micro_step, "regression", "clipped on every micro-batch",
                            "clipping on every micro-batch", True),
    "zero_grad forgotten": (zero_grad_forgotten, "regression", "zero_grad is missing", "zero_grad missing",
                            True),
    "unshifted count": (unshifted_count, "tokens", "an unshifted token count", "a token count taken before "
                        "the shift", False),
}
DATA = {"regression": (linear, mse, regression), "tokens": (language_model, lm_loss, tokens)}


def run_cell(loop, data, clip_on, by_hand, clip_always=False):
    """(caught, message): the helper on one loop; the clip norm given to it only for hand loops
    (for an Accumulator it reads the Accumulator's)."""
    make_model, loss_fn, make_batch = DATA[data]
    batch = make_batch()
    scale = CLIP_ON if clip_on else CLIP_UNREACHED if clip_always else None
    clip = None if scale is None else scale * _norm(make_model, loss_fn, batch)
    try:
        report = assert_accumulation_exact(partial(loop, clip=clip), make_model, batch, loss_fn=loss_fn,
                                           clip_norm=clip if by_hand else None)
    except AssertionError as err:
        return True, str(err)
    except RuntimeError as err:  # the Accumulator's own guards refused the loop, naming the fix
        return True, f"refused by the Accumulator: {err}"
    return False, str(report)


def verdict(message, named, listed):
    """"named" when a split's line names the cause, "listed" when the candidates hold it."""
    lines = message.splitlines()
    if message.startswith("refused by the Accumulator: ") and named in message:
        return "named"
    if any(": differs at window" in line and named in line for line in lines):
        return "named"
    if any("the candidates" in line and listed in line for line in lines):
        return "listed"
    return "missed"


@pytest.mark.parametrize("clip_on", [False, True], ids=["clip off", "clip on"])
@pytest.mark.parametrize("data", ["regression", "tokens"])
def test_a_correct_loop_passes(data, clip_on):
    caught, message = run_cell(partial(correct, loss_fn=DATA[data][1]), data, clip_on, by_hand=False)
    assert not caught, message
    assert ("as your Accumulator clips" in message) == clip_on


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the bug's own
@pytest.mark.parametrize("clip_on", [False, True], ids=["clip off", "clip on"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_every_bug_is_caught_and_never_misnamed(bug, clip_on):
    loop, data, named, listed, by_hand = BUGS[bug]
    caught, message = run_cell(loop, data, clip_on, by_hand, clip_always=bug == "clip per micro-step")
    assert caught, message
    assert verdict(message, named, listed) != "missed", message


def test_the_clipped_reference_is_what_makes_a_clipping_loop_pass():
    # The negative twin of the clipped rows: the same correct hand clipping, the helper not told.
    make_model, loss_fn, make_batch = DATA["regression"]

    def clipping(model, optimizer, micro_batches):
        for batch in micro_batches:
            (mse(model, batch) / len(micro_batches)).backward()
        clip_(model, 0.2)
        optimizer.step()
        optimizer.zero_grad()

    assert assert_accumulation_exact(clipping, make_model, make_batch(), loss_fn=loss_fn, clip_norm=0.2).exact
    with pytest.raises(AssertionError, match="pass clip_norm="):
        assert_accumulation_exact(clipping, make_model, make_batch(), loss_fn=loss_fn)
