"""Check 2, no host sync: a whole window, boundary included, never waits for the GPU.

Each variant trains a token classifier (two linear layers on float features; bf16 autocast,
cross-entropy that ignores padding, SGD with momentum: nothing in it syncs by itself, which the
control below confirms; an embedding's CUDA backward might) one warm-up window, then one window
under the guard: ``torch.cuda.set_sync_debug_mode("error")`` makes any synchronizing CUDA
call raise. Variants: mean weighting; ``n_items`` given as a CUDA tensor (the count of real
tokens, never read on the host); the same with ``clip_norm``; ``clip_norm`` alone. In none is
``window_loss`` read. Two controls make the result mean something: nanoGPT's hand-written loop
under the same guard (the model, loss and optimizer must not sync on their own) and a deliberate
``.item()`` under the guard, which must be caught (the guard must be armed).

The smoke has no CUDA: its guard records the operations that read a tensor's value on the host
(``.item()``, ``bool()``, ``nonzero``...: what would synchronize on a GPU) through a dispatch mode.
Its ``n_items`` are CPU tensors, whose value the Accumulator checks (>= 1) on purpose; on a GPU
they are device tensors it does not read. Those reads are listed apart and are not syncs.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum import Accumulator
from gradaccum.bench.gpu.check import Context, Outcome
from gradaccum.bench.gpu.gpt import GPT_SMALL, GPT_TINY, IGNORE, gpt_loss, token_batches

__all__ = ["HostReads", "run", "sync_guard"]

STEPS = 4
VARIANTS: dict[str, dict[str, Any]] = {
    "mean": {},
    "n_items tensor": {"n_items": True},
    "n_items tensor + clip_norm": {"n_items": True, "clip_norm": 1.0},
    "clip_norm": {"clip_norm": 1.0},
}
# Operations whose result depends on a tensor's value read back by the host.
_HOST_READS = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "equal",
               "_unique", "_unique2", "unique_dim", "unique_consecutive", "item")


class HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records each operation that reads a tensor's value on the host, with where it was called.

    Args:
        host_inputs: tensors that live on the host on purpose (the smoke's ``n_items``; on a GPU
            they are device tensors): reading them is no sync, so those go to :attr:`input_reads`.
    """

    def __init__(self, host_inputs: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.reads: list[str] = []
        self.input_reads: list[str] = []
        self._inputs = {t.untyped_storage().data_ptr() for t in host_inputs}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.__name__.split(".")[0] in _HOST_READS:
            first = args[0] if args else None
            mine = isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() in self._inputs
            (self.input_reads if mine else self.reads).append(f"{func.__name__} at {_site(None)}")
        return func(*args, **(kwargs or {}))


_TORCH_DIR = os.path.dirname(torch.__file__)


def _site(error: BaseException | None) -> str:
    """Where a sync happened: the innermost gradaccum frame outside this module (else the
    innermost frame outside torch) of ``error``'s traceback, or of the current stack."""
    frames = traceback.extract_stack() if error is None else traceback.extract_tb(error.__traceback__)
    outside = [f for f in frames
               if not f.filename.startswith(_TORCH_DIR) and not f.filename.endswith("host_sync.py")]
    own = [f for f in outside if "/gradaccum/" in f.filename]
    f = (own or outside or frames)[-1]
    return f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}"


@contextmanager
def sync_guard(device: torch.device, host_inputs: Sequence[torch.Tensor] = ()
               ) -> Iterator[tuple[list[str], list[str]]]:
    """Yield ``(syncs, input_reads)``: lists that get one entry per host sync inside the block.

    On CUDA the block stops at the first sync (``set_sync_debug_mode("error")`` raises; the
    error is recorded, not propagated). On the CPU every host read is recorded and the block runs
    on; reads of ``host_inputs`` go to ``input_reads`` (see :class:`HostReads`).
    """
    syncs: list[str] = []
    input_reads: list[str] = []
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield syncs, input_reads
        except RuntimeError as error:
            syncs.append(f"{str(error).splitlines()[0][:120]} at {_site(error)}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        mode = HostReads(host_inputs)
        with mode:
            yield syncs, input_reads
        syncs.extend(mode.reads)
        input_reads.extend(mode.input_reads)


Window = tuple[Callable[[], None], list[torch.Tensor]]


def _window_fn(ctx: Context, variant: dict[str, Any] | None) -> Window:
    """One window's training function (the Accumulator with ``variant``, or, for None, nanoGPT's
    loop) and the ``n_items`` tensors it passes."""
    config = GPT_TINY if ctx.smoke else GPT_SMALL
    torch.manual_seed(0)
    width = config.n_embd
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, config.vocab_size))
    model.to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(*ids.shape, width, generator=g).to(ctx.device), y)
               for ids, y in token_batches(config, 2 if ctx.smoke else 8, STEPS, ctx.device, padded=True)]
    counts = [(y != IGNORE).sum() for _, y in batches]  # on the device, made before the guard

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            return gpt_loss(model(x), y)

    if variant is None:
        def hand_written() -> None:
            for x, y in batches:
                torch.autograd.backward(loss_of(x, y) / STEPS)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hand_written, []
    acc = Accumulator(opt, STEPS, clip_norm=variant.get("clip_norm"))
    items = variant.get("n_items", False)

    def window() -> None:
        for (x, y), n in zip(batches, counts, strict=True):
            acc.backward(loss_of(x, y), n_items=n if items else None)

    return window, counts if items else []


def _guarded(ctx: Context, window: Window) -> tuple[list[str], list[str]]:
    fn, counts = window
    fn()  # warm-up window: momentum buffers, cuBLAS handles, autotuning
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    with sync_guard(ctx.device, counts) as (syncs, input_reads):
        fn()
    return syncs, input_reads


def run(ctx: Context) -> Outcome:
    """The canary, the control loop and every variant, each under the guard."""
    canary = torch.ones((), device=ctx.device)
    with sync_guard(ctx.device) as (caught, _):
        canary.add(1).item()  # must be caught: proves the guard is armed
    if not caught:
        raise RuntimeError("the sync guard missed a deliberate .item(): it is not armed")
    control, _ = _guarded(ctx, _window_fn(ctx, None))
    results = {name: _guarded(ctx, _window_fn(ctx, v)) for name, v in VARIANTS.items()}
    found = {name: syncs for name, (syncs, _) in results.items()}
    input_reads = {name: reads for name, (_, reads) in results.items() if reads}
    ctx.record(guard="set_sync_debug_mode('error')" if ctx.device.type == "cuda"
               else "host-read dispatch mode (smoke)", canary_caught=caught, control_syncs=control,
               syncs=found, n_items_value_checks_on_cpu=input_reads)
    clean = [n for n, f in found.items() if not f]
    measured = (f"{len(clean)}/{len(found)} variants sync-free"
                + "".join(f"; {n}: {f[0]}" for n, f in found.items() if f)
                + f"; control loop: {'clean' if not control else control[0]}; .item() caught")
    if input_reads:
        measured += f"; CPU n_items checked {sum(map(len, input_reads.values()))}x (no sync)"
    return Outcome(measured, "no sync in any variant (mean, n_items tensor, +clip_norm, clip_norm)",
                   len(clean) == len(found))
