"""Shared by the recipes' tests: the blocks of docs/INTEGRATIONS.md (or another page), a tiny GPT-2,
padded text."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md"
SEQ, VOCAB = 16, 64


def recipe(name: str, *replace: tuple[str, str], doc: Path = DOC) -> str:
    """The code of the block marked ``<!-- recipe: name -->`` in ``doc``, with ``(old, new)``
    replacements (each must occur exactly once)."""
    found = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```python\n(.*?)```", doc.read_text(), re.S)
    assert found, f"no recipe {name!r} in {doc}"
    code = found.group(1)
    for old, new in replace:
        assert code.count(old) == 1, (name, old)
        code = code.replace(old, new)
    return code


def run(name: str, namespace: dict[str, Any], *replace: tuple[str, str], doc: Path = DOC) -> dict[str, Any]:
    """Execute recipe ``name`` of ``doc`` in ``namespace`` (returned, with what the block defined)."""
    exec(compile(recipe(name, *replace, doc=doc), f"{doc.name}[{name}]", "exec"), namespace)
    return namespace


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def tiny_gpt2(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A 2-layer GPT-2 from a config (no download), seeded, dropout off."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def padded_text(sequences: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Right-padded sequences of 1 to SEQ tokens: input_ids, attention_mask, labels (-100 at padding)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (sequences, SEQ), generator=gen)
    lengths = torch.randint(1, SEQ + 1, (sequences,), generator=gen)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": la}
            for i, m, la in zip(ids, mask, labels, strict=True)]


def causal_lm_loss_float64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                           **kwargs):
    """transformers' ForCausalLMLoss without its float32 upcast (the run stays in float64): the
    mean over the shifted labels, or their sum over ``num_items_in_batch`` (the Trainer's)."""
    labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1),
                                             ignore_index=ignore_index,
                                             reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch
