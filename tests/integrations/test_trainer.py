"""The Trainer recipes of docs/INTEGRATIONS.md: the checker on a tiny GPT-2, and the Trainer's
token count fixed for GPT-2 (loss_type None), against a full-batch loop in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integrations.common import causal_lm_loss_float64, max_diff, padded_text, recipe, run, tiny_gpt2

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEQUENCES, EPOCHS, LR = 16, 3, 0.5  # one window per epoch: the Trainer's sampler order cannot matter


def collate(batch):
    return {k: torch.stack([b[k] for b in batch]) for k in batch[0]}


def variable_text(sequences):
    """padded_text's sequences without their padding: lists of 1 to 16 tokens (the Trainer's
    default collator cannot stack them)."""
    rows = padded_text(sequences)
    return [{k: v[: int(row["attention_mask"].sum())].tolist() for k, v in row.items()} for row in rows]


def tokenizer():
    """A tokenizer built in memory (no download): ids 0 to 63, 0 the pad token, right padding."""
    from tokenizers import Tokenizer, models

    vocab = {str(i): i for i in range(64)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="1")), pad_token="0")


def gpt2():
    model = tiny_gpt2()
    model.loss_function = causal_lm_loss_float64  # transformers' loss without its float32 upcast
    return model


def test_the_recipes_are_in_the_doc():
    assert recipe("trainer-check") and recipe("trainer")


def test_the_checker_accepts_the_shifted_count_and_refuses_the_unshifted_one(capsys):
    batch = collate(padded_text(SEQUENCES))
    ns = run("trainer-check", {"model": tiny_gpt2(), "batch": batch})
    assert ns["report"].equivalent
    assert "EQUIVALENT" in capsys.readouterr().out
    wrong = run("trainer-check", {"model": tiny_gpt2(), "batch": batch},
                ("count_tokens(labels, shift=True)", "count_tokens(labels)"))
    assert not wrong["report"].equivalent


def reference(base):
    """The full batch: one SGD step per epoch on the mean over every shifted label."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batch = collate(padded_text(SEQUENCES))
    for _ in range(EPOCHS):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def trainer_run(base, tmp_path, *replace):
    model = copy.deepcopy(base)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=4,
        num_train_epochs=EPOCHS, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    run("trainer", {"model": model, "args": args, "train_dataset": variable_text(SEQUENCES),
                    "tokenizer": tokenizer()}, *replace)
    return model


def test_the_trainer_with_the_shifted_count_is_the_full_batch(tmp_path):
    base = gpt2()
    full = reference(base)
    assert max_diff(full, base) > 1e-3
    assert max_diff(trainer_run(base, tmp_path), full) < 1e-12


def test_without_the_collator_variable_lengths_fail(tmp_path):
    # The negative twin of the recipe's data_collator: the default collator stacks as they are.
    with pytest.raises(ValueError, match="length"):
        trainer_run(gpt2(), tmp_path, (",\n                               data_collator=collator", ""))


def first_window_labels():
    labels = collate(padded_text(SEQUENCES))["labels"][:4]  # the recipe's batch: the first 4
    return int((labels != -100).sum()), int((labels[:, 1:] != -100).sum())


def test_the_stock_trainer_counts_gpt2s_unshifted_labels(tmp_path):
    base = gpt2()
    unshifted, shifted = first_window_labels()
    assert unshifted == shifted + 4  # one first label each
    with pytest.raises(AssertionError, match=rf"^{unshifted}$"):
        trainer_run(base, tmp_path, ('model.loss_type = "ForCausalLM"', "pass"))
    unchecked = trainer_run(base, tmp_path, ('model.loss_type = "ForCausalLM"', "pass"),
                            ("assert int(counted)", "assert True or int(counted)"))
    assert max_diff(unchecked, reference(base)) > 1e-4


def test_a_loss_put_into_loss_mapping_brings_the_unshifted_count_back(tmp_path, monkeypatch):
    # The Trainer shifts its count only when LOSS_MAPPING[model.loss_type] is its own
    # ForCausalLMLoss: a replacement there undoes the recipe's loss_type line.
    from transformers.loss import loss_utils

    monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", causal_lm_loss_float64)
    unshifted, _ = first_window_labels()
    with pytest.raises(AssertionError, match=rf"^{unshifted}$"):
        trainer_run(gpt2(), tmp_path)
