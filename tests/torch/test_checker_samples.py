"""The checker's samples as keyword arguments, its tolerance following the loss's dtype, and the
count hint that names the count the loss averaged over (a Hugging Face GPT-2 included)."""

import pytest
import torch
from torch import nn

from gradaccum import check_equivalence, count_tokens

VOCAB, SEQ = 13, 6


class Masked(nn.Module):
    """Takes keyword arguments only, as a Hugging Face model: ids, a mask and a constant flag."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.flags = []

    def forward(self, *, input_ids, attention_mask, scale=1.0):
        self.flags.append(scale)
        return self.out(torch.tanh(self.emb(input_ids) * attention_mask[..., None] * scale))


def lm():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def padded(pad=-100, seed=0):
    """Ids and next-token labels of 8 sequences, ``pad`` after each one's length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (8, SEQ), generator=gen)
    for i, length in enumerate((1, 2, 6, 6, 3, 1, 5, 4)):
        labels[i, length:] = pad
    return ids, labels


def mean_loss(out, t, ignore_index=-100):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1), ignore_index=ignore_index)


def text(report):
    return str(report).replace("\n", " ")


# --- samples as keyword arguments ---

def test_a_dict_sample_is_passed_as_keyword_arguments_and_split():
    ids, labels = padded()
    sample = {"input_ids": ids, "attention_mask": (labels != -100).long(), "scale": 0.5}
    model = Masked()
    report = check_equivalence(model, sample, 4, loss=lambda out, t: (mean_loss(out, t), count_tokens(t)),
                               targets=labels)
    assert report.equivalent, str(report)
    assert report.settings["batch"] == 8 and report.settings["micro_n_items"] == [3, 12, 4, 9]
    assert model.flags == []  # the caller's model is copied, never run


def test_a_dict_samples_labels_are_the_default_targets():
    ids, labels = padded()
    seen = []

    def loss(out, t):
        seen.append(t)
        return mean_loss(out, t), count_tokens(t)

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm()

        def forward(self, input_ids, labels):  # a model that takes its labels, as HF's do
            return self.lm(input_ids)

    report = check_equivalence(Wrapper, {"input_ids": ids, "labels": labels}, 4, loss=loss)
    assert report.equivalent, str(report)
    assert torch.equal(seen[0], labels) and report.settings["n_items"] == 28


def test_a_module_fed_keyword_arguments_is_still_traced():
    class KwBatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)

        def forward(self, *, x):
            return self.bn(self.lin(x))

    report = check_equivalence(KwBatchNorm, {"x": torch.randn(8, 4)}, 2)
    assert [h.module for h in report.hazards] == ["bn"]


@pytest.mark.parametrize(("sample", "error", "match"), [
    ({"input_ids": torch.zeros(8, 3), "mask": torch.zeros(6, 3)}, ValueError, "first .batch. dimension"),
    ({1: torch.zeros(8, 3)}, TypeError, "keys must be strings"),
    ({"scale": 1.0}, TypeError, "dict of keyword arguments"),
])
def test_bad_dict_samples_name_themselves(sample, error, match):
    with pytest.raises(error, match=match):
        check_equivalence(lm, sample, 2)


# --- the tolerance follows the loss's precision ---

def float32_loss(out, t):
    """A float64 model's loss computed in float32, as Hugging Face's loss upcasts to float."""
    return nn.functional.mse_loss(out.float(), t.float())


def test_a_float32_loss_of_a_float64_model_is_judged_at_float32():
    net = lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))  # noqa: E731
    # micro-batches of 4 against 12: float32 rounds the loss gradient's /12 and /4 differently
    report = check_equivalence(net, (4,), 3, micro_batch=4, loss=float32_loss)
    assert report.equivalent, str(report)
    s = report.settings
    assert (s["dtype"], s["loss_dtype"], s["judged_dtype"]) == ("float64", "float32", "float32")
    assert (s["atol"], s["rtol"]) == (1e-6, 1e-4)
    assert "The loss is float32 while the model is float64" in text(report)
    worst = max(d.rel for d in report.diffs)
    assert worst > 1e-12  # float32 rounding: float64's tolerance would have refused it
    strict = check_equivalence(net, (4,), 3, micro_batch=4, loss=float32_loss, atol=1e-12, rtol=1e-9)
    assert not strict.equivalent  # explicit tolerances still win


def test_a_float64_loss_keeps_float64s_tolerance():
    report = check_equivalence(lm, (SEQ,), 2, micro_batch=4, vocab=VOCAB, loss="token-cross-entropy")
    assert report.settings["judged_dtype"] == "float64" and report.settings["atol"] == 1e-12
    assert "The loss is" not in text(report)


# --- the count hint names the real mismatch ---

def test_an_unshifted_count_of_a_shifting_loss_suggests_shift():
    ids, labels = padded()

    def loss(out, t):  # a causal LM's loss: position i predicts label i + 1
        return mean_loss(out[:, :-1], t[:, 1:]), count_tokens(t)

    report = check_equivalence(lm, ids, 4, targets=labels, loss=loss)
    assert not report.equivalent
    assert ("n_items counts 28 items but the loss averaged over 20, one fewer in each sequence that "
            "has labels (8 sequences)") in text(report)
    assert "pass n_items=count_tokens(labels, shift=True)" in text(report)
    fixed = lambda out, t: (loss(out, t)[0], count_tokens(t, shift=True))  # noqa: E731
    assert check_equivalence(lm, ids, 4, targets=labels, loss=fixed).equivalent


def test_a_shifted_count_of_an_unshifted_loss_says_drop_shift():
    ids, labels = padded()
    report = check_equivalence(lm, ids, 4, targets=labels,
                               loss=lambda out, t: (mean_loss(out, t), count_tokens(t, shift=True)))
    assert "n_items counts 20 items but the loss averaged over 28" in text(report)
    assert "pass n_items=count_tokens(labels), without shift=True" in text(report)


def test_minus_one_padding_names_both_totals_and_no_shift():
    # nanoGPT pads with -1: a count of the -100 labels counts every position.
    ids, labels = padded(pad=-1)
    report = check_equivalence(lm, ids, 4, targets=labels,
                               loss=lambda out, t: (mean_loss(out, t, -1), count_tokens(t)))
    assert not report.equivalent
    assert "n_items counts 48 items but the loss averaged over 28" in text(report)
    assert "count_tokens(labels, ignore_index=-1)" in text(report)
    assert "shift" not in text(report)


def test_a_count_off_by_a_constant_names_both_totals():
    ids, labels = padded()
    report = check_equivalence(lm, ids, 4, targets=labels,
                               loss=lambda out, t: (mean_loss(out, t), count_tokens(t) + 1))
    assert not report.equivalent
    assert ("n_items counts 32 items but the loss averaged over 28: the loss values fit a mean over "
            "count_tokens(labels) (per micro-batch 3, 12, 4, 9, against the 4, 13, 5, 10 passed)"
            ) in text(report)
    assert "shift" not in text(report)


def test_a_loss_that_is_no_mean_over_any_count_names_the_total_only():
    ids, labels = padded()

    def loss(out, t):  # a sum over the tokens divided by a constant: no count fits
        summed = nn.functional.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1), reduction="sum")
        return summed / 10, count_tokens(t)

    report = check_equivalence(lm, ids, 4, targets=labels, loss=loss)
    assert not report.equivalent
    assert "The micro-batches' n_items sum to 28; no count of the targets" in text(report)
    assert "shift=True" not in text(report)


def test_a_micro_batch_without_items_is_named_not_raised():
    ids, labels = padded()
    labels[:2] = -100  # micro-batch 0 holds no label
    report = check_equivalence(lm, ids, 4, targets=labels,
                               loss=lambda out, t: (mean_loss(out, t), count_tokens(t)))
    assert not report.equivalent
    assert [(h.module, h.kind) for h in report.hazards] == [("(micro-batch 0)", "no items")]
    assert "reduction='sum'" in report.hazards[0].fix


# --- the documented Hugging Face recipe, on a float64 GPT-2 ---

def gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def hf_batch():
    """8 right-padded sequences of 1 to 16 tokens: input_ids, attention_mask, labels."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (8, 16), generator=gen)
    mask = (torch.arange(16) < torch.randint(1, 17, (8,), generator=gen)[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_the_hugging_face_recipe_is_equivalent_on_a_float64_gpt2():
    pytest.importorskip("transformers")
    report = check_equivalence(
        gpt2, hf_batch(), 4, loss=lambda out, labels: (out.loss, count_tokens(labels, shift=True)))
    assert report.equivalent, str(report)
    assert report.settings["loss_dtype"] == "float32" and report.settings["dtype"] == "float64"
    named = check_equivalence(gpt2, hf_batch(), 4, loss="causal-lm")
    assert named.equivalent and named.diffs == report.diffs


def test_the_hugging_face_recipe_without_shift_is_refused_and_told_to_shift():
    pytest.importorskip("transformers")
    report = check_equivalence(gpt2, hf_batch(), 4,
                               loss=lambda out, labels: (out.loss, count_tokens(labels)))
    assert not report.equivalent
    assert max(d.rel for d in report.diffs) > 1e-2  # far above float32's 1e-4
    assert "one fewer in each sequence that has labels (8 sequences)" in text(report)
    assert "count_tokens(labels, shift=True)" in text(report)


def test_the_hf_check_recipe_in_the_doc_runs_as_printed(capsys):
    import re
    from pathlib import Path

    pytest.importorskip("transformers")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "CHECK.md").read_text()
    code = re.search(r"<!-- recipe: hf-check -->\n```python\n(.*?)```", doc, re.S).group(1)
    namespace = {}
    exec(compile(code, "CHECK.md[hf-check]", "exec"), namespace)
    report = namespace["report"]
    assert report.equivalent and "EQUIVALENT: all 28 tensors agree" in capsys.readouterr().out
    # float32's rounding shows, far inside float32's tolerance (the page prints one run's 7.8e-08)
    assert 1e-9 < max(d.rel for d in report.diffs) < 1e-6
