"""One GPU check in a process of its own, so that it can be time-boxed and starts from a clean
device (no cached blocks, memory cap, compile cache or debug mode left by another check).

The runner forks it from a ``forkserver`` that has imported torch (and dynamo, which the first
optimizer imports) once: CUDA allows ``forkserver``, not ``fork`` from a process that has used it,
and the server never touches the GPU. :func:`probe_device` checks that a child can use the device;
should it fail, the runner starts each check with ``spawn`` instead (a fresh interpreter). The
child leads a session of its own, so that a time-out kills it with any process it started.

Writes ``{"status": "done", "measured", "target", "met", "seconds", "raw"}`` to its result file;
on an exception, ``{"status": "crashed", "error", ...}``, the traceback to its log, exit status 1.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gradaccum.bench.gpu.check import Context

__all__ = ["PRELOAD", "child_main", "probe_device", "run_child"]

# What the fork server imports once for every check (torch._dynamo: the first optimizer imports it).
PRELOAD = ["gradaccum.bench.gpu.child", "torch._dynamo"]


def run_child(module: str, result: Path | None, device: str, deadline: float) -> int:
    """Run the check ``module`` (its ``run(ctx)``) and write its outcome to ``result``.

    Returns:
        0 when the check returned an outcome (whatever its verdict).

    Raises:
        Whatever the check raised, after writing ``{"status": "crashed"}``.
    """
    start = time.time()
    # An explicit index: some CUDA calls (set_per_process_memory_fraction) reject a bare "cuda".
    ctx = Context(torch.device("cuda", 0) if device == "cuda" else torch.device(device), deadline, result)
    if ctx.smoke:
        torch.set_num_threads(1)  # tiny models: one thread is faster, and CI has two cores
    ctx.write({"status": "running"})
    try:
        outcome = importlib.import_module(module).run(ctx)
    except BaseException as error:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        ctx.write({"status": "crashed", "error": f"{type(error).__name__}: {first}",
                   "seconds": round(time.time() - start, 1)})
        raise
    ctx.write({"status": "done", "measured": outcome.measured, "target": outcome.target,
               "met": outcome.met, "seconds": round(time.time() - start, 1)})
    return 0


def child_main(module: str, result: str, device: str, deadline: float, env: dict[str, str],
               log: str, path: Sequence[str]) -> None:
    """The child process's entry: own session, environment, log, the parent's ``sys.path``, run.

    Args:
        env: variables the check needs before CUDA starts (e.g. ``CUBLAS_WORKSPACE_CONFIG``).
        log: the file that gets its stdout and stderr.
        path: the parent's ``sys.path`` (the server's may be older).
    """
    os.setsid()
    os.environ.update(env)
    sys.path[:] = list(path)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    run_child(module, Path(result), device, deadline)


def probe_device(device: str) -> None:
    """Allocate and compute on ``device`` (in a forked child: proves CUDA starts there)."""
    x = torch.ones(8, device=device).add_(1)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
