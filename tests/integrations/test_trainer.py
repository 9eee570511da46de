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
    data = padded_text(SEQUENCES)
    run("trainer", {"model": model, "args": args, "train_dataset": data, "batch": collate(data)}, *replace)
    return model


def test_the_trainer_with_the_shifted_count_is_the_full_batch(tmp_path):
    base = gpt2()
    full = reference(base)
    assert max_diff(full, base) > 1e-3
    assert max_diff(trainer_run(base, tmp_path), full) < 1e-12


def test_the_stock_trainer_counts_gpt2s_unshifted_labels(tmp_path):
    base = gpt2()
    labels = collate(padded_text(SEQUENCES))["labels"]
    unshifted = int((labels != -100).sum())
    assert unshifted == int((labels[:, 1:] != -100).sum()) + SEQUENCES  # one first label each
    with pytest.raises(AssertionError, match=rf"^{unshifted}$"):
        trainer_run(base, tmp_path, ('model.loss_type = "ForCausalLM"', "pass"))
    unchecked = trainer_run(base, tmp_path, ('model.loss_type = "ForCausalLM"', "pass"),
                            ("assert int(counted)", "assert True or int(counted)"))
    assert max_diff(unchecked, reference(base)) > 1e-4
