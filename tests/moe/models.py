"""Tiny mixture-of-experts models, padded token data and the references the balance is tested
against: the whole window in one process, its loss written out here (not the library's).

Models: Hugging Face Qwen3-MoE and Mixtral built from tiny configs (no download), and
:class:`TinyMoE`, a model of our own whose routers return logits (with an optional routing bias,
for the auxiliary-loss-free test). float64 throughout.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.functional import cross_entropy

import gradaccum

VOCAB, SEQ = 32, 6
SIZES = (3, 3, 2)  # sequences per micro-batch: an uneven window
COEF = 0.5


# ---------------------------------------------------------------------- models
def qwen3_moe(seed: int = 0, wide: bool = True) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=COEF,
                            decoder_sparse_step=1, max_position_embeddings=64, norm_topk_prob=True,
                            attn_implementation="sdpa", experts_implementation="eager")
    return _decisive(Qwen3MoeForCausalLM(config).double(), wide)


def mixtral(seed: int = 0, wide: bool = True) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, router_aux_loss_coef=COEF, max_position_embeddings=64,
                           router_jitter_noise=0.0, attn_implementation="sdpa",
                           experts_implementation="eager")
    return _decisive(MixtralForCausalLM(config).double(), wide)


def qwen2_moe(seed: int = 0) -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            shared_expert_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=COEF, decoder_sparse_step=1, max_position_embeddings=64,
                            attn_implementation="sdpa", experts_implementation="eager")
    return _decisive(Qwen2MoeForCausalLM(config).double())


def olmoe(seed: int = 0) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                         router_aux_loss_coef=COEF, max_position_embeddings=64, eos_token_id=1,
                         pad_token_id=1, attn_implementation="sdpa", experts_implementation="eager")
    return _decisive(OlmoeForCausalLM(config).double())


def _decisive(model: nn.Module, wide: bool = True) -> nn.Module:
    """Router weights drawn wide, so that no two experts tie for a token (a tie would make the
    top-k choice depend on rounding), the routers computing in float64 (``wide``), and the model
    in training mode.

    Why ``wide``: in a float64 model, Hugging Face's routers take their softmax in float32
    (``dtype=torch.float``, ``router_logits.float()``), RMSNorm upcasts to float32, eager
    attention takes its softmax in float32 (so these models use SDPA, float64 throughout) and the
    LM loss upcasts the logits to float32. A float32 step in the backward rounds each gradient
    relative to the scale of the seed it started from, and accumulation seeds each micro-batch
    at another scale than one backward of the window: measured, plain gradaccum (no MoE loss)
    on this Qwen3-MoE differs from the window's one backward by 1.7e-8 in the gradient. So the
    tests give the routers and norms the same code in float64, and compute the LM loss from
    the logits in float64 (``lm_loss``); one test keeps the original float32 steps (at 1e-6).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    if wide:
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.forward = types.MethodType(_router64, module)
            elif type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms64, module)
    return model.train()


def _rms64(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm.forward in the input's dtype (its own upcasts to float32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))  # type: ignore[no-any-return]


def _router64(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's TopKRouter.forward (Qwen2/3-MoE, Mixtral, OLMoE) in the logits' dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)
    top, chosen = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top, chosen


class Router(nn.Module):
    """Logits ``(tokens, experts)`` of a linear router, plus a routing bias (a buffer)."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, experts, bias=False)
        self.register_buffer("bias", torch.zeros(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h.reshape(-1, h.shape[-1])) + self.bias  # type: ignore[no-any-return]


class MoELayer(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.router = Router(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.top_k = top_k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x), dim=-1)
        weight, chosen = torch.topk(probs, self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            picked = (chosen == e)
            w = (weight * picked).sum(-1, keepdim=True)
            out = out + w * torch.tanh(expert(x))
        return (x + out).reshape(shape)


class TinyMoE(nn.Module):
    """Embedding, ``layers`` MoE layers, a head: a language model of our own."""

    def __init__(self, layers: int = 2, experts: int = 4, top_k: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(MoELayer(dim, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, labels: Any = None) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return {"logits": logits, "loss": None if labels is None else lm_loss(logits, labels)}

    @property
    def routers(self) -> list[nn.Module]:
        return [layer.router for layer in self.layers]


def tiny_moe(seed: int = 0, **kw: Any) -> TinyMoE:
    torch.manual_seed(seed)
    model = TinyMoE(**kw).double()
    with torch.no_grad():
        for r in model.routers:
            r.proj.weight.normal_(0.0, 1.5)  # type: ignore[union-attr]
    return model


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The router modules, found by this test's own rule (not the library's)."""
    inner = getattr(model, "module", model)
    if isinstance(inner, TinyMoE):
        return inner.routers
    return [m for name, m in inner.named_modules() if name.endswith("mlp.gate")]


# ---------------------------------------------------------------------- data
def lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """A causal LM's loss: the next token, padding (-100) ignored."""
    return cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                         ignore_index=-100, reduction=reduction)


def batches(window: int, sizes: tuple[int, ...] = SIZES, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One window's micro-batches of padded sequences (right padding of 0 to 3 tokens)."""
    g = torch.Generator().manual_seed(1000 * seed + window)
    out = []
    for b in sizes:
        ids = torch.randint(0, VOCAB, (b, SEQ), generator=g)
        lengths = torch.randint(SEQ - 3, SEQ + 1, (b,), generator=g)
        mask = (torch.arange(SEQ) < lengths.unsqueeze(1)).long()
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def concat(micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in micro]) for k in micro[0]}


def count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return gradaccum.count_tokens(batch["labels"], shift=True)


# ---------------------------------------------------------------------- the balancing loss, by hand
class Logits:
    """Records every router's logits of the forwards run inside ``with``."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = routers
        self.seen: list[torch.Tensor] = []

    def __enter__(self) -> Logits:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            self.seen.append(output[0] if isinstance(output, tuple) else output)
        self.handles = [r.register_forward_hook(hook) for r in self.routers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def stats(logits: list[torch.Tensor], mask: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, the masked routes ``C`` (no gradient) and probability sums ``S`` of each expert."""
    m = mask.reshape(-1).double()
    counts, sums = [], []
    for z in logits:
        p = torch.softmax(z.double(), dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices
        onehot = torch.zeros_like(p).scatter_(1, chosen, 1.0)
        counts.append((onehot * m[:, None]).sum(0))
        sums.append((p * m[:, None]).sum(0))
    return torch.stack(counts), torch.stack(sums)


def balance_loss(counts: torch.Tensor, sums: torch.Tensor, counted: Any, tokens: Any, top_k: int,
                 per_layer: bool, coef: float = COEF) -> torch.Tensor:
    """``coef * E * sum_i f_i P_i``: f from ``counts`` over ``counted`` tokens, P from ``sums`` over
    ``tokens``; pooled over the layers as Hugging Face does, or summed per layer."""
    layers, experts = counts.shape
    if per_layer:
        f, p = counts / (top_k * counted), sums / tokens
        return coef * experts * (f * p).sum()
    f, p = counts.sum(0) / (layers * counted), sums.sum(0) / (layers * tokens)
    return coef * experts * (f * p).sum()


# ---------------------------------------------------------------------- training
def make_opt(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


CLIP = 0.05  # small enough to act on every window (checked)


def outputs_loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


def reference(model: nn.Module, windows: list[list[dict[str, torch.Tensor]]], mode: str, top_k: int,
              per_layer: bool = False, coef: float = COEF,
              after: Callable[[nn.Module, torch.Tensor], None] | None = None, whole: bool = False,
              items_weighted: bool = True, ranks: int = 1) -> dict[str, Any]:
    """One process, by hand: each window's loss written out (the LM loss over every token of the
    window plus the balancing loss of ``mode``), one backward per window (``"global"``) or per
    micro-batch (the one-pass modes), clip, step, schedule. The LM loss is the mean over the
    window's tokens (``items_weighted``) or the mean of the micro-batches' means. With ``ranks``,
    a window's micro-batches are the ranks' in rank order (rank r's j-th at ``r * k + j``), and
    "rolling" counts micro-batch j of every rank before their backward (as the ranks do)."""
    model = copy.deepcopy(model)
    routers = routers_of(model)
    opt, sched = make_opt(model)
    norms = []
    for micro in windows:
        opt.zero_grad(set_to_none=True)
        tokens = sum(float(b["attention_mask"].sum()) for b in micro)
        items = sum(float(count(b)) for b in micro)
        load = torch.zeros(0)
        if mode == "global":
            # The whole window's loss, one backward. Its forward runs on the micro-batches (or on
            # the window in one piece, ``whole``): Hugging Face's float32 routing and norms round
            # a token differently with the batch around it (models.py, _decisive).
            parts = [concat(micro)] if whole else micro
            lm, counts, sums = 0.0, 0.0, 0.0
            for b in parts:
                with Logits(routers) as rec:
                    out = model(**b)
                logits = out["logits"] if isinstance(out, dict) else out.logits
                c, s = stats(rec.seen, b["attention_mask"], top_k)
                part = (lm_loss(logits, b["labels"], "sum") / items if items_weighted
                        else lm_loss(logits, b["labels"]) / len(parts))
                lm, counts, sums = lm + part, counts + c, sums + s
            loss = lm + balance_loss(counts, sums, tokens, tokens, top_k, per_layer, coef)
            loss.backward()
            load = counts
        else:
            cum: Any = 0.0
            cum_tokens = 0.0
            k = len(micro) // ranks
            for j in range(k):  # micro-batch j of every rank
                step = [micro[r * k + j] for r in range(ranks)]
                outs = []
                for b in step:
                    with Logits(routers) as rec:
                        out = model(**b)
                    logits = out["logits"] if isinstance(out, dict) else out.logits
                    outs.append((b, logits, *stats(rec.seen, b["attention_mask"], top_k)))
                cum = cum + sum(o[2] for o in outs)
                cum_tokens += sum(float(b["attention_mask"].sum()) for b in step)
                for b, logits, counts, sums in outs:
                    own = float(b["attention_mask"].sum())
                    if mode == "rolling":
                        aux = balance_loss(cum, sums, cum_tokens, tokens, top_k, per_layer, coef)
                    else:  # micro_batch: its own loss, times its share of the window's tokens
                        aux = balance_loss(counts, sums, own, own, top_k, per_layer, coef) * (own / tokens)
                    lm = (lm_loss(logits, b["labels"], "sum") / items if items_weighted
                          else lm_loss(logits, b["labels"]) / len(micro))
                    (lm + aux).backward()
                    load = counts if load.numel() == 0 else load + counts
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        if after is not None:
            after(model, load)
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "model": model}


def train(model: nn.Module, windows: list[list[dict[str, torch.Tensor]]], steps: int, items: bool = True,
          after_window: Callable[[nn.Module, torch.Tensor], None] | None = None, hf_loss: bool = False,
          **balance_kw: Any) -> dict[str, Any]:
    """The library's loop: ``LoadBalance`` over ``acc.backward`` of each micro-batch's own loss."""
    model = copy.deepcopy(model)
    opt, sched = make_opt(model)
    acc = gradaccum.Accumulator(opt, steps, clip_norm=CLIP, scheduler=sched)
    routers = balance_kw.pop("routers", None)
    if routers == "own":
        routers = routers_of(model)
    balance = gradaccum.moe.LoadBalance(model, routers=routers, **balance_kw)
    if after_window is not None:
        balance.on_window(lambda load: after_window(model, load))
    loader = [b for micro in windows for b in micro]
    norms: list[float] = []
    acc.register_boundary_hook(lambda a: norms.append(float(a.grad_norm)))
    for window in balance.windows(loader, acc, n_items=count if items else None):
        for batch in window:
            # The LM loss in float64 from the logits: Hugging Face's own (outputs.loss) is
            # computed in float32 (ForCausalLMLoss upcasts to float32 only), 1e-8 off.
            out = model(**batch)
            loss = (out.loss if hf_loss else
                    lm_loss(out["logits"] if isinstance(out, dict) else out.logits, batch["labels"]))
            acc.backward(loss, n_items=count(batch) if items else None)
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "acc": acc,
            "balance": balance, "model": model}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
