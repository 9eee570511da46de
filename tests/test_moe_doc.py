"""The recipe of docs/MOE.md (``moe-hugging-face``), executed as printed on a tiny Hugging Face
Qwen3-MoE, against one process on the whole window with the window's balancing loss written out.

One replacement: the recipe's ``model(**batch).loss`` becomes the same mean token loss computed
in float64 (Hugging Face computes its loss in float32 even in a float64 model, 1e-9 off). The
negative twin is the same block with ``mode="micro_batch"`` (Hugging Face's per micro-batch
balance), which must be measurably off.
"""

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from gradaccum.bench.moe import lm_sum, padded_batches, tiny_qwen3_moe, window_reference
from tests.integrations.common import run

DOC = Path(__file__).resolve().parents[1] / "docs" / "MOE.md"
SIZES, STEPS, WINDOWS = [3, 3, 2, 3], 4, 3


def wide_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return lm_sum(logits, batch["labels"]) / (batch["labels"][:, 1:] != -100).sum()


def run_recipe(base, loader, *replace):
    model = copy.deepcopy(base)
    namespace = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "loader": loader,
                 "steps": STEPS, "wide_loss": wide_loss}
    run("moe-hugging-face", namespace, ("model(**batch).loss", "wide_loss(model, batch)"), *replace, doc=DOC)
    return model, namespace


def reference(base, loader):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(0, len(loader), STEPS):
        window_reference(model, loader[w: w + STEPS], opt)
    return model


def max_diff(a, b):
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).detach().abs().max()) for p, q in pairs)


@pytest.fixture(scope="module")
def setting():
    base = tiny_qwen3_moe()
    loader = padded_batches(SIZES * WINDOWS, 7, 32, seed=3)
    return base, loader, reference(base, loader)


def test_the_recipe_trains_the_whole_windows_balancing_loss(setting):
    base, loader, ref = setting
    model, namespace = run_recipe(base, loader)
    assert namespace["acc"].optimizer_steps == WINDOWS
    assert max_diff(model, ref) < 1e-12
    assert max_diff(base, ref) > 1e-3  # it trained


def test_the_recipe_with_the_micro_batch_balance_is_off(setting):
    base, loader, ref = setting
    model, _ = run_recipe(base, loader, ("LoadBalance(model)", "LoadBalance(model, mode='micro_batch')"))
    assert max_diff(model, ref) > 1e-4
