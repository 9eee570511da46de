"""gradaccum.testing on a matrix independent of its other tests (tests/torch/independent_matrix.py:
an MLP classifier, the same with BatchNorm, a token tagger over padded sequences, uneven splits).

Every correct loop passes; every buggy loop is caught, and every split that differs names its bug
(issue 34, item 10: of 20 such loops, 10 were named, 4 only listed among the candidates, 5 had no
fitting candidate, and on 2 ranks a manual all_reduce(SUM) got a fix that did not apply).
``python benchmarks/testing_matrix.py`` prints the same matrix as a table.
"""

import pytest
import torch

from gradaccum.testing import assert_accumulation_exact
from gradaccum.testing._combination import Reading, readable, solve, support_rule
from tests.torch import independent_matrix as m


@pytest.mark.parametrize("name", list(m.CORRECT))
def test_a_correct_loop_passes(name):
    caught, message = m.run_cell(m.CORRECT[name])
    assert not caught, message


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the bugs' own
@pytest.mark.filterwarnings("ignore:an Accumulator dropped with a partial window")
@pytest.mark.parametrize("name", list(m.BUGS))
def test_a_buggy_loop_is_caught_and_every_split_that_differs_names_it(name):
    cell = m.BUGS[name]
    caught, message = m.run_cell(cell)
    assert m.verdict(cell, caught, message) == "named", message
    assert "not singled out by the evidence" not in message, message


def test_the_named_causes_give_their_evidence():
    said = {name: m.run_cell(m.BUGS[name])[1] for name in ("zero_grad before step", "last micro-batch only",
                                                           "L2 every micro-step", "LR x k", "BatchNorm")}
    assert "differs by 0x" not in said["zero_grad before step"]
    assert "after 3 backward passes, then zero_grad() before the step" in said["zero_grad before step"]
    assert "weights the micro-batches' own gradients (0, 1) on 6+6, (0, 0, 1) on 5+4+3" in \
        said["last micro-batch only"]
    assert "1 backward pass in the window" in said["last micro-batch only"]
    assert "0.1 on 6+6, 0.2 on 5+4+3, 0 on 12, 0.2 on 4+4+4, 0.3 on 3+3+3+3" in said["L2 every micro-step"]
    assert "was 1: 1x, 2: 2x, 3: 3x, 4: 4x" in said["LR x k"]
    assert "no weighting of its micro-batches' own gradients on 6+6, 5+4+3" in said["BatchNorm"]


def test_clipping_per_micro_step_keeps_its_name_on_an_uneven_split():
    cell = m.BUGS["clip per micro-step, uneven"]
    message = m.run_cell(cell)[1]
    lines = message.splitlines()
    assert "3 micro-batches of 5+4+3: differs" in lines[2] and "clipped on every micro-batch" in lines[2]
    # the correct weighting of the micro-batches, clipped once per window, passes (the negative twin)
    caught, _ = m.run_cell(m.Cell(m.hand_item_weighted, "mlp", clip=m.CLIP_EACH))
    assert not caught


def test_a_squared_error_summed_and_never_divided_is_named_by_its_elements():
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(12, 3, dtype=torch.float64, generator=gen),
             torch.randn(12, 2, dtype=torch.float64, generator=gen))

    def summed(model, optimizer, micro_batches):
        for x, y in micro_batches:
            torch.nn.functional.mse_loss(model(x), y, reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(AssertionError) as err:
        assert_accumulation_exact(summed, lambda: torch.nn.Linear(3, 2).double(), batch,
                                  loss_fn=lambda model, b: torch.nn.functional.mse_loss(model(b[0]), b[1]))
    said = "24x the full batch: a loss summed over the 24 elements of batch[1] and never divided"
    assert said in str(err.value)


def test_a_gradient_is_read_as_weights_only_where_they_are_fixed_by_it():
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(3, 40, dtype=torch.float64, generator=gen)
    weights = torch.tensor([0.0, 0.25, 0.75], dtype=torch.float64)
    assert torch.allclose(solve(parts, weights @ parts, 1e-9), weights)
    assert solve(parts, torch.randn(40, dtype=torch.float64, generator=gen), 1e-6) is None  # no combination
    # too few entries to fix 3 weights, or rows nearly dependent: nothing is read
    assert not readable(parts[:, :4]) and readable(parts[:, :5])
    assert not readable(torch.stack([parts[0], parts[1], parts[0] + 1e-6 * parts[2]]))
    assert solve(parts[:, :4], weights @ parts[:, :4], 1e-9) is None


def test_a_rule_of_which_micro_batches_reached_the_step_is_named_only_when_one_alone_fits():
    def reading(sizes, kept):
        return Reading(sizes, torch.tensor([1.0 if i in kept else 0.0 for i in range(len(sizes))]), {})

    # 5+4+3 keeping the first: the first only, or the smaller dropped; 6+6 keeping both tells them apart
    assert support_rule([reading((5, 4, 3), {0})], 1e-6) is None
    assert support_rule([reading((5, 4, 3), {0}), reading((6, 6), {0, 1})], 1e-6) == "smaller dropped"
    # below one size (4) on every split: 5+4+3 keeps 5 and 4, 3+3+3+3 none
    assert support_rule([reading((5, 4, 3), {0, 1}), reading((3, 3, 3, 3), set()), reading((6, 6), {0, 1})],
                        1e-6) == "smaller dropped"
    assert support_rule([reading((5, 4, 3), {2}), reading((6, 6), {1})], 1e-6) == "last"
    assert support_rule([reading((5, 4, 3), {0, 1, 2}), reading((6, 6), {0, 1})], 1e-6) is None


@pytest.mark.slow
def test_on_two_ranks_a_correct_loop_passes_and_each_bug_is_named_with_a_fix_that_applies():
    said = {name: m.run_cell(cell) for name, cell in {**m.CORRECT_RANKS, **m.BUGS_RANKS}.items()}
    for name in m.CORRECT_RANKS:
        assert not said[name][0], said[name][1]
    for name, cell in m.BUGS_RANKS.items():
        assert m.verdict(cell, *said[name]) == "named", said[name][1]
    message = said["2 ranks: DDP + all_reduce(SUM)"][1]
    assert "pass model=ddp_model" not in message and "exact on one process" not in message
    assert "called all_reduce(SUM) on 4 gradients" in message and "is 2x the full batch's" in message


# Issue 41, item 8: the 14 loops of independent_matrix.BUGS from "clip before unscale" on had only
# candidates on b6bbc83 (or a wrong name); each is named now by test_a_buggy_loop_is_caught_...
def divided_by_first_items(model, optimizer, micro_batches):
    total = m.items(micro_batches[0])  # the first micro-batch's items, for the whole window
    for batch in micro_batches:
        (m.ce(model, batch) * m.items(batch) / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_two_causes_that_equal_counts_make_alike_are_both_said():
    # On splits whose micro-batches hold equal counts, N / n_first is k: the window divided by one
    # micro-batch's count gives what a loss never divided by k gives. Both are said, and what tells
    # them apart; an uneven split names the one (b6bbc83 named "not divided" alone).
    caught, message = m.run_cell(m.Cell(divided_by_first_items, "mlp", splits=m.EVEN))
    assert caught
    for line in m.split_words(message):
        assert "not divided by the steps" in line
        assert "or the window divided by one micro-batch's count" in line
        assert "an uneven split, splits=[[5, 4, 3]], tells them apart" in line
    caught, message = m.run_cell(m.Cell(divided_by_first_items, "mlp"))
    named = "the window divided by the first micro-batch's count, not the window's (sum the counts of all"
    assert all(named in w for w in m.split_words(message)), message
    assert "not divided by the steps" not in message


def test_a_count_rule_is_read_from_the_weights_over_the_full_batchs_own():
    from gradaccum.testing._ratios import Shares, ratio_rules

    def shares(sizes, coef):
        n = torch.tensor(sizes, dtype=torch.float64)
        return Shares(tuple(sizes), torch.tensor(coef, dtype=torch.float64), n / n.sum())

    # 12 items: the first added twice; every count times its own; the window by the first's count
    twice = [shares((6, 6), [1.0, 0.5]), shares((5, 4, 3), [10 / 12, 4 / 12, 3 / 12])]
    assert ratio_rules(twice, [12], 1e-9) == [("first counted", 2, 0)]
    own = [shares((6, 6), [3.0, 3.0]), shares((5, 4, 3), [25 / 12, 16 / 12, 9 / 12])]
    assert ratio_rules(own, [12], 1e-9) == [("own count", 0, 12)]
    first = [shares((6, 6), [1.0, 1.0]), shares((5, 4, 3), [1.0, 0.8, 0.6])]
    assert ratio_rules(first, [12], 1e-9) == [("first's count", 0, 12)]
    # even splits alone: the first's count and the last's are one, both said
    even = [shares((6, 6), [1.0, 1.0]), shares((3, 3, 3, 3), [1.0] * 4)]
    assert {r[0] for r in ratio_rules(even, [12], 1e-9)} >= {"first's count", "last's count"}
    # the full batch's own weights: no rule
    assert ratio_rules([shares((6, 6), [0.5, 0.5]), shares((5, 4, 3), [5 / 12, 4 / 12, 3 / 12])], [12],
                       1e-9) == []


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("name", ["decay by hand every micro-step", "n_items off by one",
                                  "summed loss given as a mean"])
def test_the_count_and_decay_rules_hold_in_float32(name, monkeypatch):
    # float32's evidence tolerance (1e-3) is no licence for a looser count: the batch's 84 token ids
    # are no count of what the loss sums, and a decay's factor is read to float32's rounding.
    def single(make):
        return lambda: make().float()

    def batch(make):
        return lambda: tuple(t.float() if t.is_floating_point() else t for t in make())

    monkeypatch.setattr(m, "DATA", {k: (single(a), f, batch(b)) for k, (a, f, b) in m.DATA.items()})
    cell = m.BUGS[name]
    caught, message = m.run_cell(cell)
    assert m.verdict(cell, caught, message) == "named", message
