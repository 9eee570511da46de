"""An independent detection matrix for gradaccum.testing: models, data and loops that the other
testing tests do not use (an MLP classifier, the same with BatchNorm, and a token tagger over
padded sequences), on uneven splits. Correct loops must pass; buggy ones must be caught, and each
split that differs must name the bug (a cause named wrongly, or only listed, fails).

The loops are written as users write them, at a module's top level so that the 2-rank cells can
send them to the ranks. ``run_cell`` runs one cell and ``verdict`` reads its message;
``benchmarks/testing_matrix.py`` prints the whole matrix as a table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gradaccum
from gradaccum.testing import assert_accumulation_exact

N_ITEMS = 12
CLASSES, FEATURES = 4, 5
VOCAB, TAGS, LENGTH = 13, 5, 7
LENGTHS = (3, 7, 2, 5, 1, 6, 4, 7, 2, 3, 5, 1)  # real tokens per sequence: 46 in all
L2 = 0.05  # the L2 penalty of the loops that add one
UNEVEN = (2, [5, 4, 3])
EVEN = (2, 4)


# ------------------------------------------------------------------------------ models and data
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()


def mlp_bn() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(),
                         nn.Linear(16, CLASSES)).double()


def tagger() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, TAGS)).double()


def classification() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(N_ITEMS, FEATURES, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (N_ITEMS,), generator=gen)


def tagged() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (N_ITEMS, LENGTH), generator=gen)
    tags = torch.randint(0, TAGS, (N_ITEMS, LENGTH), generator=gen)
    for i, n in enumerate(LENGTHS):
        ids[i, n:], tags[i, n:] = 0, -100
    return ids, tags


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    """The classifier's loss: the mean over the batch's items."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def tag_loss(model: nn.Module, batch: Any, reduction: str = "mean") -> torch.Tensor:
    """The tagger's loss: the mean over the real tokens (padding ignored)."""
    ids, tags = batch
    return F.cross_entropy(model(ids).flatten(0, 1), tags.flatten(), ignore_index=-100, reduction=reduction)


def penalty(model: nn.Module) -> torch.Tensor:
    return L2 * sum(p.pow(2).sum() for p in model.parameters())


def ce_l2(model: nn.Module, batch: Any) -> torch.Tensor:
    """The classifier's loss with an L2 penalty: the full batch's objective."""
    return ce(model, batch) + penalty(model)


def tokens(batch: Any) -> int:
    return int((batch[1] != -100).sum())


def items(batch: Any) -> int:
    return len(batch[0])


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.3)


def _norm(make_model: Any, loss_fn: Any, batch: Any) -> float:
    torch.manual_seed(0)
    model = make_model()
    loss_fn(model, batch).backward()
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


DATA = {"mlp": (mlp, ce, classification), "mlp+bn": (mlp_bn, ce, classification),
        "tagger": (tagger, tag_loss, tagged), "mlp+l2": (mlp, ce_l2, classification)}
# The clip norms, as a share of the full batch's gradient norm: "once" binds on the window;
# "each" binds on the first micro-batches' partial sums too (so that clipping each one shows).
CLIP_ONCE, CLIP_EACH = 0.7, 0.3


def clip_for(data: str, share: float) -> float:
    make_model, loss_fn, make_batch = DATA[data]
    return share * _norm(make_model, loss_fn, make_batch())


# ------------------------------------------------------------------------------ correct loops
def hand_mean_even(model, optimizer, micro_batches):
    """loss / k: exact on equal micro-batches of a per-item mean."""
    for batch in micro_batches:
        (ce(model, batch) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def hand_item_weighted(model, optimizer, micro_batches, loss_fn=ce, clip=None):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (loss_fn(model, batch) * items(batch) / total).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


def hand_token_weighted(model, optimizer, micro_batches):
    optimizer.zero_grad(set_to_none=True)
    total = sum(tokens(b) for b in micro_batches)
    for batch in micro_batches:
        (tag_loss(model, batch, "sum") / total).backward()
    optimizer.step()


def accumulator_tokens(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch), n_items=gradaccum.count_tokens(batch[1]))


def accumulator_clipped(model, optimizer, micro_batches, clip=1.0):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model, clip_norm=clip)
    for batch in micro_batches:
        acc.backward(ce(model, batch), n_items=items(batch))


def accumulator_scheduled(model, optimizer, micro_batches, scheduler):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model, scheduler=scheduler)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch), n_items=tokens(batch))


def accumulator_summed(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch, "sum"), n_items=tokens(batch), reduction="sum")


def hand_l2_once(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for i, batch in enumerate(micro_batches):
        loss = ce(model, batch) * items(batch) / total
        if i == 0:
            loss = loss + penalty(model)  # once per window
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def ddp_accumulator(model, optimizer, micro_batches):
    """The 2-rank loop: model= sums the token counts over the ranks."""
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch), n_items=gradaccum.count_tokens(batch[1]))


# ------------------------------------------------------------------------------ buggy loops
def divided_twice(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(ce(model, batch) / len(micro_batches), n_items=items(batch))  # it divides already


def not_divided(model, optimizer, micro_batches):
    for batch in micro_batches:
        ce(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad()


def mean_of_means_tokens(model, optimizer, micro_batches):
    for batch in micro_batches:
        (tag_loss(model, batch) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def mean_of_means_items(model, optimizer, micro_batches):
    hand_mean_even(model, optimizer, micro_batches)  # on uneven micro-batches


def fixed_n(model, optimizer, micro_batches, n=4):
    for batch in micro_batches:
        (ce(model, batch) / n).backward()
    optimizer.step()
    optimizer.zero_grad()


def scheduler_per_micro_step(model, optimizer, micro_batches, scheduler):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(ce(model, batch), n_items=items(batch))
        scheduler.step()


def zero_grad_forgotten(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total).backward()
    optimizer.step()


def step_per_micro_batch(model, optimizer, micro_batches):
    for batch in micro_batches:
        ce(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def window_left_pending(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches) + 1, model=model)  # off by one
    for batch in micro_batches:
        acc.backward(ce(model, batch), n_items=items(batch))


def clip_per_micro_step(model, optimizer, micro_batches, clip=1.0):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # inside the loop
    optimizer.step()
    optimizer.zero_grad()


def clip_per_micro_step_mean(model, optimizer, micro_batches, clip=1.0):
    for batch in micro_batches:
        (ce(model, batch) / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


def lr_times_k(model, optimizer, micro_batches):
    for group in optimizer.param_groups:
        group["lr"] *= len(micro_batches)  # "the window is k batches": linear scaling
    hand_item_weighted(model, optimizer, micro_batches)


def batchnorm_accumulator(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(ce(model, batch), n_items=items(batch))


def n_items_sequences(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch), n_items=len(batch[0]))  # sequences, not tokens


def n_items_sequences_summed(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch, "sum"), n_items=len(batch[0]), reduction="sum")


def zero_grad_every_micro_step(model, optimizer, micro_batches):
    for batch in micro_batches:
        optimizer.zero_grad()
        (ce(model, batch) / len(micro_batches)).backward()
    optimizer.step()


def drop_smaller(model, optimizer, micro_batches):
    size = len(micro_batches[0][0])
    kept = [b for b in micro_batches if len(b[0]) == size]  # "drop_last": the short ones
    for batch in kept:
        (ce(model, batch) / len(kept)).backward()
    optimizer.step()
    optimizer.zero_grad()


def last_micro_batch_only(model, optimizer, micro_batches):
    for batch in micro_batches:
        loss = ce(model, batch)  # overwritten: only the last one is kept
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def l2_every_micro_step(model, optimizer, micro_batches, clip=None):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total + penalty(model)).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


def zero_grad_before_step(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total).backward()
    optimizer.zero_grad()
    optimizer.step()


def token_sum_undivided(model, optimizer, micro_batches):
    for batch in micro_batches:
        tag_loss(model, batch, "sum").backward()  # the summed loss, never divided by the tokens
    optimizer.step()
    optimizer.zero_grad()


def item_sum_undivided(model, optimizer, micro_batches):
    for x, y in micro_batches:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    optimizer.step()
    optimizer.zero_grad()


def backward_twice(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        loss = ce(model, batch) * items(batch) / total
        loss.backward(retain_graph=True)  # once to "check" the gradient...
        loss.backward()  # ...and once for real
    optimizer.step()
    optimizer.zero_grad()


def ddp_all_reduce_sum(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total).backward()
    if dist.is_initialized():
        for p in model.parameters():
            dist.all_reduce(p.grad)  # on top of DDP's average: SUM
    optimizer.step()
    optimizer.zero_grad()


def ddp_rank_local_tokens(model, optimizer, micro_batches):
    total = sum(tokens(b) for b in micro_batches)  # this rank's tokens: DDP then averages 2 means
    for batch in micro_batches:
        (tag_loss(model, batch, "sum") / total).backward()
    optimizer.step()
    optimizer.zero_grad()


# Issue 41, item 8: loops the helper had only candidates for on b6bbc83 (or named wrongly).
LOSS_SCALE = 2.0 ** 16  # a GradScaler's scale at the start


def clip_before_unscale(model, optimizer, micro_batches, clip=1.0):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total * LOSS_SCALE).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # the gradient still scaled
    for p in model.parameters():
        p.grad /= LOSS_SCALE  # unscaled after the clip
    optimizer.step()
    optimizer.zero_grad()


def loss_scale_not_undone(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total * LOSS_SCALE).backward()
    optimizer.step()  # optimizer.step(), not scaler.step(optimizer)
    optimizer.zero_grad()


def clip_each_own(model, optimizer, micro_batches, clip=1.0):
    total = sum(items(b) for b in micro_batches)
    window = [torch.zeros_like(p) for p in model.parameters()]
    for batch in micro_batches:
        optimizer.zero_grad()
        (ce(model, batch) * items(batch) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # this micro-batch's share alone
        for w, p in zip(window, model.parameters(), strict=True):
            w += p.grad
    for w, p in zip(window, model.parameters(), strict=True):
        p.grad = w
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


def first_skipped(model, optimizer, micro_batches):
    rest = micro_batches[1:]  # the first kept aside (a "peek" at the data), never trained on
    total = max(sum(items(b) for b in rest), 1)
    for batch in rest:
        (ce(model, batch) * items(batch) / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def first_twice(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for i, batch in enumerate(micro_batches):
        loss = ce(model, batch) * items(batch) / total
        if i == 0:
            loss.backward(retain_graph=True)  # a warm-up backward, kept
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def summed_given_as_mean(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch, "sum"), n_items=tokens(batch))  # reduction="sum" missing


def mean_given_as_sum(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch), n_items=tokens(batch), reduction="sum")  # a mean loss


def decay_by_hand_per_micro_step(model, optimizer, micro_batches, decay=0.1):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 - decay * optimizer.param_groups[0]["lr"])  # decoupled decay, per micro-batch
    optimizer.step()
    optimizer.zero_grad()


def scheduler_before_step(model, optimizer, micro_batches, scheduler):
    scheduler.step()  # at the top of the window
    hand_item_weighted(model, optimizer, micro_batches)


def first_count_for_window(model, optimizer, micro_batches):
    total = tokens(micro_batches[0])  # the first micro-batch's tokens, for the whole window
    for batch in micro_batches:
        (tag_loss(model, batch, "sum") / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def n_items_off_by_one(model, optimizer, micro_batches):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for batch in micro_batches:
        acc.backward(tag_loss(model, batch, "sum"), n_items=tokens(batch) + 1, reduction="sum")


def same_micro_batch_every_time(model, optimizer, micro_batches):
    for _ in range(len(micro_batches)):
        batch = micro_batches[0]  # as next(iter(loader)) inside the loop: the first batch each time
        (ce(model, batch) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def clamp_per_micro_step(model, optimizer, micro_batches):
    total = sum(items(b) for b in micro_batches)
    for batch in micro_batches:
        (ce(model, batch) * items(batch) / total).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)  # inside the loop
    optimizer.step()
    optimizer.zero_grad()


def not_divided_clipped(model, optimizer, micro_batches, clip=1.0):
    for batch in micro_batches:
        ce(model, batch).backward()  # the sum of k means
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


# ------------------------------------------------------------------------------ the cells
@dataclass(frozen=True)
class Cell:
    """A loop on its data; ``named``: what a split's line must say (None: a correct loop)."""

    loop: Any
    data: str
    named: str | None = None
    splits: tuple[Any, ...] = UNEVEN
    world: int = 1
    clip: float | None = None  # a share of the full batch's gradient norm: the loop's clip_norm
    tell_clip: bool = True  # pass the clip norm to the helper (a hand loop); else it reads it
    kwargs: dict[str, Any] = field(default_factory=dict)


CORRECT = {
    "loss / k, even splits": Cell(hand_mean_even, "mlp", splits=EVEN),
    "item-weighted by hand": Cell(hand_item_weighted, "mlp"),
    "token-weighted by hand": Cell(hand_token_weighted, "tagger"),
    "Accumulator, n_items tokens": Cell(accumulator_tokens, "tagger"),
    "Accumulator, clipped": Cell(accumulator_clipped, "mlp", clip=CLIP_ONCE, tell_clip=False),
    "clipped once by hand": Cell(hand_item_weighted, "mlp", clip=CLIP_ONCE),
    "Accumulator, scheduled": Cell(accumulator_scheduled, "tagger", kwargs={"make_scheduler": step_lr}),
    "AdamW, token-weighted": Cell(hand_token_weighted, "tagger", kwargs={"make_optimizer": adamw}),
    "Accumulator, summed loss": Cell(accumulator_summed, "tagger"),
    "L2 once per window": Cell(hand_l2_once, "mlp+l2"),
}
CORRECT_RANKS = {"2 ranks: Accumulator model=": Cell(ddp_accumulator, "tagger", splits=(1, 3), world=2)}

BUGS = {
    "divided twice": Cell(divided_twice, "mlp", "divided by the steps twice"),
    "not divided": Cell(not_divided, "mlp", "not divided by the steps"),
    "mean of means, tokens": Cell(mean_of_means_tokens, "tagger", "a mean of micro-batch means"),
    "mean of means, uneven items": Cell(mean_of_means_items, "mlp", "a mean of micro-batch means"),
    "fixed N=4, short window": Cell(fixed_n, "mlp", "divided by 4", splits=(4, 3)),
    # Refused by the Accumulator itself since issue 41 (a learning rate changed inside the window).
    "scheduler per micro-step": Cell(scheduler_per_micro_step, "mlp", "changed inside the window"),
    "zero_grad forgotten": Cell(zero_grad_forgotten, "mlp", "zero_grad is missing"),
    "step per micro-batch": Cell(step_per_micro_batch, "mlp", "the optimizer stepped"),
    "window left pending": Cell(window_left_pending, "mlp", "no update at all"),
    "clip per micro-step": Cell(clip_per_micro_step_mean, "mlp", "clipped on every micro-batch",
                                splits=EVEN, clip=CLIP_EACH),
    "clip per micro-step, uneven": Cell(clip_per_micro_step, "mlp", "clipped on every micro-batch",
                                        clip=CLIP_EACH),
    "LR x k": Cell(lr_times_k, "mlp", "the learning rate multiplied by"),
    "BatchNorm": Cell(batchnorm_accumulator, "mlp+bn", "BatchNorm1d"),
    "n_items = sequences": Cell(n_items_sequences, "tagger", "counts sequences"),
    "n_items = sequences, summed loss": Cell(n_items_sequences_summed, "tagger",
                                             "divided by its 12 sequences"),
    "zero_grad every micro-step": Cell(zero_grad_every_micro_step, "mlp", "zero_grad() runs before every"),
    "drop the smaller micro-batches": Cell(drop_smaller, "mlp", "smaller micro-batch"),
    "last micro-batch only": Cell(last_micro_batch_only, "mlp", "backward() runs once, on the last"),
    "L2 every micro-step": Cell(l2_every_micro_step, "mlp+l2", "L2 penalty added on every micro-batch"),
    "L2 every micro-step, clipped": Cell(l2_every_micro_step, "mlp+l2",
                                         "L2 penalty added on every micro-batch", clip=CLIP_ONCE),
    "zero_grad before step": Cell(zero_grad_before_step, "mlp", "zero_grad() runs before step()"),
    "token sum never divided": Cell(token_sum_undivided, "tagger",
                                    "summed over the 46 tokens of batch[1] and never divided"),
    "backward twice per micro-batch": Cell(backward_twice, "mlp", "backward() runs 2 times on each"),
    "item sum never divided": Cell(item_sum_undivided, "mlp",
                                   "summed over the 12 items of the batch and never"),
    "BatchNorm, and the last micro-batch only": Cell(
        last_micro_batch_only, "mlp+bn", "BatchNorm1d ('1') normalizes each micro-batch with its own mean "
        "and variance in training: no loop over micro-batches gives the full batch's gradient (window "
        "BatchNorm, GroupNorm or frozen statistics: docs/BATCHNORM.md); and only the last micro-batch"),
    # issue 41, item 8 (b6bbc83: only candidates, or a wrong name)
    "clip before unscale": Cell(clip_before_unscale, "mlp", "clipped before the loss scale was undone",
                                clip=CLIP_ONCE),
    "loss scale not undone": Cell(loss_scale_not_undone, "mlp", "a loss scale not undone: the gradient is "
                                  "2**16"),
    "each micro-batch clipped on its own": Cell(clip_each_own, "mlp", "gradient clipped on its own",
                                                clip=CLIP_EACH),
    "first micro-batch skipped": Cell(first_skipped, "mlp", "the first micro-batch's gradient never reached"),
    "first micro-batch twice": Cell(first_twice, "mlp", "the first micro-batch's gradient added 2 times"),
    "summed loss given as a mean": Cell(summed_given_as_mean, "tagger", "multiplied by its own count"),
    "mean loss given as a sum": Cell(mean_given_as_sum, "tagger", "divided by its own count"),
    "decay by hand every micro-step": Cell(
        decay_by_hand_per_micro_step, "mlp",
        "a weight decay applied by hand after every micro-batch's backward (the parameters times 1 - 0.1"),
    "scheduler before the step": Cell(scheduler_before_step, "mlp", "scheduler.step() runs before "
                                      "optimizer.step()"),
    "window divided by the first count": Cell(first_count_for_window, "tagger",
                                              "the window divided by the first micro-batch's count"),
    "n_items off by one": Cell(n_items_off_by_one, "tagger",
                               "a count off by 1 on every micro-batch: the window divided by the batch's 46"),
    "not divided, clipped": Cell(not_divided_clipped, "mlp", "not divided by the steps", clip=CLIP_ONCE),
    "the same micro-batch every time": Cell(same_micro_batch_every_time, "mlp",
                                            "the first micro-batch fed k times"),
    "clip_grad_value_ every micro-step": Cell(clamp_per_micro_step, "mlp",
                                              "clamped entry by entry at 0.02 after every micro-batch"),
}
BUGS_RANKS = {
    "2 ranks: DDP + all_reduce(SUM)": Cell(ddp_all_reduce_sum, "mlp", "remove the all_reduce", splits=(1, 3),
                                           world=2),
    "2 ranks: token counts per rank": Cell(ddp_rank_local_tokens, "tagger", "not on 2 ranks", splits=(1, 3),
                                           world=2),
}


def run_cell(cell: Cell) -> tuple[bool, str]:
    """(caught, message): the helper on one cell."""
    make_model, loss_fn, make_batch = DATA[cell.data]
    kwargs = dict(cell.kwargs)
    loop = cell.loop
    if cell.clip is not None:
        clip = clip_for(cell.data, cell.clip)
        loop = partial(loop, clip=clip)
        if cell.tell_clip:
            kwargs["clip_norm"] = clip
    try:
        report = assert_accumulation_exact(loop, make_model, make_batch(), splits=cell.splits,
                                           loss_fn=loss_fn, world_size=cell.world, **kwargs)
    except AssertionError as err:
        return True, str(err)
    except RuntimeError as err:  # the Accumulator's own guards refused the loop, naming the fix
        return True, f"{REFUSED}{err}"
    return False, str(report)


REFUSED = "refused by the Accumulator: "


def split_words(message: str) -> list[str]:
    """What each split that differs says (after its max abs diff)."""
    return [line.split("): ", 1)[1] for line in message.splitlines() if ": differs at window" in line]


def is_named(words: str) -> bool:
    """A split's words name a cause (rather than give the difference and leave it to the candidates)."""
    return not words.startswith("differs by")


def verdict(cell: Cell, caught: bool, message: str) -> str:
    """``pass``/``false alarm`` for a correct loop; for a bug ``named`` (every split that differs names
    it), ``misnamed`` (a split names another cause), ``listed`` (its name among the candidates only),
    ``unnamed``, or ``missed``."""
    if cell.named is None:
        return "false alarm" if caught else "pass"
    if not caught:
        return "missed"
    if message.startswith(REFUSED):
        return "named" if cell.named in message else "misnamed"
    said = split_words(message)
    if said and all(cell.named in w for w in said):
        return "named"
    if any(is_named(w) and cell.named not in w for w in said):
        return "misnamed"
    return "listed" if cell.named in message else "unnamed"


def cause(message: str) -> str:
    """The first named cause in ``message`` (or its first split's difference), for a table."""
    if message.startswith(REFUSED):
        return REFUSED + message[len(REFUSED):].split(":", 1)[0]
    said = split_words(message)
    named = [w for w in said if is_named(w)]
    return (named or said or ["-"])[0]
