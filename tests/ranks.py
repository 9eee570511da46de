"""Run a script on several local gloo ranks, as torchrun would, and collect what each rank saved.

Each rank is a fresh ``python script.py OUT`` process with the torchrun environment (RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT a free port, GLOO_SOCKET_IFNAME=lo). The script
saves its results with ``torch.save`` to ``OUT/rank{r}.pt``. Spawning costs seconds (every rank
imports torch), so a script runs many scenarios per launch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import gradaccum


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n:]


def run_ranks(script: Path, out: Path, world: int = 2, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run ``script`` on ``world`` ranks; return each rank's saved dict (rank order).

    Raises:
        AssertionError: a rank failed or the whole run outlived ``timeout`` (all ranks are then
            killed; the message holds each rank's stderr).
    """
    src = str(Path(gradaccum.__file__).parents[1])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    procs = []
    for rank in range(world):
        log = (out / f"rank{rank}.log").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(out)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=log))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = "\n".join(f"--- rank {r}\n{_tail(out / f'rank{r}.log')}" for r in range(world))
        raise AssertionError(f"{script.name} ran past {timeout}s; killed\n{logs}") from None
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} (exit {procs[r].returncode})\n{_tail(out / f'rank{r}.log')}"
                         for r in failed)
        raise AssertionError(f"{script.name} failed on rank(s) {failed}\n{logs}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The results of one scenario on every rank; fail with the rank's traceback if it raised."""
    results = []
    for rank, saved in enumerate(ranks):
        got = saved[name]
        if "error" in got:
            raise AssertionError(f"scenario {name!r} raised on rank {rank}:\n{got['error']}")
        results.append(got)
    return results


def run_scenarios(scenarios: dict[str, Any], timeout_s: float = 60.0, destroy: bool = True) -> None:
    """Rank side: join the gloo group from the torchrun environment, run every scenario, save.

    A scenario is ``fn(rank, world) -> dict``; an exception is saved as ``{"error": traceback}``
    so that the others still run and the test shows which one failed. ``timeout_s`` bounds any
    collective, so a broken scenario fails the run instead of hanging it. ``destroy=False`` skips
    ``destroy_process_group`` for a last scenario that leaves the group broken on purpose.
    """
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    for name, fn in scenarios.items():
        start = time.monotonic()
        try:
            results[name] = fn(rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        print(f"{name}: {time.monotonic() - start:.2f}s", flush=True)  # in OUT/rank{r}.log
    torch.save(results, out / f"rank{rank}.pt")
    if destroy:
        dist.destroy_process_group()
