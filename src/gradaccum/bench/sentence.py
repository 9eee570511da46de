"""A small sentence-transformers model built from a BERT config (no download), in-batch-negative
batches for it, and ``MultipleNegativesRankingLoss``'s arithmetic.

sentence-transformers loads a ``Transformer`` module from a folder, so :func:`write_bert` writes
one: a word-piece vocabulary of made-up words, its fast tokenizer and a freshly initialized
``BertModel`` (dropout off, so that a chunked gradient can be compared with the full batch's).
:func:`sentence_model` puts it under mean pooling, as a ``SentenceTransformer``. Both import
transformers and sentence-transformers (the ``bench`` extra) when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import cross_entropy, normalize

from gradaccum import Accumulator, chunks

__all__ = ["BERT_BENCH", "BERT_TINY", "BertSizes", "mnrl_contenders", "mnrl_loss", "sentence_model",
           "sentence_pairs", "write_bert"]

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@dataclass(frozen=True)
class BertSizes:
    """A BERT's sizes (heads of ``hidden // heads`` features) and its vocabulary of made-up words."""

    hidden: int
    layers: int
    heads: int
    words: int
    max_len: int


BERT_BENCH = BertSizes(hidden=128, layers=2, heads=2, words=500, max_len=64)
BERT_TINY = BertSizes(hidden=16, layers=2, heads=2, words=40, max_len=32)


def _words(sizes: BertSizes) -> list[str]:
    return [f"w{i}" for i in range(sizes.words)]


def write_bert(folder: Path, sizes: BertSizes = BERT_TINY, seed: int = 0) -> Path:
    """Write a tokenizer and a randomly initialized ``BertModel`` into ``folder``; return it."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate([*SPECIAL, *_words(sizes)])}
    transformers.BertTokenizer(vocab=vocab).save_pretrained(str(folder))  # transformers >= 5: fast
    config = transformers.BertConfig(
        vocab_size=len(SPECIAL) + sizes.words, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads, intermediate_size=4 * sizes.hidden,
        max_position_embeddings=sizes.max_len, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    transformers.BertModel(config).save_pretrained(str(folder))
    return folder


def sentence_model(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The ``SentenceTransformer`` of the BERT in ``folder``, mean-pooled, on the CPU, in training mode."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    bert = Transformer(str(folder))
    model = SentenceTransformer(modules=[bert, Pooling(bert.get_embedding_dimension(), "mean")],
                                device="cpu")
    return model.to(dtype).train()


def sentence_pairs(n: int, sizes: BertSizes = BERT_TINY, seed: int = 0, length: int | None = None
                   ) -> tuple[list[str], list[str]]:
    """``n`` (anchor, positive) texts of made-up words; ``length`` words each, or 3 to 12 when None."""
    g = torch.Generator().manual_seed(seed)
    words = _words(sizes)

    def text() -> str:
        count = length if length is not None else int(torch.randint(3, 13, (1,), generator=g))
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (count,), generator=g))

    pairs = [(text(), text()) for _ in range(n)]
    return [a for a, _ in pairs], [p for _, p in pairs]


def mnrl_loss(anchors: torch.Tensor, positives: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """``MultipleNegativesRankingLoss`` (its defaults): cross-entropy of the scaled cosine
    similarities, each anchor's positive against every other positive of the batch."""
    scores = scale * normalize(anchors, dim=1) @ normalize(positives, dim=1).T
    return cross_entropy(scores, torch.arange(len(scores), device=scores.device))


def mnrl_contenders(model: Any, anchors: list[str], positives: list[str], pieces: int, *, lr: float = 0.0
                    ) -> dict[str, Callable[[], None]]:
    """Four ways to take one optimizer step of in-batch negatives, the pairs cut into ``pieces``
    chunks, on ``model``; each steps an SGD of ``lr`` through an Accumulator (0: the model does
    not move).

    * ``full batch``: every anchor and positive at once;
    * ``naive``: each chunk's loss (its anchors against its positives), accumulated;
    * ``backward_cached``: chunks of texts, as sentence-transformers makes them: the anchors'
      chunks, then the positives'; ``loss_fn`` cuts the embeddings back into the two halves;
    * ``sentence-transformers cached``: ``CachedMultipleNegativesRankingLoss`` with mini-batches of
      the chunks' size.
    """
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    size = -(-len(anchors) // pieces)
    batch = (model.preprocess(anchors), model.preprocess(positives))
    pairs = chunks(batch, size)
    texts = chunks(batch[0], size) + chunks(batch[1], size)
    cached_st = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=size)

    def accumulator(steps: int) -> Accumulator:
        return Accumulator(torch.optim.SGD(model.parameters(), lr=lr), steps, model=model)

    full, naive, cached, st = accumulator(1), accumulator(len(pairs)), accumulator(1), accumulator(1)

    def encode(features: dict[str, Any]) -> torch.Tensor:
        # A SentenceTransformer writes its outputs into the dict it is given: hand it a copy.
        embeddings: torch.Tensor = model(dict(features))["sentence_embedding"]
        return embeddings

    def halves(embeddings: torch.Tensor) -> torch.Tensor:
        anchor_embeddings, positive_embeddings = embeddings.chunk(2)
        return mnrl_loss(anchor_embeddings, positive_embeddings)

    def run_full() -> None:
        full.backward(mnrl_loss(encode(batch[0]), encode(batch[1])))

    def run_naive() -> None:
        for a, p in pairs:
            naive.backward(mnrl_loss(encode(a), encode(p)))

    def run_cached() -> None:
        cached.backward_cached(encode, halves, texts)

    def run_st() -> None:
        st.backward(cached_st([dict(f) for f in batch], None))

    return {"full batch": run_full, "naive": run_naive, "backward_cached": run_cached,
            "sentence-transformers cached": run_st}
