"""The equivalence checker on token models: item-weighted losses, token ids drawn from a vocabulary."""

import pytest
import torch
from torch import nn

from gradaccum import check_equivalence, count_tokens

VOCAB = 13


def token_model():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


LENGTHS = (1, 2, 6, 6, 3, 1, 5, 4)  # micro-batches of 2 hold 3, 12, 4 and 9 tokens


def padded_batch(seq=6, seed=0):
    """Token ids and next-token targets, -100 after each sequence's own length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), seq), generator=gen)
    targets = torch.randint(0, VOCAB, (len(LENGTHS), seq), generator=gen)
    for i, length in enumerate(LENGTHS):
        targets[i, length:] = -100
    return ids, targets


def mean_loss(out, targets):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def weighted_loss(out, targets):
    return mean_loss(out, targets), count_tokens(targets)


def test_padded_token_model_is_not_equivalent_with_a_plain_mean_loss():
    ids, targets = padded_batch()
    report = check_equivalence(token_model, ids, 4, targets=targets, loss=mean_loss)
    assert not report.equivalent and not report.hazards
    assert max(d.rel for d in report.diffs) > 1e-3
    assert report.settings["n_items"] is None
    assert "let the loss return (loss, n_items)" in str(report).replace("\n", " ")


def test_padded_token_model_is_equivalent_with_loss_and_n_items():
    ids, targets = padded_batch()
    report = check_equivalence(token_model, ids, 4, targets=targets, loss=weighted_loss)
    assert report.equivalent, str(report)
    assert max(d.rel for d in report.diffs) < 1e-12
    total = int((targets != -100).sum())
    assert report.settings["n_items"] == total
    assert sum(report.settings["micro_n_items"]) == total
    assert len(report.settings["micro_n_items"]) == 4
    text = str(report).replace("\n", " ")
    assert ("Item-weighted: the loss returned (loss, n_items), so the full batch's loss is its mean "
            f"over its {total} items") in text


def test_named_token_cross_entropy_is_item_weighted():
    ids, targets = padded_batch()
    report = check_equivalence(token_model, ids, 4, targets=targets, loss="token-cross-entropy")
    assert report.equivalent, str(report)
    assert report.settings["loss"] == "token-cross-entropy"
    assert report.settings["n_items"] == int((targets != -100).sum())


def test_wrong_count_is_caught_and_hinted():
    # Counting one token too few per sequence (a causal LM count without shift, the other way
    # round) weights the micro-batches wrongly: the checker must see it.
    ids, targets = padded_batch()

    def off_by_one(out, t):
        return mean_loss(out, t), count_tokens(t, shift=True)

    report = check_equivalence(token_model, ids, 4, targets=targets, loss=off_by_one)
    assert not report.equivalent
    assert "pass n_items=count_tokens(labels), without shift=True" in str(report).replace("\n", " ")


def test_counts_that_do_not_add_up_are_noted():
    ids, targets = padded_batch()
    report = check_equivalence(token_model, ids, 4, targets=targets,
                               loss=lambda out, t: (mean_loss(out, t), 5))
    assert "Note: the micro-batches' n_items sum to 20 but the full batch's is 5" in \
        str(report).replace("\n", " ")


def test_vocab_draws_token_ids():
    seen = []

    class Spy(nn.Module):
        def forward(self, ids):
            seen.append(ids)
            return ids

    model = lambda: nn.Sequential(Spy(), nn.Embedding(VOCAB, 4), nn.Linear(4, VOCAB))  # noqa: E731
    report = check_equivalence(model, (5,), 2, micro_batch=3, vocab=VOCAB, loss="token-cross-entropy")
    assert report.equivalent, str(report)
    assert seen[0].dtype == torch.int64 and seen[0].shape == (6, 5)
    assert int(seen[0].min()) >= 0 and int(seen[0].max()) < VOCAB
    # Without vocab an embedding gets floats, and refuses them.
    with pytest.raises(RuntimeError):
        check_equivalence(model, (5,), 2, micro_batch=3, loss="token-cross-entropy")


def test_bad_token_arguments():
    ids, targets = padded_batch()
    with pytest.raises(ValueError, match="vocab=5 draws token ids for a sample shape"):
        check_equivalence(token_model, ids, 4, targets=targets, vocab=5)
    with pytest.raises(ValueError, match="vocab"):
        check_equivalence(token_model, (6,), 4, vocab=0)
    with pytest.raises(TypeError, match="return the same form for every batch"):
        calls = []

        def sometimes(out, t):
            calls.append(1)
            return weighted_loss(out, t) if len(calls) == 1 else mean_loss(out, t)

        check_equivalence(token_model, ids, 4, targets=targets, loss=sometimes)
    with pytest.raises(TypeError, match=r"return the mean loss \(a tensor\) or \(mean loss, n_items\)"):
        check_equivalence(token_model, ids, 4, targets=targets, loss=lambda out, t: {"loss": 1})
