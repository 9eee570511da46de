"""Rank side of tests/distributed/test_moe_pipeline.py: MoE layers on every pipeline stage, 2 gloo
ranks, ``Schedule1F1B`` (one stage per rank) and ``ScheduleInterleaved1F1B`` (two per rank).

The model is a token model of one's own (an embedding, one token-choice MoE layer per stage with a
residual, a head), split into stages of one MoE layer each; the balancing loss is per layer
(``per_layer=True``: each layer's ``E x sum_i f_i P_i`` summed), every token routed (the routers see
padded label positions too, as a pipeline stage has no attention mask). The reference trains the
unsplit model in one process on each window's whole batch: the summed token loss over the window's
valid tokens plus ``coef`` x the whole window's balancing loss, written out here; one step.

Each scenario trains 3 windows of ``STEPS`` ``step()`` calls x ``N_MB`` pipeline micro-batches:

- ``hand``: correct by hand: a forward-only run of the schedule (``schedule.eval`` under
  ``no_grad``) counts each stage's routes over the window, then every ``step()``'s backward carries
  its exact share of the window's balancing loss, attached to the router's logits (Megatron's
  ``MoEAuxLossAutoScaler``: the gradient enters the stage's own backward, which the schedule runs);

``LoadBalance`` does not yet run under ``backward_pipeline`` (docs/MOE.md, "Pipeline"): this is the
recipe by hand, and the harness its integration is to be tested on. Two things it shows: the
schedule's forward-only run (``schedule.eval``) is a usable pre-pass, and the schedule runs one
extra forward of a real micro-batch at its first call and at every switch between ``eval`` and
``step`` (its metadata inference), which a count of routes must leave out (:meth:`Stages.on_inference`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradaccum.bench.pipeline import PAD, SCHEDULES, sgd, stage_indices, token_sum, window_batches
from tests.ranks import run_scenarios

STEPS, N_MB, SEQS, WINDOWS, EXPERTS, TOP_K, HIDDEN, VOCAB, COEF = 2, 4, 8, 3, 4, 2, 8, 13, 0.5


class MoE(nn.Module):
    """A token-choice MoE layer with a residual: ``router`` (a Linear whose output is the logits),
    ``TOP_K`` of ``EXPERTS`` tanh experts, weighted by their softmax probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = self.router(flat).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out = out.index_add(0, rows, weights[rows, slot, None] * torch.tanh(expert(flat[rows])))
        return x + out.view_as(x)


def full_model(n_stages: int) -> nn.Sequential:
    """``n_stages`` stages of (embedding?, MoE, head?): stage ``s`` is ``model[s]``."""
    torch.manual_seed(0)
    stages: list[nn.Module] = []
    for s in range(n_stages):
        parts: list[nn.Module] = [nn.Embedding(VOCAB, HIDDEN)] if s == 0 else []
        parts.append(MoE())
        if s == n_stages - 1:
            parts.append(nn.Linear(HIDDEN, VOCAB))
        stages.append(nn.Sequential(*parts))
    return nn.Sequential(*stages).double()


def routers(module: nn.Module) -> list[nn.Module]:
    return [m.router for m in module.modules() if isinstance(m, MoE)]


def counts_of(logits: torch.Tensor) -> torch.Tensor:
    chosen = logits.detach().softmax(-1).topk(TOP_K, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=EXPERTS).double()


def reference(n_stages: int, windows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> nn.Sequential:
    """One process, one step per window on its whole batch, the balancing loss written out."""
    model = full_model(n_stages)
    opt = sgd(model.parameters())
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o)) for r in routers(model)]
    for window in windows:
        opt.zero_grad(set_to_none=True)
        seen.clear()
        tokens = torch.cat([t for t, _ in window])
        labels = torch.cat([y for _, y in window])
        loss = token_sum(model(tokens), labels) / (labels != PAD).sum()
        for logits in seen:  # one per layer, every token of the window
            f = counts_of(logits) / logits.shape[0]
            p = logits.softmax(-1).mean(0)
            loss = loss + COEF * EXPERTS * (f * p).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    for h in hooks:
        h.remove()
    return model


class _AuxScaler(torch.autograd.Function):
    """The identity on the router's logits whose backward also backpropagates ``aux`` (seed 1)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class Stages:
    """This rank's stage modules (copies of ``full_model``'s) and a schedule over them."""

    def __init__(self, kind: str, rank: int, world: int, loss_fn: Callable[..., torch.Tensor]) -> None:
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        virtual = 2 if kind in ("interleaved", "zb") else 1
        self.n_stages = world * virtual
        self.indices = stage_indices(rank, world, virtual)
        full = full_model(self.n_stages)
        self.mods = [copy.deepcopy(full[i]) for i in self.indices]
        cpu = torch.device("cpu")
        stages = [PipelineStage(m, i, self.n_stages, cpu)
                  for m, i in zip(self.mods, self.indices, strict=True)]
        cls = getattr(pipelining, SCHEDULES[kind])
        self.schedule = cls(stages if virtual > 1 else stages[0], N_MB, loss_fn=loss_fn, scale_grads=False)
        self.model = self.mods[0] if virtual == 1 else nn.ModuleList(self.mods)
        self.first, self.last = rank == 0, rank == world - 1
        self.stages = stages

    def on_inference(self, flag: Callable[[bool], None]) -> None:
        """Call ``flag(True)`` / ``flag(False)`` around the schedule's metadata inference: at its
        first call and at each switch between ``eval`` and ``step``, it runs the stage's forward
        on a real micro-batch that no call trains on."""
        for stage in self.stages:
            real = stage._prepare_forward_infra

            def wrapped(*args: Any, real: Any = real, **kwargs: Any) -> Any:
                flag(True)
                try:
                    return real(*args, **kwargs)
                finally:
                    flag(False)
            stage._prepare_forward_infra = wrapped  # type: ignore[method-assign]

    def args(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (tokens,) if self.first else ()

    def diff(self, ref: nn.Sequential) -> float:
        want = [p for i in self.indices for p in ref[i].parameters()]
        got = [p for m in self.mods for p in m.parameters()]
        return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


def data() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [window_batches(w, STEPS, 1, SEQS, vocab=VOCAB)[0] for w in range(WINDOWS)]


def hand(rank: int, world: int, kind: str, skip_inference: bool = True) -> dict[str, Any]:
    """Correct by hand: the pre-pass is a forward-only run of the schedule (``skip_inference=False``:
    the schedule's metadata-inference forwards counted too, the mistake a hook makes)."""
    total = torch.ones((), dtype=torch.float64)
    pipe = Stages(kind, rank, world, lambda out, y: token_sum(out, y) / total)
    opt = sgd(pipe.model.parameters())
    rs = routers(pipe.model)
    state: dict[str, Any] = {"counting": False, "inferring": False}
    if skip_inference:
        pipe.on_inference(lambda flag: state.__setitem__("inferring", flag))
    counts = {id(r): torch.zeros(EXPERTS, dtype=torch.float64) for r in rs}

    def hook(router: nn.Module, inputs: Any, logits: torch.Tensor) -> torch.Tensor | None:
        if state["inferring"]:  # the schedule's shape inference: a forward that is no micro-batch's
            return None
        if state["counting"]:
            counts[id(router)] += counts_of(logits)
            return None
        f = counts[id(router)] / state["rows"]
        aux = COEF * EXPERTS * (f * logits.softmax(-1).sum(0) / state["rows"]).sum()
        return _AuxScaler.apply(logits, aux)

    for r in rs:
        r.register_forward_hook(hook)
    windows = data()
    for window in windows:
        total = sum((y != PAD).sum() for _, y in window).double()  # the loss_fn's divisor, read at call time
        state["rows"] = float(sum(t.numel() for t, _ in window))
        for c in counts.values():
            c.zero_()
        state["counting"] = True
        with torch.no_grad():
            for tokens, labels in window:
                pipe.schedule.eval(*pipe.args(tokens), target=labels if pipe.last else None)
        state["counting"] = False
        for tokens, labels in window:
            pipe.schedule.step(*pipe.args(tokens), target=labels if pipe.last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"diff": pipe.diff(reference(pipe.n_stages, windows))}


def chunk_reference(n_stages: int, windows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
                    mode: str, items: bool = True) -> nn.Sequential:
    """One process, one step per window on its whole batch, for the one-pass modes under a
    pipeline: the balancing loss per layer of each pipeline micro-batch (call ``j``, chunk ``c``, in
    the window's order), over the valid label positions, ``f`` from its own routes
    (``"micro_batch"``), from the routes of the window's chunks up to it (``"rolling"``) or from the
    whole window's (``"global"``: the window's loss over its valid tokens), ``P`` its probability
    sums over the window's tokens; ``"none"``: no balancing loss. The language-model loss: the
    window's token mean (``items``) or the mean of the chunks' token means."""
    model = full_model(n_stages)
    opt = sgd(model.parameters())
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o)) for r in routers(model)]
    for window in windows:
        opt.zero_grad(set_to_none=True)
        seen.clear()
        tokens = torch.cat([t for t, _ in window])
        labels = torch.cat([y for _, y in window])
        out = model(tokens)
        chunks = [(j * SEQS + idx) for j in range(len(window))
                  for idx in torch.tensor_split(torch.arange(SEQS), N_MB)]
        if items:
            loss = token_sum(out, labels) / (labels != PAD).sum()
        else:
            loss = sum(token_sum(out[g], labels[g]) / (labels[g] != PAD).sum() for g in chunks) / len(chunks)
        valid = (labels != PAD).double()  # (sequences, positions)
        total = valid.sum()
        for logits in seen if mode != "none" else []:
            p = logits.view(*labels.shape, EXPERTS).softmax(-1)
            chosen = p.detach().topk(TOP_K, dim=-1).indices
            routes = torch.zeros(*labels.shape, EXPERTS, dtype=torch.float64).scatter_(-1, chosen, 1.0)
            cum_c, cum_t = torch.zeros(EXPERTS, dtype=torch.float64), 0.0
            whole = ((routes * valid.unsqueeze(-1)).sum((0, 1)), float(total))
            for g in chunks:
                m = valid[g].unsqueeze(-1)
                c_g, t_g = (routes[g] * m).sum((0, 1)), float(valid[g].sum())
                cum_c, cum_t = cum_c + c_g, cum_t + t_g
                c, t = {"micro_batch": (c_g, t_g), "rolling": (cum_c, cum_t), "global": whole}[mode]
                s_g = (p[g] * m).sum((0, 1))
                loss = loss + COEF * EXPERTS * (c / (TOP_K * t) * s_g / total).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    for h in hooks:
        h.remove()
    return model


OTHER = {"rolling": "micro_batch", "micro_batch": "rolling"}


def valid(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return batch[1] != PAD


def balanced(rank: int, world: int, kind: str, mode: str, items: bool = True,
             reentrant: bool | None = None, short: bool = False) -> dict[str, Any]:
    """``LoadBalance`` under ``backward_pipeline``: every rank loads the whole batch (its mask and
    counts), the first stage its tokens, the last its labels; ``reentrant``: each MoE layer under
    activation checkpointing (its router recomputed in the backward); ``short``: the last window
    one call short (``windows()`` flushes it)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    import gradaccum
    from gradaccum.bench.pipeline import token_mean
    from gradaccum.moe import LoadBalance

    pipe = Stages(kind, rank, world, token_sum if items else token_mean)
    if reentrant is not None:
        for m in pipe.model.modules():
            if isinstance(m, MoE):
                m.forward = functools.partial(  # type: ignore[method-assign]
                    checkpoint, m.forward, use_reentrant=reentrant)
    acc = gradaccum.Accumulator(sgd(pipe.model.parameters()), steps=STEPS, model=pipe.model)
    balance = LoadBalance(pipe.model, routers=routers(pipe.model), mode=mode, per_layer=True,
                          top_k=TOP_K, coef=COEF, num_experts=EXPERTS)
    windows = data()
    if short:
        windows[-1] = windows[-1][:1]
    loader = [b for window in windows for b in window]
    count = (lambda y: (y != PAD).sum()) if items else None
    loads: list[float] = []
    balance.on_window(lambda load: loads.append(load.sum().item()))
    for window in balance.windows(loader, acc, mask=valid,
                                  n_items=(lambda b: valid(b).sum()) if items else None):
        for tokens, labels in window:
            acc.backward_pipeline(pipe.schedule, *pipe.args(tokens), target=labels if pipe.last else None,
                                  n_items=count if pipe.last else None, reduction="sum" if items else "mean")
    return {"diff": pipe.diff(chunk_reference(pipe.n_stages, windows, mode, items)),
            "from_global": pipe.diff(chunk_reference(pipe.n_stages, windows, "global", items)),
            "from_other": pipe.diff(chunk_reference(pipe.n_stages, windows, OTHER[mode], items)),
            "from_none": pipe.diff(chunk_reference(pipe.n_stages, windows, "none", items)),
            "steps": acc.optimizer_steps, "loads": loads,
            "expected_loads": [float(TOP_K * len(balance.routers) * sum(valid(b).sum() for b in w))
                               for w in windows]}


def recipe(rank: int, world: int) -> dict[str, Any]:
    """docs/MOE.md's ``moe-pipeline`` recipe, run as printed on this rank's stage of a 1F1B pipeline:
    its largest difference from one process on the whole window ("rolling", per pipeline
    micro-batch)."""
    from pathlib import Path

    from tests.integrations.common import run as run_recipe

    full = full_model(world)
    stage_module = copy.deepcopy(full[rank])
    windows = data()
    namespace = {"stage_module": stage_module, "routers": routers(stage_module), "pp_rank": rank,
                 "pp_size": world, "device": torch.device("cpu"), "is_first": rank == 0,
                 "is_last": rank == world - 1, "n_microbatches": N_MB, "steps": STEPS, "loss_fn": token_sum,
                 "num_experts": EXPERTS, "top_k": TOP_K, "coef": COEF,
                 "loader": [b for window in windows for b in window]}
    run_recipe("moe-pipeline", namespace, doc=Path(__file__).resolve().parents[2] / "docs" / "MOE.md")
    want = chunk_reference(world, windows, "rolling")[rank]
    diff = max(float((a - b).abs().max()) for a, b in zip(stage_module.parameters(), want.parameters(),
                                                          strict=True))
    return {"diff": diff, "steps": namespace["acc"].optimizer_steps}


def refused(rank: int, world: int, mode: str, per_layer: bool) -> dict[str, Any]:
    """What is not supported is refused on every rank before anything changes; the same loop
    without the balance then trains (the twin)."""
    import gradaccum
    from gradaccum.moe import LoadBalance
    from gradaccum.torch.pipeline.sync import PipelineSync

    pipe = Stages("1f1b", rank, world, token_sum)
    acc = gradaccum.Accumulator(sgd(pipe.model.parameters()), steps=STEPS, model=pipe.model)
    balance = LoadBalance(pipe.model, routers=routers(pipe.model), mode=mode, per_layer=per_layer,
                          top_k=TOP_K, coef=COEF, num_experts=EXPERTS)
    before = [p.detach().clone() for p in pipe.model.parameters()]
    window = data()[0]
    count = (lambda y: (y != PAD).sum()) if pipe.last else None
    refusal = None
    try:
        for batches in balance.windows(window, acc, mask=valid, n_items=lambda b: valid(b).sum()):
            tokens, labels = batches[0]
            acc.backward_pipeline(pipe.schedule, *pipe.args(tokens), target=labels if pipe.last else None,
                                  n_items=count, reduction="sum")
    except (ValueError, NotImplementedError) as e:
        refusal = f"{type(e).__name__}: {e}"
    unchanged = (acc.micro_step == 0 and not isinstance(acc.grad_sync, PipelineSync)
                 and all(p.grad is None for p in pipe.model.parameters())
                 and all(torch.equal(a, p) for a, p in zip(before, pipe.model.parameters(), strict=True)))
    balance.remove()
    for tokens, labels in window:  # the twin: without the balance, the same loop trains
        acc.backward_pipeline(pipe.schedule, *pipe.args(tokens), target=labels if pipe.last else None,
                              n_items=count, reduction="sum")
    return {"refusal": refusal, "unchanged": unchanged, "steps": acc.optimizer_steps}


if __name__ == "__main__":
    run_scenarios({
        "hand 1f1b": lambda r, w: hand(r, w, "1f1b"),
        "hand interleaved": lambda r, w: hand(r, w, "interleaved"),
        "hand 1f1b inference counted": lambda r, w: hand(r, w, "1f1b", skip_inference=False),
        **{f"balance {kind} {mode}": (lambda r, w, kind=kind, mode=mode: balanced(r, w, kind, mode))
           for kind in ("1f1b", "interleaved") for mode in ("rolling", "micro_batch")},
        "balance gpipe rolling": lambda r, w: balanced(r, w, "gpipe", "rolling"),
        "balance zb rolling": lambda r, w: balanced(r, w, "zb", "rolling"),
        "balance 1f1b rolling checkpoint": lambda r, w: balanced(r, w, "1f1b", "rolling", reentrant=False),
        "balance 1f1b rolling short": lambda r, w: balanced(r, w, "1f1b", "rolling", short=True),
        "balance 1f1b micro_batch mean short": lambda r, w: balanced(r, w, "1f1b", "micro_batch",
                                                                     items=False, short=True),
        "balance 1f1b rolling mean": lambda r, w: balanced(r, w, "1f1b", "rolling", items=False),
        "recipe": recipe,
        "refused global": lambda r, w: refused(r, w, "global", True),
        "refused pooled": lambda r, w: refused(r, w, "rolling", False),
    })
