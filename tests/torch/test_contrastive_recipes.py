"""The recipes of docs/CONTRASTIVE.md, each run exactly as the page prints it after the setup the
page prints beside it (tiny models built there, no download, float64), against the full batch's
gradient (1e-12): CLIP in OpenCLIP's shape, tuple and ``output_dict=True``, with a learnable
temperature and clipping; in-batch negatives on a BERT next to sentence-transformers'
``CachedMultipleNegativesRankingLoss``; SupCon with labels and BatchNorm. A test may change the
setup's objects (another output form, dropout, other texts) before the recipe runs; never the
recipe's code."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradaccum import chunks
from tests.contrastive import supcon_loss
from tests.integrations.common import recipe, run

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONTRASTIVE.md"


def setup(name):
    """A fresh namespace after the page's printed setup block ``name``."""
    return run(name, {}, doc=DOC)


def test_the_mnrl_recipe_downloads_nothing_its_setup_builds_the_model():
    code = recipe("mnrl-setup", doc=DOC) + recipe("mnrl", doc=DOC)
    assert "write_bert(" in code
    assert not re.search(r"^[^#]*(SentenceTransformer|from_pretrained)\(", code, re.M)  # comments aside


def recorded_steps(fn):
    """Run ``fn``; return, for each optimizer step it took, the gradients (by parameter name)."""
    seen = []

    def record(optimizer, *_):
        seen.append([None if p.grad is None else p.grad.detach().clone()
                     for group in optimizer.param_groups for p in group["params"]])

    handle = register_optimizer_step_pre_hook(record)
    try:
        fn()
    finally:
        handle.remove()
    return seen


def largest(a, b):
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            worst = max(worst, float((x - y).detach().abs().max()))
    return worst


# ------------------------------------------------------------------ CLIP, OpenCLIP's shape
@pytest.mark.parametrize("output_dict", [False, True], ids=["tuple", "output_dict"])
def test_clip_recipe_is_the_full_batch_in_both_forms_temperature_and_dropout_included(output_dict):
    ns = setup("clip-setup")
    ns["model"].output_dict = output_dict  # OpenCLIP's attribute: open_clip_train sets it
    base = copy.deepcopy(ns["model"])
    batches, loss = ns["loader"], ns["loss"]
    images, texts = batches[0]
    assert isinstance(ns["model"](images[:2], texts[:2]), dict) == output_dict
    torch.manual_seed(7)
    seen = recorded_steps(lambda: run("clip", ns, doc=DOC))  # chunks of 256, 256 and 88
    assert ns["acc"].optimizer_steps == 2

    # The reference: every chunk's graph alive (the same dropout masks: the same RNG from the
    # same state), one backward of the batch's loss, clipped to 1.0, the same AdamW.
    ref = copy.deepcopy(base)
    ref.output_dict = False
    opt = torch.optim.AdamW(ref.parameters(), lr=5e-4, weight_decay=0.2)
    torch.manual_seed(7)
    want, norms, unclipped = [], [], []
    for batch in batches:
        outs = [ref(*c) for c in chunks(batch, 256)]
        image, text = (torch.cat([o[k] for o in outs]) for k in (0, 1))
        loss(image, text, ref.logit_scale.exp()).backward()
        unclipped.append([p.grad.clone() for p in ref.parameters()])
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        want.append([p.grad.clone() for p in ref.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert max(largest(g, w) for g, w in zip(seen, want, strict=True)) < 1e-12
    assert min(norms) > 1.0  # the clipping acted: it saw the batch's true gradient
    at = [name for name, _ in ref.named_parameters()].index("logit_scale")
    assert all(abs(float(w[at])) > 1e-3 for w in want)  # the temperature's gradient is not trivially 0
    # The negative twin: each chunk's own loss, accumulated, is another objective.
    naive = copy.deepcopy(base)
    naive.output_dict = False
    torch.manual_seed(7)
    for c in chunks(batches[0], 256):
        (loss(*naive(*c)) * len(c[0]) / 600).backward()
    assert largest([p.grad for p in naive.parameters()], unclipped[0]) > 1e-2


# ------------------------------------------------------------------ in-batch negatives (BERT)
def mnrl_setup(dropout=0.0):
    """The page's setup, its BERT's dropout set to ``dropout`` (and its texts of one length)."""
    pytest.importorskip("sentence_transformers")
    ns = setup("mnrl-setup")
    if dropout:
        from gradaccum.bench.sentence import sentence_pairs

        for module in ns["model"].modules():
            if isinstance(module, nn.Dropout):
                module.p = dropout
        ns["loader"] = [sentence_pairs(70, seed=6, length=5)]
    return ns


def full_mnrl_grads(model, anchors, positives):
    from gradaccum.bench.sentence import mnrl_loss

    model = copy.deepcopy(model)
    embed = [model(model.preprocess(t))["sentence_embedding"] for t in (anchors, positives)]
    mnrl_loss(*embed).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_mnrl_recipe_and_sentence_transformers_cached_loss_give_the_full_batch_gradient():
    ours, theirs = mnrl_setup(), mnrl_setup()
    base = copy.deepcopy(ours["model"])
    assert largest(list(theirs["model"].parameters()), list(base.parameters())) == 0  # one setup
    mine = recorded_steps(lambda: run("mnrl", ours, doc=DOC))  # chunks of 32, 32 and 6 texts
    st = recorded_steps(lambda: run("mnrl-sentence-transformers", theirs, doc=DOC))
    anchors, positives = ours["loader"][0]
    want = full_mnrl_grads(base, anchors, positives)
    assert len(mine) == len(st) == 1 and ours["acc"].optimizer_steps == 1
    assert largest(mine[0], want) < 1e-12
    assert largest(st[0], want) < 1e-12
    assert largest(mine[0], st[0]) < 1e-12
    assert max(float(g.abs().max()) for g in want if g is not None) > 1e-2
    # The negative twin: chunks of pairs, each chunk's loss accumulated.
    from gradaccum.bench.sentence import mnrl_loss

    naive = copy.deepcopy(base)
    for k in range(0, 70, 32):
        a, p = anchors[k:k + 32], positives[k:k + 32]
        embed = [naive(naive.preprocess(t))["sentence_embedding"] for t in (a, p)]
        (mnrl_loss(*embed) * len(a) / 70).backward()
    assert largest([q.grad for q in naive.parameters()], want) > 1e-3


def test_with_dropout_both_replay_the_same_masks_on_texts_of_one_length():
    # sentence-transformers trims each mini-batch's padding; on texts of one length nothing is
    # trimmed, both draw their masks for tensors of the same shapes, in the same order.
    from gradaccum.bench.sentence import mnrl_loss

    ours, theirs = mnrl_setup(dropout=0.2), mnrl_setup(dropout=0.2)
    dropped = copy.deepcopy(ours["model"])
    torch.manual_seed(11)
    mine = recorded_steps(lambda: run("mnrl", ours, doc=DOC))
    torch.manual_seed(11)
    st = recorded_steps(lambda: run("mnrl-sentence-transformers", theirs, doc=DOC))
    # The reference: every chunk's graph alive, the chunks in the same order from the same RNG.
    anchors, positives = ours["loader"][0]
    ref = copy.deepcopy(dropped)
    torch.manual_seed(11)
    texts = chunks(ref.preprocess(anchors), 32) + chunks(ref.preprocess(positives), 32)
    mnrl_loss(*torch.cat([ref(dict(f))["sentence_embedding"] for f in texts]).chunk(2)).backward()
    want = [None if p.grad is None else p.grad for p in ref.parameters()]
    assert largest(mine[0], want) < 1e-12 and largest(st[0], want) < 1e-12
    # The negative twin: without dropout the gradient is another one (the masks matter).
    for module in dropped.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    assert largest(mine[0], full_mnrl_grads(dropped, anchors, positives)) > 1e-3


def test_a_sentence_transformer_handed_the_chunk_itself_keeps_every_chunks_graph():
    # Why the recipe's encode copies the dict: the model writes its outputs into it.
    ns = mnrl_setup()
    model, (anchors, _) = ns["model"], ns["loader"][0]
    texts = chunks(model.preprocess(anchors[:12]), 4)
    kept = [model(f)["sentence_embedding"] for f in texts]
    assert all(f["token_embeddings"].grad_fn is not None for f in texts)  # three graphs held
    del kept
    copies = chunks(model.preprocess(anchors[:12]), 4)
    for f in copies:
        model(dict(f))
    assert all("token_embeddings" not in f for f in copies)


# ------------------------------------------------------------------ SupCon with labels
def test_supcon_recipe_is_the_full_batch_with_labels_and_batchnorm_once_per_chunk():
    ns = setup("supcon-setup")
    base = copy.deepcopy(ns["model"])
    images, labels = ns["loader"][0]
    seen = recorded_steps(lambda: run("supcon", ns, doc=DOC))  # chunks of 128, 128 and 44
    supcon = ns["supcon"]

    ref = copy.deepcopy(base)
    z = torch.cat([ref(x) for x, _ in chunks((images, labels), 128)])  # BatchNorm: per chunk
    supcon(z, labels).backward()
    want = [p.grad for p in ref.parameters()]
    assert len(seen) == 1 and largest(seen[0], want) < 1e-12
    bn, ref_bn = ns["model"].body[1], ref.body[1]
    assert int(bn.num_batches_tracked) == 3  # once per chunk, not once per pass
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, atol=1e-15, rtol=0)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, atol=1e-15, rtol=0)
    # The recipe's loss is SupCon (the tests' own implementation, at the same temperature).
    torch.testing.assert_close(supcon(z, labels), supcon_loss(z, labels, temperature=0.1), atol=1e-12, rtol=0)
    # BatchNorm's caveat (the page's limits): one forward of the whole batch normalizes by the
    # batch's statistics, another gradient than the chunks'.
    whole = copy.deepcopy(base)
    supcon(whole(images), labels).backward()
    assert largest([p.grad for p in whole.parameters()], want) > 1e-4
