"""Run a function on W gloo ranks: spawned CPU processes on 127.0.0.1, one result per rank.

Used by the equivalence checker (``world_size=W``) and by :mod:`gradaccum.testing`. The function
and its payload travel by pickle: the function must be importable (defined at a module's top
level; a script's own functions work when it guards its entry point with
``if __name__ == "__main__":``), and so must whatever the payload holds (a model's class, a loss
function). The processes are started with ``multiprocessing``'s spawn method, which gives them
this process's ``sys.path``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = ["RankError", "free_port", "run_on_ranks"]

RankFn = Callable[[int, int, Any], Any]
GRACE_S = 20.0  # once a rank failed, how long the others get before they are killed


class RankError(RuntimeError):
    """A rank raised, or did not finish in time; the message holds its error and traceback.

    Attributes:
        rank: the rank that failed first.
        error: the exception's type name and message on that rank (``"timeout"`` when it hung).
    """

    def __init__(self, rank: int, error: str, details: str) -> None:
        super().__init__(f"rank {rank}: {error}\n{details}".rstrip())
        self.rank, self.error = rank, error


def check_picklable(what: str, value: Any) -> None:
    """Raise a TypeError naming ``what`` when ``value`` cannot travel to a spawned process.

    Raises:
        TypeError: a lambda, a local function, or an object holding one.
    """
    try:
        pickle.dumps(value)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(f"{what} must be picklable to run on spawned ranks (define functions and "
                        f"classes at a module's top level, not as lambdas or inside a function): "
                        f"{err}") from None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a process group's rendezvous (the
    OS picks it; never a fixed one, so that runs side by side do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(fn: RankFn, rank: int, world: int, port: int, folder: str, timeout: float) -> None:
    """A spawned rank: join the group, run ``fn``, save what it returned (or its error), leave."""
    import torch.distributed as dist

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no network needed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out = Path(folder)
    try:
        payload = torch.load(out / "payload.pt", weights_only=False)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        result: Any = {"ok": fn(rank, world, payload)}
        healthy = True
    except BaseException as err:  # every failure goes back to the caller
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        healthy = False
    torch.save(result, out / f"rank{rank}.pt")
    code = 0
    if healthy and dist.is_initialized():
        try:
            dist.barrier()  # no rank leaves while another still talks to it
            dist.destroy_process_group()
        except Exception:
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's finalization: a gloo worker thread dropping a tensor there can end
    # the process with std::terminate after everything succeeded (see tests/ranks.py).
    os._exit(code)


def run_on_ranks(fn: RankFn, payload: Any, world_size: int, *, timeout: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world_size, payload)`` on ``world_size`` spawned gloo processes.

    Each process joins a gloo group on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo`` on Linux unless it is
    set) before ``fn`` runs, and leaves it after.

    Args:
        fn: an importable function; what it returns must be picklable (tensors included).
        payload: what every rank gets (saved once with ``torch.save``, loaded by each rank).
        world_size: the number of processes, >= 1.
        timeout: seconds for the whole run, and for any one collective.

    Returns:
        What ``fn`` returned on each rank, in rank order.

    Raises:
        TypeError: ``fn`` or ``payload`` cannot be pickled.
        RankError: a rank raised (the first one's error) or the run outlived ``timeout``.

    Example:
        ``run_on_ranks(operator.add, 10, 2)`` returns ``[10, 11]``: rank 0 adds 10 to 0, rank 1 to 1.
    """
    check_picklable("the rank function", fn)
    with tempfile.TemporaryDirectory(prefix="gradaccum-ranks-") as folder:
        try:
            torch.save(payload, Path(folder) / "payload.pt")
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(f"the ranks' inputs must be picklable (define functions and classes at "
                            f"a module's top level, not as lambdas or inside a function): {err}") from None
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, folder, timeout),
                             daemon=True) for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            _wait(procs, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        return _collect(Path(folder), procs, timeout)


def _wait(procs: list[Any], timeout: float) -> None:
    deadline, failed = time.monotonic() + timeout, False
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if not failed and any(p.exitcode not in (None, 0) for p in procs):
            failed, deadline = True, min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.05)


def _collect(folder: Path, procs: list[Any], timeout: float) -> list[Any]:
    results = []
    for rank in range(len(procs)):
        path = folder / f"rank{rank}.pt"
        saved: Any = None
        with contextlib.suppress(Exception):
            saved = torch.load(path, weights_only=False)
        if saved is None or "error" in saved:
            continue
        results.append(saved["ok"])
    if len(results) == len(procs):
        return results
    for rank in range(len(procs)):  # the first rank that reports an error explains the run
        saved = None
        with contextlib.suppress(Exception):
            saved = torch.load(folder / f"rank{rank}.pt", weights_only=False)
        if saved is not None and "error" in saved:
            raise RankError(rank, saved["error"], saved["traceback"])
    missing = next(r for r, p in enumerate(procs) if not (folder / f"rank{r}.pt").exists())
    raise RankError(missing, "timeout", f"the ranks did not finish within {timeout:g}s (or rank "
                    f"{missing} died: exit code {procs[missing].exitcode})")
