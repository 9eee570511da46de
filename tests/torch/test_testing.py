"""gradaccum.testing: a user's own accumulation loop against the full batch, with the failure in words."""

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
        assert_accumulation_exact(not_divided, linear, regression_batch(), splits=(3,))


def test_a_loop_that_never_steps_says_so():
    def no_step(model, optimizer, micro_batches):
        for batch in micro_batches:
            mse(model, batch).backward()

    with pytest.raises(AssertionError, match="no update at all"):
        assert_accumulation_exact(no_step, linear, regression_batch(), loss_fn=mse)


def test_the_words():
    assert describe_update(0.5, 1.0, 2).startswith("0.5x the full batch: divided by the steps twice")
    assert "another direction" in describe_update(1.01, 0.99, 2)
    assert "wrong scale" in describe_update(0.3, 1.0, 2)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"splits": (5,)}, ValueError, "5 equal micro-batches do not divide 12"),
    ({"splits": ([5, 5],)}, ValueError, "summing to the 12 items"),
    ({"world_size": 5}, ValueError, "world_size=5"),
    ({"world_size": 2, "splits": (2,), "make_model": lambda: linear()}, TypeError,
     "make_model must be picklable"),
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


def test_the_recipe_in_the_doc_prints_what_the_page_shows(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "TESTING.md").read_text()
    code = re.search(r"<!-- recipe: testing -->\n```python\n(.*?)```", doc, re.S).group(1)
    exec(compile(code, "TESTING.md[testing]", "exec"), {})
    printed = re.search(r"\nprints\n\n```\n(.*?)```", doc, re.S).group(1)
    words = re.search(r"\(the `\.\.\.` stands for `(.*?)`\)", doc, re.S).group(1).replace("\n", " ")
    rounding = re.compile(r"\d\.\de-1\d")  # float64 rounding: its last digits may vary by machine
    expected = rounding.sub("R", printed.replace("...", words))
    assert rounding.sub("R", capsys.readouterr().out) == expected
