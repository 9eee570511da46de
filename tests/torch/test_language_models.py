"""The recipes of docs/LANGUAGE_MODELS.md, executed as printed, against the full batch.

Each recipe block is run once on micro-batches and compared with a full-batch run; each has a
negative twin (the same block with the token count wrong or missing) that must be measurably off.
"""

import copy
import itertools
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from gradaccum.demos.gpt import GPT, GPTConfig
from tests.integrations import common

DOC = Path(__file__).resolve().parents[2] / "docs" / "LANGUAGE_MODELS.md"
SEQ = 16


def recipe(name, *replace):
    return common.recipe(name, *replace, doc=DOC)


def run(name, namespace, *replace):
    return common.run(name, namespace, *replace, doc=DOC)


def max_diff(a, b):
    return max(float((p - q).detach().abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def lengths(n, seed, low=1):
    return torch.randint(low, SEQ + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_recipes_are_in_the_doc():
    for name in ("hugging-face", "nanogpt-original", "nanogpt", "sum-reduced"):
        assert recipe(name)


# --- Hugging Face: outputs.loss, count_tokens(labels, shift=True), get_scheduler in windows ---

def hf_model(kind):
    """A tiny GPT-2 or Llama from a config, in float64 (its loss still runs in float32: HF upcasts
    the logits to float, and float32 there is exact enough; float32 weights are not under AdamW)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **ids)).double()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ, **ids)).double()


def hf_batches(micro, sequences=32):
    """Right-padded sequences of 1 to SEQ tokens: input_ids, attention_mask, labels (-100 at padding)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (sequences, SEQ), generator=gen)
    mask = (torch.arange(SEQ) < torch.tensor(lengths(sequences, 2))[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": la}
            for i, m, la in zip(ids.split(micro), mask.split(micro), labels.split(micro), strict=True)]


def hf_train(base, micro, steps, *replace):
    model = copy.deepcopy(base)
    run("hugging-face", {"model": model, "loader": hf_batches(micro), "steps": steps, "epochs": 2},
        *replace)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_recipe_matches_the_full_batch(kind):
    base = hf_model(kind)
    full, accumulated = hf_train(base, 16, 1), hf_train(base, 4, 4)
    assert max_diff(full, base) > 1e-3  # it trained
    assert max_diff(accumulated, full) < 1e-9  # measured: 8e-15 (GPT-2), 3e-15 (Llama)


@pytest.mark.parametrize("mistake", [
    (", shift=True", ""),  # counts each sequence's first label, which the loss never sees
    (', n_items=gradaccum.count_tokens(batch["labels"], shift=True)', ""),  # the naive loss / N
    ("windows = math.ceil(len(loader) / steps)", "windows = len(loader)"),  # schedule in micro-batches
])
def test_hugging_face_recipe_with_a_mistake_is_off(mistake):
    base = hf_model("gpt2")
    full, wrong = hf_train(base, 16, 1), hf_train(base, 4, 4, mistake)
    assert max_diff(wrong, full) > 1e-4  # measured: 1.5e-3 to 5e-3


# --- nanoGPT: its own loop against the port, get_lr per window via acc.optimizer_steps ---

def get_lr(it, warmup_iters=1, lr_decay_iters=3, learning_rate=1e-2, min_lr=1e-3):
    """nanoGPT's learning-rate schedule: linear warm-up, cosine decay, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def tiny_gpt(ignore_index):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, block_size=SEQ, n_layer=2, n_head=2, n_embd=16,
                       ignore_index=ignore_index)
    return GPT(config).double()


def nanogpt_batches(micro, sequences=64):
    """nanoGPT's (X, Y) on documents of 1 to SEQ tokens: Y the next token, -1 after the end."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (sequences, SEQ + 1), generator=gen)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for i, n in enumerate(lengths(sequences, 4)):
        x[i, n:], y[i, n:] = 0, -1
    return list(zip(x.split(micro), y.split(micro), strict=True))


def nanogpt_train(name, base, micro, accum):
    model = copy.deepcopy(base)
    batches = itertools.cycle(nanogpt_batches(micro))
    run(name, {
        "torch": torch, "model": model, "get_batch": lambda split: next(batches), "get_lr": get_lr,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
        "max_iters": 4, "decay_lr": True, "learning_rate": 1e-2, "gradient_accumulation_steps": accum,
        "grad_clip": 1.0, "ctx": nullcontext(), "scaler": torch.amp.GradScaler("cpu", enabled=False),
    })
    return model


def test_nanogpt_port_matches_nanogpts_full_batch_loop():
    base = tiny_gpt(ignore_index=-1)
    full = nanogpt_train("nanogpt-original", base, 16, 1)
    port = nanogpt_train("nanogpt", base, 4, 4)
    assert max_diff(full, base) > 1e-3
    assert max_diff(port, full) < 1e-12
    # nanoGPT's own loss / N over the same padded micro-batches: the negative twin.
    assert max_diff(nanogpt_train("nanogpt-original", base, 4, 4), full) > 1e-6


# --- torchtune-style: a summed loss, empty micro-batches, a window without tokens ---

def tune_batches():
    """16 micro-batches of 2 (4 windows of 4), labels unshifted (-100 at padding). A one-token
    sequence has no label after the shift: micro-batch 5 is empty, window 2 (8 to 11) all empty."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 32, (32, SEQ), generator=gen)
    n = torch.tensor(lengths(32, 6, low=2))
    n[10:12] = 1
    n[16:24] = 1
    labels = tokens.masked_fill(torch.arange(SEQ) >= n[:, None], -100)
    return [{"tokens": t, "labels": la} for t, la in zip(tokens.split(2), labels.split(2), strict=True)]


def tune_reference(base, batches):
    """The full batch: one SGD step per window on the mean over all its labelled tokens."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for window in (batches[i:i + 4] for i in range(0, len(batches), 4)):
        tokens = torch.cat([b["tokens"] for b in window])
        labels = torch.cat([b["labels"] for b in window])[:, 1:]
        if not (labels != -100).any():
            continue  # no token: no step
        logits, _ = model(tokens)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def tune_train(base, *replace):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    steps_taken = []
    opt.register_step_post_hook(lambda *_: steps_taken.append(1))
    run("sum-reduced", {"model": model, "opt": opt, "steps": 4, "loader": tune_batches()}, *replace)
    return model, len(steps_taken)


def test_sum_reduced_recipe_with_empty_micro_batches_matches_the_full_batch():
    # Needs Accumulator.backward(..., reduction="sum") with n_items=0 (issue 14, points 1-2).
    base = tiny_gpt(ignore_index=-100)
    batches = tune_batches()
    assert int((batches[5]["labels"][:, 1:] != -100).sum()) == 0
    reference = tune_reference(base, batches)
    model, steps_taken = tune_train(base)
    assert steps_taken == 3  # the window without tokens took no step
    assert max_diff(reference, base) > 1e-3
    assert max_diff(model, reference) < 1e-12
    # Counting the labels before the shift: one token too many per sequence, and a step (with
    # momentum) in the window that has none.
    wrong, _ = tune_train(base, ("count_tokens(labels)", 'count_tokens(batch["labels"])'))
    assert max_diff(wrong, reference) > 1e-6
