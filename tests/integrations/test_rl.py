"""RL policy losses (every TRL loss type) through gradaccum.integrations.rl, against the full batch.

The recipe of docs/INTEGRATIONS.md runs on a tiny policy in float64: split into micro-batches
(4x2, 2x4, 3+3+2), on 2 gloo ranks (tests/integrations/rl_ranks.py), and with a generation batch
that feeds two windows (TRL's steps_per_generation). The reference takes one SGD step per window
on TRL's own loss over the whole window (one micro-batch, one process). TRL's own accumulation
is the negative twin where it is off.
"""

from __future__ import annotations

import functools

import pytest
import torch

from gradaccum.integrations.rl import LOSS_TYPES, policy_loss
from tests.integrations.common import run
from tests.integrations.policy import T, per_token_loss, rollouts, sliced, trl_loss
from tests.reference import tiny_lm

LR = 0.5
SPLITS = {"4x2": [2, 2, 2, 2], "2x4": [4, 4], "3+3+2": [3, 3, 2]}


def renamed(batch):
    """The rollout as the recipe reads it (TRL's name for the mask)."""
    return {**batch, "completion_mask": batch["mask"]}


def full_batch(loss_type, batch, windows):
    """One SGD step per window on TRL's loss over the whole window; windows: (start, stop)."""
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for start, stop in windows:
        window = sliced(batch, start, stop)
        ptl = per_token_loss(loss_type, model, window)
        trl_loss(loss_type, ptl, window["mask"], num_items_in_batch=window["mask"].sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def recipe_run(loss_type, batch, generations, steps, model=None):
    """The recipe over ``generations`` (each a list of micro-batch sizes), windows of ``steps``."""
    model = model if model is not None else tiny_lm()
    micro, start = [], 0
    for sizes in generations:
        micro.append([])
        for size in sizes:
            micro[-1].append(renamed(sliced(batch, start, start + size)))
            start += size
    run("rl-policy-loss", {
        "optimizer": torch.optim.SGD(model.parameters(), lr=LR), "model": model,
        "gradient_accumulation_steps": steps, "generation_batches": micro, "loss_type": loss_type,
        "compute_per_token_loss": functools.partial(per_token_loss, loss_type),
        "max_completion_length": T})
    return model


def trl_run(loss_type, batch, sizes, steps, steps_per_generation):
    """TRL's own accumulation: each micro-batch's loss as TRL reduces it, plain backwards, a step
    every ``steps`` micro-batches; dapo/cispo/vespo normalized by the generation batch's tokens."""
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = 0
    for i, size in enumerate(sizes):
        gen = i // steps_per_generation * steps_per_generation
        gen_stop = sum(sizes[:gen + steps_per_generation])
        inputs = sliced(batch, start, start + size)
        ptl = per_token_loss(loss_type, model, inputs)
        trl_loss(loss_type, ptl, inputs["mask"], accumulation_steps=steps,
                 num_items_in_batch=batch["mask"][sum(sizes[:gen]):gen_stop].sum(),
                 steps_per_generation=steps_per_generation).backward()
        start += size
        if (i + 1) % steps == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model


def diff(a, b):
    return max(float((p - q).detach().abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_every_trl_loss_type_has_a_mapping():
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_any_split_into_micro_batches_is_the_full_batch(loss_type):
    batch = rollouts(8)
    reference = full_batch(loss_type, batch, [(0, 8)])
    assert diff(reference, tiny_lm()) > 1e-4  # it trained
    for name, sizes in SPLITS.items():
        model = recipe_run(loss_type, batch, [sizes], steps=len(sizes))
        assert diff(model, reference) < 1e-12, name  # measured: at most 1.1e-16


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_trls_own_accumulation_is_off_on_an_uneven_split(loss_type):
    batch = rollouts(8)
    reference = full_batch(loss_type, batch, [(0, 8)])
    error = diff(trl_run(loss_type, batch, [3, 3, 2], steps=3, steps_per_generation=3), reference)
    if LOSS_TYPES[loss_type][0] == "tokens" and loss_type != "bnpo":
        assert error < 1e-12  # normalized by the generation batch's tokens, which is the window here
    else:
        assert error > 1e-5  # per-micro-batch normalizers weight micro-batches, not the items


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_a_generation_batch_feeding_two_windows_normalizes_each_window(loss_type):
    # steps_per_generation=4 micro-batches of 4 per generation batch, windows of 2 micro-batches:
    # one generation feeds two optimizer steps, each the mean over its own window.
    batch = rollouts(16, seed=1)
    reference = full_batch(loss_type, batch, [(0, 8), (8, 16)])
    model = recipe_run(loss_type, batch, [[4, 4, 4, 4]], steps=2)
    assert diff(model, reference) < 1e-12
    if LOSS_TYPES[loss_type][0] == "tokens" and loss_type != "bnpo":
        # TRL's dapo/cispo/vespo: the generation batch's token count, rescaled by GA / spg, scales
        # each window by (generation tokens / 2) / window tokens.
        trl = trl_run(loss_type, batch, [4, 4, 4, 4], steps=2, steps_per_generation=4)
        assert diff(trl, reference) > 1e-5


def test_policy_loss_refuses_bad_input():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"loss_type must be one of .* got 'ppo'"):
        policy_loss(torch.zeros(2, 3), mask, "ppo")
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        policy_loss(torch.zeros(2, 3), mask, "dr_grpo")
    with pytest.raises(ValueError, match=r"per_token_loss must be \(2, 3\) like the mask"):
        policy_loss(torch.zeros(3, 3), mask, "grpo")
    with pytest.raises(ValueError, match="mask must be"):
        policy_loss(torch.zeros(0, 3), torch.ones(0, 3), "grpo")


def test_an_empty_completion_counts_as_a_sequence_and_adds_no_token():
    ptl = torch.tensor([[1.0, 2.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert policy_loss(ptl, mask, "grpo")[1:] == (2, "mean")
    assert float(policy_loss(ptl, mask, "grpo").loss) == 0.75
    loss, n_items, reduction = policy_loss(ptl, mask, "bnpo")
    assert (float(loss), int(n_items), reduction) == (3.0, 2, "sum")
    assert float(policy_loss(ptl, mask, "dr_grpo", max_completion_length=4).loss) == 3.0 / 8



def test_two_ranks_with_uneven_micro_batches_are_the_full_batch(tmp_path):
    from tests.ranks import run_ranks, scenario

    ranks = run_ranks("tests.integrations.rl_ranks", tmp_path, world=2, timeout=120)
    batch = rollouts(8)
    for loss_type in LOSS_TYPES:
        reference = list(full_batch(loss_type, batch, [(0, 8)]).parameters())
        for got in scenario(ranks, loss_type):
            assert max(float((p - q).detach().abs().max())
                       for p, q in zip(got["params"], reference, strict=True)) < 1e-12, loss_type
