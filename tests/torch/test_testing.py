"""gradaccum.testing: a user's own accumulation loop against the full batch, with the failure in words
(the detection matrix of seven mistakes is test_testing_matrix.py)."""

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum.testing import assert_accumulation_exact, describe_update

VOCAB = 11


def token_model():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def padded_batch():
    """12 sequences of 1 to 6 tokens, labels -100 at padding: micro-batches hold unequal counts."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (12, 6), generator=gen)
    labels = torch.randint(0, VOCAB, (12, 6), generator=gen)
    for i, n in enumerate((1, 6, 2, 6, 3, 1, 5, 4, 6, 2, 1, 3)):
        labels[i, n:] = -100
    return ids, labels


def token_loss(model, batch):
    ids, labels = batch
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def gradaccum_step(model, optimizer, micro_batches):
    """The loop under test: gradaccum, item-weighted, model= for DDP."""
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
    for ids, labels in micro_batches:
        acc.backward(token_loss(model, (ids, labels)), n_items=gradaccum.count_tokens(labels))
    acc.flush()


def divided_twice(model, optimizer, micro_batches):
    n = len(micro_batches)
    for batch in micro_batches:
        (mse(model, batch) / n).backward()
    for p in model.parameters():
        p.grad /= n  # the second division: "average the accumulated gradients"
    optimizer.step()
    optimizer.zero_grad()


def per_micro_batch_mean(model, optimizer, micro_batches):
    for batch in micro_batches:
        (token_loss(model, batch) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def fixed_n(model, optimizer, micro_batches, n=4):
    """Divides by a configured N whatever the window holds (a short last window too)."""
    for ids, labels in micro_batches:
        loss = nn.functional.mse_loss(model(ids), labels)
        (loss / n).backward()
    optimizer.step()
    optimizer.zero_grad()


def not_divided(model, optimizer, micro_batches):
    for ids, labels in micro_batches:
        nn.functional.mse_loss(model(ids), labels).backward()
    optimizer.step()


def linear():
    return nn.Linear(3, 2).double()


def regression_batch():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(12, 3, generator=gen, dtype=torch.float64),
            torch.randn(12, 2, generator=gen, dtype=torch.float64))


def test_a_gradaccum_loop_is_exact_for_every_split():
    report = assert_accumulation_exact(gradaccum_step, token_model, padded_batch(), splits=(2, 4, [5, 5, 2]),
                                       loss_fn=token_loss)
    assert report.exact and [r.split for r in report.results] == [(6, 6), (3, 3, 3, 3), (5, 5, 2)]
    assert all(r.max_abs < 1e-12 and abs(r.ratio - 1) < 1e-12 for r in report.results)
    assert "exact" in str(report)


def test_a_loop_dividing_by_the_steps_twice_reads_quarter():
    with pytest.raises(AssertionError, match=r"0\.25x the full batch: divided by the steps twice") as err:
        assert_accumulation_exact(divided_twice, linear, regression_batch(), splits=(4,))
    assert "4 micro-batches of 3+3+3+3: differs" in str(err.value)


def test_a_mean_per_micro_batch_on_padded_tokens_is_named():
    with pytest.raises(AssertionError, match="per-micro-batch mean instead of per-token"):
        assert_accumulation_exact(per_micro_batch_mean, token_model, padded_batch(), splits=(2, 4),
                                  loss_fn=token_loss)


def test_the_same_hand_loop_is_exact_without_padding():
    # The negative twin: equal counts per micro-batch make the mean of means exact.
    ids, labels = padded_batch()
    assert_accumulation_exact(per_micro_batch_mean, token_model, (ids, torch.ones_like(labels)),
                              splits=(2, 4), loss_fn=token_loss)


def test_a_short_window_divided_by_the_configured_n_is_named():
    with pytest.raises(AssertionError, match=r"0\.75x the full batch: 3 micro-batches divided by 4: a "
                                             r"short last window divided by N=4"):
        assert_accumulation_exact(fixed_n, linear, regression_batch(), splits=(4, 3), loss_fn=mse)


def test_a_loop_that_never_divides_reads_n_times():
    with pytest.raises(AssertionError, match="3x the full batch: not divided by the steps"):
        assert_accumulation_exact(not_divided, linear, regression_batch(), splits=(3,), loss_fn=mse)
    # Without loss_fn the reference is the step on one micro-batch: a fixed N looks the same.
    with pytest.raises(AssertionError, match=r"candidates: not divided by the steps.*; a fixed N") as err:
        assert_accumulation_exact(not_divided, linear, regression_batch(), splits=(3,))
    assert "differs by 3x from the full batch" in str(err.value)


def test_a_loop_that_never_steps_says_so():
    def no_step(model, optimizer, micro_batches):
        for batch in micro_batches:
            mse(model, batch).backward()

    with pytest.raises(AssertionError, match="no update at all"):
        assert_accumulation_exact(no_step, linear, regression_batch(), loss_fn=mse)


def test_one_ratio_names_no_cause_only_candidates():
    # 0.5x on 2 micro-batches is the steps divided twice, a fixed N=4, a token count, a scheduler...
    words = describe_update(0.5, 1.0, 2)
    assert words.startswith("differs by 0.5x from the full batch; the candidates: ")
    assert "divided by the steps twice" in words and "a short last window divided by N=4" in words
    assert "a scheduler stepped per micro-batch" in words
    assert "another direction" in describe_update(1.01, 0.99, 2)
    assert describe_update(1.0, 1.0, 2, ok=True) == "1x the full batch: exact"
    assert describe_update(0.0, 1.0, 2).startswith("no update at all")


def test_a_fixed_n_on_two_micro_batches_is_not_called_divided_twice():
    # One ratio of 0.5 fits both; the splits of 1 to 4 micro-batches tell them apart.
    with pytest.raises(AssertionError) as err:
        assert_accumulation_exact(fixed_n, linear, regression_batch(), splits=(2,), loss_fn=mse)
    assert "a short last window divided by N=4" in str(err.value)
    assert "divided by the steps twice" not in str(err.value)


def test_an_unshifted_count_at_three_quarters_is_not_called_a_short_window():
    # Sequences of 4 tokens: 3 after the shift, so 3 micro-batches read 3/4, as 3 of a window of 4.
    ids = torch.randint(0, VOCAB, (12, 4), generator=torch.Generator().manual_seed(2))

    def lm_sum(model, batch):
        ids, labels = batch
        return nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                           reduction="sum")

    def step(model, optimizer, micro_batches):
        acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
        for batch in micro_batches:
            acc.backward(lm_sum(model, batch), n_items=gradaccum.count_tokens(batch[1]), reduction="sum")

    def lm_mean(model, batch):
        return lm_sum(model, batch) / gradaccum.count_tokens(batch[1], shift=True)

    with pytest.raises(AssertionError) as err:
        assert_accumulation_exact(step, token_model, (ids, ids.clone()), splits=(3,), loss_fn=lm_mean)
    assert "0.75x the full batch: an unshifted token count: the loss sums the 36 tokens" in str(err.value)
    assert "short last window" not in str(err.value)


def test_an_unshifted_count_as_n_items_of_a_mean_is_named_by_its_weighting():
    ids, labels = padded_batch()

    def lm_mean(model, batch):
        ids, labels = batch
        return nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    def step(model, optimizer, micro_batches):
        acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
        for batch in micro_batches:
            acc.backward(lm_mean(model, batch), n_items=gradaccum.count_tokens(batch[1]))

    with pytest.raises(AssertionError, match=r"an n_items that counts batch\[1\]'s tokens before the shift"):
        assert_accumulation_exact(step, token_model, (ids, labels), loss_fn=lm_mean)


def test_a_weighting_by_sequences_is_named_so_not_a_token_count():
    # n_items=len(batch): the number of sequences, which no label tensor's token count gives; the
    # 5+5+2 split tells it from a mean of micro-batch means (issue 34: it was only a candidate).
    def per_sequence(model, optimizer, micro_batches):
        acc = gradaccum.Accumulator(optimizer, len(micro_batches), model=model)
        for batch in micro_batches:
            acc.backward(token_loss(model, batch), n_items=len(batch[0]))

    with pytest.raises(AssertionError) as err:
        assert_accumulation_exact(per_sequence, token_model, padded_batch(), splits=(4, [5, 5, 2]),
                                  loss_fn=token_loss)
    lines = str(err.value).splitlines()
    named = "counts sequences (rows) or padded positions where the loss averages tokens"
    assert all(named in line for line in lines[1:3])
    assert "weighted by their rows" in lines[3] and "not singled out" not in str(err.value)
    assert "an n_items that counts batch" not in str(err.value)


def _clipped_at(divide_by):
    def step(model, optimizer, micro_batches):
        for batch in micro_batches:
            (mse(model, batch) / divide_by(len(micro_batches))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # binds on every split
        optimizer.step()
        optimizer.zero_grad()
    return step


def test_a_scale_that_clipping_hides_is_read_from_clip_grad_norms_epsilon():
    # Clipped on every split, a gradient k times (or 1/k times) the full batch's has the clipped
    # full batch's direction and a norm short of the clip norm by clip_grad_norm_'s 1e-6 / (s|g|):
    # in float64 that shortfall gives the scale s on every split, so the rule is named (issue 41,
    # item 8: on b6bbc83 only listed, "a gradient at another scale, which clipping hides").
    said = {}
    for rule, divide_by in (("not divided by the steps", lambda k: 1),
                            ("divided by the steps twice", lambda k: k * k)):
        with pytest.raises(AssertionError) as err:
            assert_accumulation_exact(_clipped_at(divide_by), linear, regression_batch(), loss_fn=mse,
                                      clip_norm=0.01)
        said[rule] = str(err.value)
        lines = said[rule].splitlines()
        assert all(rule in line and "clipping hides the scale while it binds" in line for line in lines[1:3])
        assert "not singled out" not in said[rule]
    assert "scaled by 1 on 1, 2 on 2, 3 on 3, 4 on 4 micro-batches" in said["not divided by the steps"]
    twice = "scaled by 1 on 1, 0.5 on 2, 0.3333 on 3, 0.25 on 4 micro-batches"
    assert twice in said["divided by the steps twice"]
    # the negative twin: divided by k, clipped the same, is exact
    assert assert_accumulation_exact(_clipped_at(lambda k: k), linear, regression_batch(), loss_fn=mse,
                                     clip_norm=0.01).exact


def test_what_no_known_mistake_gives_is_said_with_its_candidates():
    def rising_weights(model, optimizer, micro_batches):
        for i, batch in enumerate(micro_batches):
            (mse(model, batch) * (1 + 0.5 * i) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(AssertionError) as err:
        assert_accumulation_exact(rising_weights, linear, regression_batch(), loss_fn=mse)
    lines = str(err.value).splitlines()
    assert "differs by 1.35x" in lines[1] and "from the full batch, in another direction" in lines[1]
    assert lines[-1].startswith("  not singled out by the evidence; the candidates: a per-micro-batch mean")


def test_an_optimizer_stepped_per_micro_batch_is_counted():
    def no_accumulation(model, optimizer, micro_batches):
        for batch in micro_batches:
            mse(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()

    with pytest.raises(AssertionError, match="the optimizer stepped 2 times in window 1: the step does not"):
        assert_accumulation_exact(no_accumulation, linear, regression_batch(), splits=(2,), loss_fn=mse)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.3)


def plain_step(model, optimizer, micro_batches, scheduler=None):
    acc = gradaccum.Accumulator(optimizer, len(micro_batches), scheduler=scheduler)
    for batch in micro_batches:
        acc.backward(mse(model, batch))


def test_your_scheduler_is_stepped_by_your_step_when_it_takes_one_else_after_each_window():
    for step in (plain_step, lambda model, optimizer, batches: plain_step(model, optimizer, batches)):
        report = assert_accumulation_exact(step, linear, regression_batch(), loss_fn=mse, windows=4,
                                           make_scheduler=step_lr)
        assert report.exact and report.windows == 4 and "4 windows, your scheduler" in str(report)


def test_a_scheduler_your_step_takes_and_never_steps_is_named():
    def forgets_it(model, optimizer, micro_batches, scheduler):
        plain_step(model, optimizer, micro_batches)

    with pytest.raises(AssertionError, match="the scheduler stepped 0 times in window 1"):
        assert_accumulation_exact(forgets_it, linear, regression_batch(), loss_fn=mse, make_scheduler=step_lr)


def test_one_window_keeps_the_old_single_step_check():
    report = assert_accumulation_exact(gradaccum_step, token_model, padded_batch(), loss_fn=token_loss,
                                       windows=1)
    assert report.exact and report.windows == 1


def test_a_later_window_that_raises_raises_when_nothing_earlier_differs():
    calls = []

    def breaks_later(model, optimizer, micro_batches):
        calls.append(1)
        if len(calls) % 3 == 2:
            raise KeyError("second window")
        plain_step(model, optimizer, micro_batches)

    with pytest.raises(KeyError, match="second window"):
        assert_accumulation_exact(breaks_later, linear, regression_batch(), splits=(2,), loss_fn=mse)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"splits": (5,)}, ValueError, "5 equal micro-batches do not divide 12"),
    ({"splits": ([5, 5],)}, ValueError, "summing to the 12 items"),
    ({"world_size": 5}, ValueError, "world_size=5"),
    ({"world_size": 2, "splits": (2,), "make_model": lambda: linear()}, TypeError,
     "make_model must be picklable"),
    ({"windows": 0}, ValueError, "windows"),
    ({"clip_norm": -1.0}, ValueError, "clip_norm"),
    ({"make_scheduler": 3}, TypeError, "make_scheduler must be callable"),
    ({"make_scheduler": lambda opt: 3}, TypeError, "make_scheduler must return an LR scheduler"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = {"make_model": linear, **kwargs}
    with pytest.raises(error, match=match):
        assert_accumulation_exact(step_fn=not_divided, batch=regression_batch(), **args)


def test_two_gloo_ranks_each_splitting_their_share():
    report = assert_accumulation_exact(gradaccum_step, token_model, padded_batch(), splits=(1, 3),
                                       loss_fn=token_loss, world_size=2)
    assert report.exact and report.world_size == 2
    assert [r.split for r in report.results] == [(6,), (2, 2, 2)]
    assert "on each of 2 ranks" in str(report)


def rank_local_token_mean(model, optimizer, micro_batches):
    """Divides by this rank's tokens: DDP then averages two means of unequal counts."""
    n = sum(gradaccum.count_tokens(labels) for _, labels in micro_batches)
    for ids, labels in micro_batches:
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum")
        (loss / n).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.slow
def test_a_loop_exact_on_one_process_and_not_on_two_ranks_is_named_so():
    with pytest.raises(AssertionError) as err:
        assert_accumulation_exact(rank_local_token_mean, token_model, padded_batch(), splits=(2,),
                                  loss_fn=token_loss, world_size=2)
    assert "exact on one process, not on 2 ranks" in str(err.value)
    assert_accumulation_exact(rank_local_token_mean, token_model, padded_batch(), splits=(2, 4),
                              loss_fn=token_loss)  # the negative twin: one process


def test_the_recipe_in_the_doc_prints_what_the_page_shows(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "TESTING.md").read_text()
    code = re.search(r"<!-- recipe: testing -->\n```python\n(.*?)```", doc, re.S).group(1)
    exec(compile(code, "TESTING.md[testing]", "exec"), {})
    # (a results marker may stand between "prints" and the block: the page binds its numbers)
    printed = re.search(r"\nprints\n\n(?:<!-- results:.*?-->\n)?```\n(.*?)```", doc, re.S).group(1)
    words = re.search(r"\(the `\.\.\.` stands for `(.*?)`\)", doc, re.S).group(1).replace("\n", " ")
    rounding = re.compile(r"\d\.\de-1\d")  # float64 rounding: its last digits may vary by machine
    expected = rounding.sub("R", printed.replace("...", words))
    assert rounding.sub("R", capsys.readouterr().out) == expected
