"""The recipes of docs/CONTRASTIVE.md, run as written on tiny models built here (no download), in
float64, against the full batch's gradient (1e-12): CLIP in OpenCLIP's shape with a learnable
temperature and clipping, in-batch negatives on a BERT next to sentence-transformers'
``CachedMultipleNegativesRankingLoss``, SupCon with labels and BatchNorm."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy, normalize
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradaccum import chunks
from tests.contrastive import D_IMG, D_TXT, pairs, supcon_loss
from tests.integrations.common import run

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONTRASTIVE.md"


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
            worst = max(worst, float((x - y).abs().max()))
    return worst


# ------------------------------------------------------------------ CLIP, OpenCLIP's shape
class OpenClipShaped(nn.Module):
    """OpenCLIP's interface on two small towers: normalized features and ``logit_scale.exp()``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.visual = nn.Sequential(nn.Linear(D_IMG, 12), nn.Dropout(0.2), nn.GELU(), nn.Linear(12, 6))
        self.text = nn.Sequential(nn.Linear(D_TXT, 12), nn.GELU(), nn.Linear(12, 6))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.double()

    def forward(self, images, texts):
        return (normalize(self.visual(images), dim=-1), normalize(self.text(texts), dim=-1),
                self.logit_scale.exp())


class ClipLoss(nn.Module):
    """OpenCLIP's ``ClipLoss`` on one process (``open_clip/loss.py``: ``get_logits``, then the mean
    of the image and text cross-entropies), without its gather and label cache."""

    def forward(self, image_features, text_features, logit_scale):
        logits_per_image = logit_scale * image_features @ text_features.T
        logits_per_text = logit_scale * text_features @ image_features.T
        labels = torch.arange(len(logits_per_image))
        return (cross_entropy(logits_per_image, labels) + cross_entropy(logits_per_text, labels)) / 2


def test_clip_recipe_is_the_full_batch_temperature_and_dropout_included():
    batches = [pairs(40, seed=s) for s in (1, 2)]  # chunks of 16, 16 and 8
    namespace = {"model": OpenClipShaped(), "loss": ClipLoss(), "loader": batches}
    torch.manual_seed(7)
    seen = recorded_steps(lambda: run("clip", namespace, ("256))", "16))"), doc=DOC))
    assert namespace["acc"].optimizer_steps == 2

    # The reference: every chunk's graph alive (the same dropout masks: the same RNG from the
    # same state), one backward of the batch's loss, clipped to 1.0, the same AdamW.
    ref = OpenClipShaped()
    opt = torch.optim.AdamW(ref.parameters(), lr=5e-4, weight_decay=0.2)
    torch.manual_seed(7)
    want, norms, unclipped = [], [], []
    for batch in batches:
        outs = [ref(*c) for c in chunks(batch, 16)]
        image, text = (torch.cat([o[k] for o in outs]) for k in (0, 1))
        ClipLoss()(image, text, ref.logit_scale.exp()).backward()
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
    naive = OpenClipShaped()
    torch.manual_seed(7)
    for c in chunks(batches[0], 16):
        (ClipLoss()(*naive(*c)) / 3).backward()
    assert largest([p.grad for p in naive.parameters()], unclipped[0]) > 1e-2


# ------------------------------------------------------------------ in-batch negatives (BERT)
@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    from gradaccum.bench.sentence import sentence_model, write_bert

    return sentence_model(write_bert(tmp_path_factory.mktemp("bert")), torch.float64)


def full_mnrl_grads(model, anchors, positives):
    from gradaccum.bench.sentence import mnrl_loss

    model = copy.deepcopy(model)
    embed = [model(model.preprocess(t))["sentence_embedding"] for t in (anchors, positives)]
    mnrl_loss(*embed).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_mnrl_recipe_and_sentence_transformers_cached_loss_give_the_full_batch_gradient(bert):
    from gradaccum.bench.sentence import sentence_pairs

    anchors, positives = sentence_pairs(22, seed=3)  # texts of 3 to 12 words; chunks of 5, ..., 2
    loader = [(anchors, positives)]
    ours = {"MODEL": copy.deepcopy(bert), "loader": loader}
    mine = recorded_steps(lambda: run(
        "mnrl", ours, ('SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")', "MODEL"),
        ("model.preprocess(anchor_texts), 32)", "model.preprocess(anchor_texts), 5)"),
        ("model.preprocess(positive_texts), 32)", "model.preprocess(positive_texts), 5)"), doc=DOC))
    theirs_model = copy.deepcopy(bert)
    theirs = {"model": theirs_model, "opt": torch.optim.AdamW(theirs_model.parameters(), lr=2e-5),
              "loader": loader}
    st = recorded_steps(lambda: run("mnrl-sentence-transformers", theirs,
                                    ("mini_batch_size=32", "mini_batch_size=5"), doc=DOC))
    want = full_mnrl_grads(bert, anchors, positives)
    assert len(mine) == len(st) == 1 and ours["acc"].optimizer_steps == 1
    assert largest(mine[0], want) < 1e-12
    assert largest(st[0], want) < 1e-12
    assert largest(mine[0], st[0]) < 1e-12
    assert max(float(g.abs().max()) for g in want if g is not None) > 1e-2
    # The negative twin: chunks of pairs, each chunk's loss accumulated.
    from gradaccum.bench.sentence import mnrl_loss

    naive = copy.deepcopy(bert)
    for k in range(0, 22, 5):
        a, p = anchors[k:k + 5], positives[k:k + 5]
        embed = [naive(naive.preprocess(t))["sentence_embedding"] for t in (a, p)]
        (mnrl_loss(*embed) * len(a) / 22).backward()
    assert largest([q.grad for q in naive.parameters()], want) > 1e-3


def test_with_dropout_both_replay_the_same_masks_on_texts_of_one_length(bert):
    # sentence-transformers trims each mini-batch's padding; on texts of one length nothing is
    # trimmed, both draw their masks for tensors of the same shapes, in the same order.
    from gradaccum.bench.sentence import mnrl_loss, sentence_pairs

    dropped = copy.deepcopy(bert)
    for module in dropped.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.2
    anchors, positives = sentence_pairs(12, seed=6, length=5)
    loader = [(anchors, positives)]
    torch.manual_seed(11)
    mine = recorded_steps(lambda: run(
        "mnrl", {"MODEL": copy.deepcopy(dropped), "loader": loader},
        ('SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")', "MODEL"),
        ("model.preprocess(anchor_texts), 32)", "model.preprocess(anchor_texts), 5)"),
        ("model.preprocess(positive_texts), 32)", "model.preprocess(positive_texts), 5)"), doc=DOC))
    theirs_model = copy.deepcopy(dropped)
    torch.manual_seed(11)
    st = recorded_steps(lambda: run(
        "mnrl-sentence-transformers", {"model": theirs_model, "loader": loader,
                                       "opt": torch.optim.AdamW(theirs_model.parameters(), lr=2e-5)},
        ("mini_batch_size=32", "mini_batch_size=5"), doc=DOC))
    # The reference: every chunk's graph alive, the chunks in the same order from the same RNG.
    ref = copy.deepcopy(dropped)
    torch.manual_seed(11)
    texts = chunks(ref.preprocess(anchors), 5) + chunks(ref.preprocess(positives), 5)
    mnrl_loss(*torch.cat([ref(dict(f))["sentence_embedding"] for f in texts]).chunk(2)).backward()
    want = [None if p.grad is None else p.grad for p in ref.parameters()]
    assert largest(mine[0], want) < 1e-12 and largest(st[0], want) < 1e-12
    # The negative twin: without dropout the gradient is another one (the masks matter).
    assert largest(mine[0], full_mnrl_grads(bert, anchors, positives)) > 1e-3


def test_a_sentence_transformer_handed_the_chunk_itself_keeps_every_chunks_graph(bert):
    # Why the recipe's encode copies the dict: the model writes its outputs into it.
    from gradaccum.bench.sentence import sentence_pairs

    model = copy.deepcopy(bert)
    texts = chunks(model.preprocess(sentence_pairs(12, seed=4)[0]), 4)
    kept = [model(f)["sentence_embedding"] for f in texts]
    assert all(f["token_embeddings"].grad_fn is not None for f in texts)  # three graphs held
    del kept
    copies = chunks(model.preprocess(sentence_pairs(12, seed=4)[0]), 4)
    for f in copies:
        model(dict(f))
    assert all("token_embeddings" not in f for f in copies)


# ------------------------------------------------------------------ SupCon with labels
class Encoder(nn.Module):
    """An encoder with BatchNorm and a projection head, SupCon's shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(D_IMG, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        self.double()

    def forward(self, x):
        return self.head(self.body(x))


def test_supcon_recipe_is_the_full_batch_with_labels_and_batchnorm_once_per_chunk():
    g = torch.Generator().manual_seed(5)
    images = torch.randn(40, D_IMG, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (40,), generator=g)
    namespace = {"model": Encoder(), "loader": [(images, labels)]}
    seen = recorded_steps(lambda: run("supcon", namespace, ("128))", "16))"), doc=DOC))
    supcon = namespace["supcon"]

    ref = Encoder()
    z = torch.cat([ref(x) for x, _ in chunks((images, labels), 16)])  # BatchNorm: per chunk
    supcon(z, labels).backward()
    want = [p.grad for p in ref.parameters()]
    assert len(seen) == 1 and largest(seen[0], want) < 1e-12
    bn, ref_bn = namespace["model"].body[1], ref.body[1]
    assert int(bn.num_batches_tracked) == 3  # once per chunk, not once per pass
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, atol=1e-15, rtol=0)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, atol=1e-15, rtol=0)
    # The recipe's loss is SupCon (the tests' own implementation, at the same temperature).
    torch.testing.assert_close(supcon(z, labels), supcon_loss(z, labels, temperature=0.1), atol=1e-12, rtol=0)
    # BatchNorm's caveat (the page's limits): one forward of the whole batch normalizes by the
    # batch's statistics, another gradient than the chunks'.
    whole = Encoder()
    supcon(whole(images), labels).backward()
    assert largest([p.grad for p in whole.parameters()], want) > 1e-4
