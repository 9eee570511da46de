"""Rank side of tests/distributed/test_pipeline.py: every 2-rank pipeline scenario, one launch.

Each scenario builds its stages and schedule afresh (:class:`Pipe`), trains through
``Accumulator.backward_pipeline`` and compares every stage with the one-process reference of
:mod:`gradaccum.bench.pipeline` (every rank computes it: cheap at this size). The 4-rank launch
(tests/distributed/pipeline4_ranks.py) reuses :func:`train` and :class:`Pipe`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum.bench.pipeline import (
    LOOPS,
    PipelineLoop,
    build,
    count,
    full_model,
    layout,
    max_diff,
    reference,
    sgd,
    stage_params,
    token_mean,
    token_sum,
    window_batches,
)
from tests.ranks import run_scenarios

STEPS, N_MB, SEQS, WINDOWS, CLIP = 3, 4, 8, 3, 0.05  # CLIP: below every window's norm, so it acts


def one_replica(world: int) -> tuple[Any, Any, int, int]:
    """The layout of ``world`` pipeline ranks with a data-parallel mesh of one rank each, so that a
    stage module can be wrapped in ``fully_shard`` on 2 ranks (torchtitan's mesh with dp=1)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"], dist.get_rank(), 0


def halve(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


class Pipe:
    """One pipeline on this rank: stage modules, schedule, optimizer, scheduler, accumulator."""

    def __init__(self, world: int, kind: str = "1f1b", *, pp: int | None = None, virtual: int = 1,
                 reduction: str = "sum", dp: str | None = None, steps: int = STEPS,
                 clip: float | None = CLIP, dtype: torch.dtype = torch.float64, layout_: Any = None,
                 loss_fn: Any = "auto", scale_grads: bool = False, **acc_kwargs: Any) -> None:
        self.pp = world if pp is None else pp
        self.replicas, self.virtual, self.reduction = world // self.pp, virtual, reduction
        self.pp_group, self.dp_mesh, self.pp_rank, self.dp_rank = layout_ or layout(world, self.pp)
        self.full = full_model(self.pp * virtual, dtype)
        if loss_fn == "auto":
            loss_fn = token_sum if reduction == "sum" else token_mean
        self.schedule, self.mods = build(kind, self.full, self.pp_rank, self.pp, N_MB, loss_fn,
                                         virtual=virtual, pp_group=self.pp_group, wrap=self._wrap(dp),
                                         scale_grads=scale_grads)
        self.model = self.mods[0] if len(self.mods) == 1 else nn.ModuleList(self.mods)
        self.opt = sgd(self.model.parameters())
        self.sched = halve(self.opt)
        self.acc = gradaccum.Accumulator(self.opt, steps, model=self.model, clip_norm=clip,
                                         scheduler=self.sched,
                                         **acc_kwargs)
        self.first, self.last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.steps = steps

    def _wrap(self, dp: str | None) -> Callable[[nn.Module], nn.Module] | None:
        if dp == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return lambda m: DDP(m, process_group=self.dp_mesh.get_group())
        if dp == "fsdp":
            from torch.distributed.fsdp import fully_shard

            return lambda m: fully_shard(m, mesh=self.dp_mesh)
        return None

    def data(self, windows: int = WINDOWS, offset: int = 0) -> list[list[list[Any]]]:
        return [window_batches(offset + w, self.steps, self.replicas, SEQS) for w in range(windows)]

    def feed(self, tokens: torch.Tensor, labels: torch.Tensor, **over: Any) -> bool:
        """One call with the inputs on the first stage and the labels and counts on the last."""
        kwargs: dict[str, Any] = {"target": labels if self.last else None,
                                  "n_items": count if self.last else None, "reduction": self.reduction}
        kwargs.update(over)
        args = (tokens,) if self.first else ()
        return self.acc.backward_pipeline(self.schedule, *args, **kwargs)

    def params(self) -> list[torch.Tensor]:
        """This rank's parameters (an FSDP2 stage's local shards: comparing DTensors is a collective)."""
        return [getattr(p, "to_local", p.detach)().detach().clone()
                for m in self.mods for p in m.parameters()]

    def diff(self, ref: nn.Sequential) -> float:
        return max_diff(self.mods, stage_params(ref, self.pp_rank, self.pp, self.virtual))


def train(rank: int, world: int, kind: str = "1f1b", *, items: bool = True, windows: int = WINDOWS,
          **options: Any) -> dict[str, Any]:
    """``windows`` windows of ``STEPS`` calls; the stages' largest difference from the reference."""
    pipe = Pipe(world, kind, **options)
    data = pipe.data(windows)
    stepped, losses, norms = [], [], []
    for window in data:
        for tokens, labels in window[pipe.dp_rank]:
            stepped.append(pipe.feed(tokens, labels, **({} if items else {"n_items": None})))
        losses.append(float(pipe.acc.window_loss))
        norms.append(None if pipe.acc.grad_norm is None else float(pipe.acc.grad_norm))
    clip = options.get("clip", CLIP)
    ref, ref_losses = reference(pipe.pp * pipe.virtual, data, sgd, clip, halve,
                                chunks=None if items else N_MB)
    return {"diff": pipe.diff(ref), "stepped": stepped, "losses": losses, "ref_losses": ref_losses,
            "norms": norms, "lr": pipe.opt.param_groups[0]["lr"], "optimizer_steps": pipe.acc.optimizer_steps,
            "world_size": pipe.acc.world_size}


def inf_in_window(rank: int, world: int, on_rank: int, **options: Any) -> dict[str, Any]:
    """Window 1 of 3 overflows on rank ``on_rank`` only: every stage must skip it alike."""
    pipe = Pipe(world, "1f1b", **options)
    flag = [False]
    if rank == on_rank:
        first = next(pipe.mods[0].parameters())
        first.register_hook(lambda g: g * math.inf if flag[0] else g)
    data = pipe.data()
    before = after = None
    scales = []
    for w, window in enumerate(data):
        flag[0] = w == 1
        if w == 1:
            before = pipe.params()
        for tokens, labels in window[pipe.dp_rank]:
            pipe.feed(tokens, labels)
        if w == 1:
            after = pipe.params()
        scaler = pipe.acc.scaler
        scales.append(None if scaler is None else scaler.get_scale())
    ref, _ = reference(pipe.pp, [data[0], data[2]], sgd, CLIP, halve)
    assert before is not None and after is not None
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "skipped": pipe.acc.skipped_windows, "steps": pipe.acc.optimizer_steps, "scales": scales,
            "diff": pipe.diff(ref), "lr": pipe.opt.param_groups[0]["lr"]}


def flush_partial(rank: int, world: int, **options: Any) -> dict[str, Any]:
    """Two full windows, then 2 calls of the third flushed on every rank: the third update is the
    mean over those 2 batches (of every replica)."""
    pipe = Pipe(world, **options)
    data = pipe.data()
    for w, window in enumerate(data):
        for tokens, labels in window[pipe.dp_rank][: STEPS if w < 2 else 2]:
            pipe.feed(tokens, labels)
    stepped = pipe.acc.flush()
    windows = [*data[:2], [replica[:2] for replica in data[2]]]
    ref, _ = reference(pipe.pp * pipe.virtual, windows, sgd, options.get("clip", CLIP), halve)
    return {"stepped": stepped, "diff": pipe.diff(ref), "steps": pipe.acc.optimizer_steps,
            "micro_step": pipe.acc.micro_step}


def discard_call(rank: int, world: int, **options: Any) -> dict[str, Any]:
    """A window's first call discarded on every rank, then the windows fed: as if never fed."""
    pipe = Pipe(world, **options)
    junk = window_batches(99, 1, pipe.replicas, SEQS)[pipe.dp_rank][0]
    pipe.feed(*junk)
    pipe.acc.discard()
    data = pipe.data(2)
    for window in data:
        for tokens, labels in window[pipe.dp_rank]:
            pipe.feed(tokens, labels)
    ref, _ = reference(pipe.pp * pipe.virtual, data, sgd, options.get("clip", CLIP), halve)
    return {"diff": pipe.diff(ref), "steps": pipe.acc.optimizer_steps}


def accum_dtype(rank: int, world: int) -> dict[str, Any]:
    """bfloat16 stages with float32 accumulation against one process feeding the same pipeline
    micro-batches to an Accumulator with accum_dtype=float32; and without accum_dtype."""
    out: dict[str, Any] = {}
    data = [window_batches(w, STEPS, 1, SEQS) for w in range(2)]
    for name, accum in (("wide", torch.float32), ("narrow", None)):
        pipe = Pipe(world, "1f1b", dtype=torch.bfloat16, accum_dtype=accum)
        for window in data:
            for tokens, labels in window[0]:
                pipe.feed(tokens, labels)
        out[name] = pipe.params()
    model = full_model(2, torch.bfloat16)
    acc = gradaccum.Accumulator(sgd(model.parameters()), STEPS * N_MB, clip_norm=CLIP,
                                accum_dtype=torch.float32,
                                scheduler=None, sync="local")
    sched = halve(acc.optimizer)
    for window in data:
        for tokens, labels in window[0]:
            for t, y in zip(tokens.tensor_split(N_MB), labels.tensor_split(N_MB), strict=True):
                if acc.backward(token_sum(model(t), y), n_items=count(y), reduction="sum"):
                    sched.step()
    want = stage_params(model, rank, 2)
    return {name: max(float((a.double() - b.double()).abs().max())
                      for a, b in zip(out[name], want, strict=True)) for name in ("wide", "narrow")}


def checkpoint(rank: int, world: int, reduction: str, **options: Any) -> dict[str, Any]:
    """state_dict on every rank in the middle of window 1, a fresh pipeline loads it and goes on:
    bitwise the uninterrupted run."""
    whole = Pipe(world, reduction=reduction, layout_=options.pop("layout_", None), **options)
    lay = (whole.pp_group, whole.dp_mesh, whole.pp_rank, whole.dp_rank)
    calls = [b for window in whole.data() for b in window[whole.dp_rank]]
    for tokens, labels in calls:
        whole.feed(tokens, labels)
    first = Pipe(world, reduction=reduction, layout_=lay, **options)
    cut = STEPS + 1
    for tokens, labels in calls[:cut]:
        first.feed(tokens, labels)
    saved = {"acc": first.acc.state_dict(), "model": first.model.state_dict(), "opt": first.opt.state_dict(),
             "sched": first.sched.state_dict()}
    micro = first.acc.micro_step
    del first
    resumed = Pipe(world, reduction=reduction, layout_=lay, **options)
    resumed.model.load_state_dict(saved["model"])
    resumed.opt.load_state_dict(saved["opt"])
    resumed.sched.load_state_dict(saved["sched"])
    resumed.acc.load_state_dict(saved["acc"])
    for tokens, labels in calls[cut:]:
        resumed.feed(tokens, labels)
    pairs = list(zip(whole.params(), resumed.params(), strict=True))
    return {"micro_step_saved": micro, "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "loss_bitwise": torch.equal(whole.acc.window_loss, resumed.acc.window_loss),
            "steps": resumed.acc.optimizer_steps, "diff": max(float((a - b).abs().max()) for a, b in pairs)}


def eval_mid_window(rank: int, world: int, sync: str) -> dict[str, Any]:
    """FSDP2 stages, a validation step (``schedule.eval``) after window 1's first call: it and the
    next training step() re-run the schedule's metadata inference, whose cleanup sets the FSDP2
    parameters' ``.grad`` to None; the window goes on as if no validation had run."""
    pipe = Pipe(world, dp="fsdp", sync=sync, layout_=one_replica(world))
    data = pipe.data()
    raised = ""
    try:
        for w, window in enumerate(data):
            for i, (tokens, labels) in enumerate(window[0]):
                pipe.feed(tokens, labels)
                if (w, i) == (1, 0):
                    args = (tokens,) if pipe.first else ()
                    pipe.schedule.eval(*args, target=labels if pipe.last else None)
    except ValueError as e:
        raised = str(e)
    ref, _ = reference(2, data, sgd, CLIP, halve)
    return {"raised": raised, "diff": pipe.diff(ref), "steps": pipe.acc.optimizer_steps}


def collectives(rank: int, world: int) -> dict[str, Any]:
    """Every all_reduce of each call (patched ``dist.all_reduce``): the run's first call's
    agreement, then one per window, at its last call; and their bytes."""
    pipe = Pipe(world)
    events: list[tuple[int, int]] = []
    real = dist.all_reduce
    seen = [0, 0]

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        seen[1] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        for window in pipe.data():
            for tokens, labels in window[0]:
                before = list(seen)
                pipe.feed(tokens, labels)
                events.append((seen[0] - before[0], seen[1] - before[1]))
    finally:
        dist.all_reduce = real
    return {"events": events}


# ---------------------------------------------------------------------------------- bad input
def attempt(pipe: Pipe, calls: list[Callable[[], Any]]) -> dict[str, Any]:
    """Run ``calls`` in order until one raises; what was raised, and what changed."""
    before = pipe.params()
    error, made = "", 0
    for call in calls:
        try:
            call()
            made += 1
        except (ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
            break
    return {"raised": error, "made": made, "unchanged": all(torch.equal(a, b) for a, b in
                                                           zip(before, pipe.params(), strict=True)),
            "steps": pipe.acc.optimizer_steps, "micro_step": pipe.acc.micro_step}


def bad_inputs(rank: int, world: int) -> dict[str, Any]:
    """Each mistake of the issue, on one rank or all: every rank raises, nothing is stepped."""
    out: dict[str, Any] = {}
    batches = window_batches(0, STEPS, 1, SEQS)[0]

    def calls(pipe: Pipe, n: int = STEPS, bad: int = -1, **over: Any) -> list[Callable[[], Any]]:
        return [lambda i=i: pipe.feed(*batches[i % len(batches)], **(over if i == bad else {}))
                for i in range(n)]

    pipe = Pipe(world, loss_fn=None)
    out["no_loss_fn"] = attempt(pipe, calls(pipe))
    pipe = Pipe(world, scale_grads=True)
    out["scale_grads"] = attempt(pipe, calls(pipe))
    pipe = Pipe(world, steps=2 + rank)
    out["steps_differ"] = attempt(pipe, calls(pipe))
    pipe = Pipe(world)
    out["no_target_first"] = attempt(pipe, calls(pipe, bad=0, target=None))
    pipe = Pipe(world)
    out["no_target_later"] = attempt(pipe, calls(pipe, bad=1, target=None))
    pipe = Pipe(world)
    out["no_items_sum_first"] = attempt(pipe, calls(pipe, bad=0, n_items=None))
    pipe = Pipe(world)
    out["no_items_sum_later"] = attempt(pipe, calls(pipe, bad=2, n_items=None))
    pipe = Pipe(world, reduction="mean")
    out["number_with_mean"] = attempt(pipe, calls(pipe, bad=0, n_items=7 if pipe.last else None))
    pipe = Pipe(world)
    out["items_on_first_stage"] = attempt(pipe, calls(pipe, bad=0, n_items=count))
    pipe = Pipe(world)
    out["items_on_first_stage_later"] = attempt(pipe, calls(pipe, bad=1, n_items=count))
    # the window disagrees: rank 1 restores a state saved after one call, rank 0 starts fresh
    pipe = Pipe(world)
    pipe.feed(*batches[0])
    state = pipe.acc.state_dict()
    pipe = Pipe(world)
    if rank == 1:
        pipe.acc.load_state_dict(state)
    out["window_differs"] = attempt(pipe, calls(pipe))
    # a plain module misused for data parallelism: pipelining is imported, so make_sync's refusal
    # waits for the module's first micro-batch, and a plain backward() raises it there
    plain = nn.Linear(3, 2).double()
    acc = gradaccum.Accumulator(sgd(plain.parameters()), 2, model=plain)
    try:
        acc.backward(plain(torch.ones(4, 3, dtype=torch.float64)).sum())
        out["plain_module"] = ""
    except ValueError as e:
        out["plain_module"] = str(e)
    out["plain_module_grads"] = [p.grad is None for p in plain.parameters()]
    # after each refusal the same pipeline trains on (the refused call changed nothing)
    pipe = Pipe(world)
    refused = attempt(pipe, calls(pipe, 1, bad=0, target=None))
    ok = attempt(pipe, calls(pipe))
    out["trains_after_refusal"] = {"refused": refused["raised"], **ok}
    return out


def guard_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """A guard that fires on one rank only (a gradient edited, a scheduler stepped outside the
    accumulator): every rank raises at the window's boundary, none waits in a collective, and the
    next window trains."""
    out: dict[str, Any] = {}
    batches = window_batches(0, STEPS, 1, SEQS)[0]

    def run(pipe: Pipe, between: Callable[[], Any], end: str = "feed") -> dict[str, Any]:
        calls: list[Callable[[], Any]] = [lambda: pipe.feed(*batches[0]), between,
                                          lambda: pipe.feed(*batches[1])]
        calls.append(pipe.acc.flush if end == "flush" else lambda: pipe.feed(*batches[2]))
        got = attempt(pipe, calls)
        got["next"] = attempt(pipe, [lambda i=i: pipe.feed(*batches[i]) for i in range(STEPS)])
        return got

    def edit(pipe: Pipe) -> Callable[[], None]:
        def on_rank_1() -> None:  # not the probe (the first parameter): the whole-window check
            if rank == 1:
                list(pipe.model.parameters())[-1].grad.mul_(2)
        return on_rank_1

    pipe = Pipe(world)
    out["edited"] = run(pipe, edit(pipe))
    pipe = Pipe(world)
    out["edited_flush"] = run(pipe, edit(pipe), end="flush")
    pipe = Pipe(world)
    out["scheduler"] = run(pipe, lambda: pipe.sched.step() if rank == 0 else None)
    return out


def uneven_calls(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 calls twice then flush(), rank 1 three times (a window of 3): with each call agreed
    first (TORCH_DISTRIBUTED_DEBUG's per-call agreement), every rank raises."""
    pipe = Pipe(world)
    batches = window_batches(0, STEPS, 1, SEQS)[0]
    pipe.feed(*batches[0])  # the run's first call
    pipe.acc._sync.every_call = True  # type: ignore[attr-defined]
    n = 1 if rank == 0 else 2
    calls = [lambda i=i: pipe.feed(*batches[i]) for i in range(1, 1 + n)]
    if rank == 0:
        calls.append(pipe.acc.flush)
    return attempt(pipe, calls)


def skipped_call(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 skips its second batch, then every rank calls flush(): from there rank 1's labels
    pair with rank 0's inputs of the batch before (the schedule's point-to-point messages pair
    each stage's k-th step(), so every rank's window counts the same calls and window 1 steps);
    rank 0's last call meets rank 1's flush(), which the per-call agreement catches on both."""
    pipe = Pipe(world)
    batches = [b for w in range(2) for b in window_batches(w, STEPS, 1, SEQS)[0]]
    mine = [b for i, b in enumerate(batches) if not (rank == 1 and i == 1)]
    pipe.feed(*mine[0])  # the run's first call attaches the pipeline's sync
    pipe.acc._sync.every_call = True  # type: ignore[attr-defined]  # what TORCH_DISTRIBUTED_DEBUG sets
    got = attempt(pipe, [*(lambda b=b: pipe.feed(*b) for b in mine[1:]), pipe.acc.flush])
    return {**got, "made": got["made"] + 1}


def torchtitan_bugs(rank: int, world: int) -> dict[str, Any]:
    """torchtitan's #1733 and #2972 and the correct loops, with clipping that acts and without:
    each one's largest difference from one process (2 windows of 2 batches x 4 micro-batches)."""
    out: dict[str, Any] = {}
    windows = [window_batches(w, 2, 1, SEQS) for w in range(2)]
    for clip in (CLIP, None):
        ref, _ = reference(2, windows, sgd, clip)
        want = stage_params(ref, rank, 2)
        for loop in LOOPS:
            run = PipelineLoop(loop, full_model(2), N_MB, 2, clip)
            for window in windows:
                run.window(window[0])
            diff = torch.tensor(max_diff([run.mod], want), dtype=torch.float64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            out[f"{loop} {'clip' if clip else 'no clip'}"] = float(diff)
    return out


def recipes(rank: int, world: int) -> dict[str, Any]:
    """docs/PIPELINE.md's torchtitan-style loop and its gradaccum port, run as printed on two
    ranks: each one's largest difference from one process on the full batch (AdamW, a warm-up,
    clipping that acts)."""
    from pathlib import Path

    from tests.integrations.common import run as run_recipe

    doc = Path(__file__).resolve().parents[2] / "docs" / "PIPELINE.md"
    windows = [window_batches(w, 2, 1, SEQS) for w in range(3)]

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    def warmup(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))

    ref, _ = reference(2, windows, adamw, CLIP, warmup)
    out = {}
    for name in ("pp-hand", "pp-gradaccum"):
        full = full_model(2)
        stage_module = full[2 * rank: 2 * rank + 2]
        namespace = {"stage_module": stage_module, "pp_rank": rank, "pp_size": world, "pp_group": None,
                     "device": torch.device("cpu"), "is_first": rank == 0, "is_last": rank == world - 1,
                     "n_microbatches": N_MB, "accum_steps": 2, "num_steps": 3, "lr": 1e-2, "warmup_steps": 2,
                     "max_norm": CLIP, "loss_fn": titan_loss, "clip_grad_norm_": titan_clip,
                     "data_iterator": iter([b for window in windows for b in window[0]])}
        run_recipe(name, namespace, doc=doc)
        out[name] = max_diff([stage_module], stage_params(ref, rank, 2))
    return out


def titan_loss(pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: Any = 1) -> torch.Tensor:
    """torchtitan's token loss: summed, divided by the global valid-token count it is given."""
    return token_sum(pred, labels) / global_valid_tokens


def titan_clip(parameters: Any, max_norm: float, pp_group: Any) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` under PP: the norm all-reduced over the pipeline's stages."""
    parameters = list(parameters)
    total = nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None]) ** 2
    dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


if __name__ == "__main__":
    run_scenarios({
        "gpipe sum clip": lambda r, w: train(r, w, "gpipe"),
        "gpipe mean": lambda r, w: train(r, w, "gpipe", reduction="mean", clip=None),
        "1f1b sum": lambda r, w: train(r, w, "1f1b", clip=None),
        "1f1b mean clip": lambda r, w: train(r, w, "1f1b", reduction="mean"),
        "1f1b plain mean": lambda r, w: train(r, w, "1f1b", reduction="mean", items=False),
        "interleaved sum clip": lambda r, w: train(r, w, "interleaved", virtual=2),
        "interleaved mean": lambda r, w: train(r, w, "interleaved", virtual=2, reduction="mean", clip=None),
        "loopedbfs sum clip": lambda r, w: train(r, w, "loopedbfs", virtual=2),
        "zero bubble mean clip": lambda r, w: train(r, w, "zb", virtual=2, reduction="mean"),
        "scaler inf on stage 0": lambda r, w: inf_in_window(r, w, 0, scaler=torch.amp.GradScaler("cpu")),
        "skip_nonfinite inf on stage 1": lambda r, w: inf_in_window(r, w, 1, skip_nonfinite=True),
        "accum_dtype": accum_dtype,
        "flush": flush_partial,
        "discard": discard_call,
        "checkpoint sum": lambda r, w: checkpoint(r, w, "sum"),
        "checkpoint mean": lambda r, w: checkpoint(r, w, "mean"),
        # FSDP2 stages, sync="micro_batch": the resumed schedule's first step() clears the FSDP2
        # parameters' .grad after its metadata inference (PipelineStage._post_metadata_inference_cleanup)
        "checkpoint fsdp micro_batch": lambda r, w: checkpoint(r, w, "sum", dp="fsdp", sync="micro_batch",
                                                               layout_=one_replica(w)),
        "eval fsdp micro_batch": lambda r, w: eval_mid_window(r, w, "micro_batch"),
        "eval fsdp window": lambda r, w: eval_mid_window(r, w, "window"),
        # several FSDP2 stages per rank, model=nn.ModuleList of them (docs/PIPELINE.md)
        "interleaved fsdp list sum clip": lambda r, w: train(r, w, "interleaved", virtual=2, dp="fsdp",
                                                             layout_=one_replica(w)),
        "interleaved fsdp list micro_batch mean": lambda r, w: train(
            r, w, "interleaved", virtual=2, dp="fsdp", reduction="mean", clip=None, sync="micro_batch",
            layout_=one_replica(w)),
        "collectives": collectives,
        "bad inputs": bad_inputs,
        "uneven calls": uneven_calls,
        "skipped call": skipped_call,
        "guard on one rank": guard_on_one_rank,
        "torchtitan bugs": torchtitan_bugs,
        "recipes": recipes,
    })
