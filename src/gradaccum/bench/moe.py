"""Mixture-of-experts under accumulation: tiny models, padded and domain-structured data, the
whole window's balancing loss written out, and the hand loops that gradaccum.moe is measured against.

Shared by ``benchmarks/moe.py`` (the cost table, the training run, the table of docs/MOE.md's
"Why") and the tests. The model is a tiny Hugging Face Qwen3-MoE (no download: a config, seeded
weights); the balancing loss is the one of ``load_balancing_loss_func``, ``E x sum_i f_i P_i``,
here in float64 over a whole window: ``f_i`` the fraction of the window's routed tokens (padding
masked) that chose expert ``i`` (counts, no gradient), ``P_i`` the window's mean router probability
for it, the layers pooled (or, ``per_layer=True``, each layer's loss summed).

The hand loops (one window per call, SGD stepped at its end):

- :func:`hand_loop`: the plain Hugging Face loop, each micro-batch's ``outputs.loss`` (its own
  balancing loss inside) weighted by its share of the window's tokens;
- :func:`two_pass_loop`: correct by hand: a no-grad forward of every micro-batch counts the routes,
  then each backward carries its share of the whole window's balancing loss;
- :func:`rolling_loop`: ``f`` from the routes counted so far in the window (this micro-batch's
  included): the paper's buffer.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "PAD",
    "Batch",
    "aux_terms",
    "domain_batches",
    "hand_loop",
    "lm_sum",
    "padded_batches",
    "rolling_loop",
    "route_counts",
    "tiny_qwen3_moe",
    "two_pass_loop",
    "window_aux",
    "window_reference",
]

PAD = -100
Batch = dict[str, torch.Tensor]


def tiny_qwen3_moe(dtype: torch.dtype = torch.float64, *, experts: int = 8, top_k: int = 2, layers: int = 2,
                   hidden: int = 16, vocab: int = 32, coef: float = 0.5, seed: int = 0,
                   wide: bool | None = None) -> nn.Module:
    """A Hugging Face Qwen3-MoE small enough for the suite (the sizes of tests/moe/models.py):
    every layer sparse, seeded weights, router weights drawn wide so that no two experts tie for
    a token.

    Args:
        dtype: the parameters' dtype.
        experts: experts per layer.
        top_k: experts each token is routed to.
        layers: decoder layers.
        hidden: the hidden size (attention; the experts' is half of it).
        vocab: the vocabulary size.
        coef: ``router_aux_loss_coef``.
        seed: the weights' seed.
        wide: the routers' softmax and the RMS norms computed in the model's dtype (default: for
            float64). Hugging Face's take them in float32 whatever the model's dtype, so that in a
            float64 model their gradients round with the scale of the backward's seed: an
            accumulator, whose seed is each micro-batch's count (the window's division waits for
            the boundary), is then 1e-9 from the whole window in one backward (so is one with
            eager attention, whose softmax is float32 too: the model uses ``sdpa``).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
        num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, router_aux_loss_coef=coef, max_position_embeddings=256,
        # sdpa: eager attention takes its softmax in float32 even in a float64 model; the grouped
        # experts kernel takes no float64
        attn_implementation="sdpa", experts_implementation="eager")
    torch.manual_seed(seed)
    model: nn.Module = Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes)).to(dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    if dtype == torch.float64 if wide is None else wide:
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.forward = types.MethodType(_router_wide, module)
            elif type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_norm_wide, module)
    return model.train()


def _norm_wide(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm.forward in the input's dtype."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))  # type: ignore[no-any-return]


def _router_wide(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's TopKRouter.forward in the logits' dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = nn.functional.linear(hidden_states, self.weight)
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), chosen


class TokenMoE(nn.Module):
    """A causal token model of one's own: an embedding, ``layers`` token-choice MoE layers (a linear
    ``router`` whose output is the logits, ``top_k`` of ``experts`` tanh experts weighted by their
    softmax probabilities, a residual; each token sees the previous one through a shift), a head.
    Much cheaper per call than a Hugging Face model: the training run's model."""

    def __init__(self, vocab: int, hidden: int = 32, experts: int = 8, top_k: int = 2, layers: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.top_k = top_k
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.ModuleList(nn.Linear(2 * hidden, hidden) for _ in range(layers))
        self.routers = nn.ModuleList(nn.Linear(hidden, experts, bias=False) for _ in range(layers))
        self.experts = nn.ModuleList(nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
                                     for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` of the next token."""
        x = self.embed(ids)
        for mix, router, experts in zip(self.mix, self.routers, self.experts, strict=True):
            previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
            x = x + torch.tanh(mix(torch.cat([x, previous], dim=-1)))
            flat = x.reshape(-1, x.shape[-1])
            weights, chosen = router(flat).softmax(-1).topk(self.top_k, dim=-1)
            out = torch.zeros_like(flat)
            layer: Any = experts
            for e, expert in enumerate(layer):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                out = out.index_add(0, rows, weights[rows, slot, None] * torch.tanh(expert(flat[rows])))
            x = x + out.view_as(x)
        return self.head(x)  # type: ignore[no-any-return]


def padded_batches(sizes: Sequence[int], seq: int, vocab: int, seed: int) -> list[Batch]:
    """Micro-batches of ``sizes[j]`` right-padded sequences of ``seq`` tokens (lengths differ).

    Each is ``{"input_ids", "attention_mask", "labels"}``, the labels ``PAD`` where the mask is 0.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        lengths = torch.randint(2, seq + 1, (n,), generator=g)
        mask = (torch.arange(seq) < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, PAD)
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def domain_batches(n: int, size: int, seq: int, vocab: int, domains: int, seed: int) -> list[Batch]:
    """``n`` micro-batches of ``size`` sequences, each micro-batch drawn from ONE domain.

    A domain is its own slice of the vocabulary walked by its own fixed successor table (with 10%
    noise), so the next token is learnable within a domain, and a micro-batch (one source, as packed
    data often is) routes very unevenly while the window (several domains) need not. The domains
    cycle over the micro-batches, shuffled within each cycle.
    """
    g = torch.Generator().manual_seed(seed)
    width = vocab // domains
    tables = [torch.randperm(width, generator=torch.Generator().manual_seed(d)) for d in range(domains)]
    out = []
    order: list[int] = []
    for _ in range(n):
        if not order:
            order = torch.randperm(domains, generator=g).tolist()
        d = order.pop()
        ids = torch.empty(size, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, width, (size,), generator=g)
        for t in range(1, seq):
            noise = torch.rand(size, generator=g) < 0.1
            anywhere = torch.randint(0, width, (size,), generator=g)
            ids[:, t] = torch.where(noise, anywhere, tables[d][ids[:, t - 1]])
        ids = ids + d * width
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def lm_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's summed cross-entropy over its shifted, unpadded labels."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                       ignore_index=PAD, reduction="sum")


def route_counts(logits: Sequence[torch.Tensor], mask: torch.Tensor, experts: int,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's routes per expert over the unmasked tokens, and the unmasked tokens.

    Returns:
        ``(counts, rows)``: counts ``(layers, experts)`` float64 (each token counts ``top_k``
        times), rows a float64 0-dim tensor.
    """
    flat = mask.reshape(-1).double()
    counts = []
    for layer in logits:
        chosen = torch.topk(layer.detach().double().softmax(-1), top_k, dim=-1).indices
        counts.append(torch.zeros(experts, dtype=torch.float64).scatter_add_(
            0, chosen.reshape(-1), flat.repeat_interleave(top_k)))
    return torch.stack(counts), flat.sum()


def aux_terms(logits: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Each layer's summed router probabilities over the unmasked tokens, ``(layers, experts)``
    float64, with gradient: the part of ``P`` one micro-batch holds."""
    flat = mask.reshape(-1, 1).double()
    return torch.stack([(layer.double().softmax(-1) * flat).sum(0) for layer in logits])


def window_aux(counts: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor, *,
               per_layer: bool = False) -> torch.Tensor:
    """The balancing loss from a window's counts and rows (summed over its micro-batches and ranks)
    and a sum of router probabilities (the whole window's, or one micro-batch's share of it).

    Pooled (``load_balancing_loss_func``): ``E x sum_i (sum_l c_li / (L rows)) (sum_l p_li / (L rows))``;
    ``per_layer``: ``sum_l E x sum_i (c_li / rows) (p_li / rows)``.
    """
    layers, experts = counts.shape
    if per_layer:
        return experts * (counts / rows * probs / rows).sum()
    return experts * (counts.sum(0) / (layers * rows) * probs.sum(0) / (layers * rows)).sum()


def _logits(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                output_router_logits=True)
    return out.logits, tuple(out.router_logits)


def _shape(model: nn.Module) -> tuple[int, int, float]:
    c: Any = model.config
    return c.num_experts, c.num_experts_per_tok, float(c.router_aux_loss_coef)


def window_reference(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer, *,
                     coef: float | None = None, per_layer: bool = False) -> float:
    """One step on the whole window at once: the mean token loss over every micro-batch plus
    ``coef`` x the whole window's balancing loss, written out in float64. Returns the loss."""
    experts, top_k, default = _shape(model)
    coef = default if coef is None else coef
    opt.zero_grad(set_to_none=True)
    outs = [_logits(model, b) for b in window]
    tokens = sum(int((b["labels"][:, 1:] != PAD).sum()) for b in window)
    lm = sum((lm_sum(lo, b["labels"]) for (lo, _), b in zip(outs, window, strict=True)),
             torch.zeros((), dtype=torch.float64)) / tokens
    parts = [(*route_counts(routers, b["attention_mask"], experts, top_k),
              aux_terms(routers, b["attention_mask"])) for (_, routers), b in zip(outs, window, strict=True)]
    counts, rows, probs = (torch.stack([part[i] for part in parts]).sum(0) for i in range(3))
    loss = lm.double() + coef * window_aux(counts, rows, probs, per_layer=per_layer)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss.detach())


def _tokens(window: Sequence[Batch]) -> int:
    return sum(int((b["labels"][:, 1:] != PAD).sum()) for b in window)


def hand_loop(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer) -> None:
    """The plain Hugging Face loop: ``outputs.loss`` (its micro-batch's balancing loss inside),
    weighted by the micro-batch's share of the window's tokens; one step."""
    total = _tokens(window)
    for b in window:
        out = model(**b, output_router_logits=True)
        (out.loss * (int((b["labels"][:, 1:] != PAD).sum()) / total)).backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)


def _window_counts(model: nn.Module, window: Sequence[Batch], *, reduce: Callable[[torch.Tensor], None]
                   | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-pass: every micro-batch forward without grad, its routes counted (then ``reduce``d:
    summed over ranks, in place, on one vector)."""
    experts, top_k, _ = _shape(model)
    state = torch.get_rng_state()
    parts = []
    with torch.no_grad():
        for b in window:
            _, routers = _logits(model, b)
            parts.append(route_counts(routers, b["attention_mask"], experts, top_k))
    torch.set_rng_state(state)
    counts = torch.stack([c for c, _ in parts]).sum(0)
    rows = torch.stack([r for _, r in parts]).sum()
    if reduce is not None:
        flat = torch.cat([counts.flatten(), rows.reshape(1)])
        reduce(flat)
        counts, rows = flat[:-1].view_as(counts), flat[-1]
    return counts, rows


def two_pass_loop(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer, *,
                  tokens: int | None = None, reduce: Callable[[torch.Tensor], None] | None = None,
                  per_layer: bool = False) -> None:
    """Correct by hand: the pre-pass counts the window's routes (over every rank with ``reduce``,
    an in-place sum such as ``dist.all_reduce``; ``tokens`` then the window's tokens over every
    rank), then each micro-batch's backward carries its token share of the language-model loss
    and its exact share of the window's balancing loss; one step (data parallel: the caller's
    gradient sum over ranks happens in its backward, e.g. DDP)."""
    _, _, coef = _shape(model)
    counts, rows = _window_counts(model, window, reduce=reduce)
    total = _tokens(window) if tokens is None else tokens
    for b in window:
        logits, routers = _logits(model, b)
        aux = window_aux(counts, rows, aux_terms(routers, b["attention_mask"]), per_layer=per_layer)
        (lm_sum(logits, b["labels"]).double() / total + coef * aux).backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)


def rolling_loop(model: nn.Module, window: Sequence[Batch], opt: torch.optim.Optimizer) -> None:
    """``f`` from the routes counted so far in the window (this micro-batch's included), ``P``
    from this micro-batch's probabilities over the window's masked tokens; one step."""
    experts, top_k, coef = _shape(model)
    total = _tokens(window)
    rows = torch.stack([b["attention_mask"].sum() for b in window]).sum().double()
    seen = torch.zeros(())
    seen_rows = torch.zeros((), dtype=torch.float64)
    for b in window:
        logits, routers = _logits(model, b)
        c, r = route_counts(routers, b["attention_mask"], experts, top_k)
        seen, seen_rows = seen + c, seen_rows + r
        f = seen / seen_rows  # the running fraction stands in for the window's
        aux = window_aux(f * rows, rows, aux_terms(routers, b["attention_mask"]))
        (lm_sum(logits, b["labels"]).double() / total + coef * aux).backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)
