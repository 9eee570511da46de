"""Run a script on several local MindSpore ranks under ``msrun`` (CPU), and collect their results.

``msrun`` starts a scheduler and the workers, each ``python SCRIPT ARGS`` with the python found on
PATH, so this puts the running interpreter's folder first on PATH and this tree's ``src`` first on
PYTHONPATH. The master port is a free one; the whole launch runs in its own session and is
killed, scheduler and workers included, if it outlives ``timeout``. Worker logs stay in
``OUT/logs`` and their tails are shown when a launch fails.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import gradaccum
from ranks import free_port

PYTHON_DIR = str(Path(sys.executable).parent)


def msrun_command(args: list[str], out: Path, world: int = 2) -> tuple[list[str], dict[str, str]]:
    """The msrun command line and environment for ``python ARGS`` on ``world`` local ranks."""
    src = str(Path(gradaccum.__file__).parents[1])
    env = {**os.environ, "PATH": os.pathsep.join([PYTHON_DIR, os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "GLOG_v": "3", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "import sys; from mindspore.parallel.cluster.run import main; "
               "sys.argv[0] = 'msrun'; sys.exit(main())",
               "--worker_num", str(world), "--local_worker_num", str(world),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "--log_dir", str(out / "logs"), "--join", "True", "--cluster_time_out", "120",
               "--tail_worker_log", "-1", *args]
    return command, env


def run_msrun(args: list[str], out: Path, world: int = 2, timeout: float = 600.0) -> str:
    """Run ``python ARGS`` on ``world`` ranks under msrun; return msrun's own output.

    Raises:
        AssertionError: msrun failed or ran past ``timeout`` (every process it started is then
            killed); the message holds the tail of each worker's log.
    """
    command, env = msrun_command(args, out, world)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        text, _ = proc.communicate()
        raise AssertionError(f"msrun ran past {timeout}s; killed\n{_logs(out, world)}") from None
    if proc.returncode != 0:
        raise AssertionError(f"msrun exited with {proc.returncode}\n{text[-3000:]}\n{_logs(out, world)}")
    return text


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (msrun starts its workers in sessions of their
    own, so a process-group kill would miss them)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    for member in tree:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(member, signal.SIGKILL)


def _logs(out: Path, world: int) -> str:
    parts = []
    for rank in range(world):
        log = out / "logs" / f"worker_{rank}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        parts.append(f"--- worker {rank}\n{text[-4000:]}")
    return "\n".join(parts)


def load_ranks(out: Path, world: int = 2) -> list[dict[str, Any]]:
    """Each rank's saved results (``OUT/rank{r}.pkl``), in rank order."""
    results = []
    for rank in range(world):
        with (out / f"rank{rank}.pkl").open("rb") as f:
            results.append(pickle.load(f))
    return results
