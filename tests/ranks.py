"""Start the distributed test workers: every multi-process test launches its processes here.

Test side:
- ``run_ranks("tests.distributed.ddp_ranks", out)`` runs each rank as a fresh ``python -m MODULE
  OUT`` from the repository root, with the torchrun environment (RANK, WORLD_SIZE,
  MASTER_ADDR=127.0.0.1, MASTER_PORT a free port, GLOO_SOCKET_IFNAME=lo). A rank saves its
  results with ``torch.save`` to ``OUT/rank{r}.pt`` and writes its output to ``OUT/rank{r}.log``.
  Spawning costs seconds (every rank imports torch), so a module runs many scenarios per launch.
- ``torchrun(["-m", "gradaccum", "train", ...], out)`` runs the real launcher
  (``torch.distributed.run``), for the command-line tests.

Each process starts in a session of its own, and the launcher kills what is left of each
session's process group when it returns: after a timeout, a failed rank (the others get
``GRACE_S`` more), an error, an interrupt, or success. So no rank or child outlives its test;
a failure's message holds each rank's exit status and the end of its log.

Rank side: ``run_scenarios``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

import gradaccum
from gradaccum.torch.check.spawn import free_port  # the tests import it from here too

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 30.0  # once a rank has failed, how long the others get to finish before they are killed




def environment() -> dict[str, str]:
    """The environment of a launched process: this checkout's library and tests on PYTHONPATH
    (whatever the current directory and the installed copy), gloo on loopback, one thread."""
    paths = [str(Path(gradaccum.__file__).parents[1]), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n:]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> bool:
    """Wait for every process; True when ``timeout`` ran out first (then some are still running).

    Once one exits with an error, the others get ``GRACE_S`` more, as its peers may wait for it
    in a collective until their own timeout.
    """
    deadline, failed = time.monotonic() + timeout, False
    while True:
        codes = [p.poll() for p in procs]  # every one, so that each exit status is read
        if None not in codes:
            return False
        now = time.monotonic()
        if not failed and any(codes):
            failed, deadline = True, min(deadline, now + GRACE_S)
        if now >= deadline:
            return not failed
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill what is left of each process's group (a rank, or what a rank that ended left running)."""
    for p in procs:
        # Each process leads the group named by its pid; while it is unreaped or any member
        # lives, no other process can hold that id.
        with contextlib.suppress(ProcessLookupError):  # the whole group has ended
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _launch(commands: list[list[str]], envs: list[dict[str, str]], logs: list[Path], timeout: float,
            errors: list[Path] | None = None) -> tuple[bool, list[int]]:
    """Run the commands side by side, each in a new session; (timed out, exit codes).

    Process i writes its output to ``logs[i]``, its standard error there too or to ``errors[i]``.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, (command, env, log) in enumerate(zip(commands, envs, logs, strict=True)):
            with contextlib.ExitStack() as files:
                stdout = files.enter_context(log.open("wb"))
                stderr = subprocess.STDOUT if errors is None else files.enter_context(errors[i].open("wb"))
                procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=stdout, stderr=stderr,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        timed_out = _wait(procs, timeout)
    finally:
        _kill(procs)  # stragglers after a timeout, a failure, an interrupted test, or success
    return timed_out, [p.returncode for p in procs]


def _report(what: str, timed_out: bool, codes: list[int], logs: list[Path], timeout: float) -> str:
    head = f"{what} ran past {timeout:.0f}s; killed" if timed_out else f"{what} failed"
    return "\n".join([head, *(f"--- {log.name} (exit {code})\n{_tail(log)}"
                              for code, log in zip(codes, logs, strict=True))])


def run_ranks(module: str, out: Path, world: int = 2, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run ``python -m module OUT`` on ``world`` ranks; return each rank's saved dict (rank order).

    Raises:
        AssertionError: a rank failed or the run outlived ``timeout`` (every rank still running is
            then killed); the message holds every rank's exit status and log.
    """
    env = {**environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]
    logs = [out / f"rank{r}.log" for r in range(world)]
    timed_out, codes = _launch([[sys.executable, "-m", module, str(out)]] * world, envs, logs, timeout)
    if timed_out or any(codes):
        raise AssertionError(_report(module, timed_out, codes, logs, timeout))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def torchrun(args: list[str], out: Path, world: int = 2, timeout: float = 240.0) -> str:
    """Run ``torchrun --nproc-per-node world ARGS`` on a free port; return its standard output.

    The output of torchrun and its ranks goes to ``out/torchrun.log``, their errors to
    ``out/torchrun.err``.

    Raises:
        AssertionError: torchrun failed or outlived ``timeout`` (it and its ranks are then killed);
            the message holds the end of both files.
    """
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    log, err = out / "torchrun.log", out / "torchrun.err"
    timed_out, codes = _launch([command], [environment()], [log], timeout, errors=[err])
    if timed_out or any(codes):
        raise AssertionError(_report("torchrun " + " ".join(args), timed_out, codes * 2, [log, err], timeout))
    return log.read_text(errors="replace")


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The results of one scenario on every rank; fail with the rank's traceback if it raised."""
    results = []
    for rank, saved in enumerate(ranks):
        got = saved[name]
        if "error" in got:
            raise AssertionError(f"scenario {name!r} raised on rank {rank}:\n{got['error']}")
        results.append(got)
    return results


Scenario = Callable[[int, int], dict[str, Any]]


def run_scenarios(scenarios: dict[str, Scenario], timeout_s: float = 60.0,
                  broken: bool = False) -> NoReturn:
    """Rank side: join the gloo group from the torchrun environment, run every scenario, save, exit.

    A scenario is ``fn(rank, world) -> dict``; an exception is saved as ``{"error": traceback}``
    so that the others still run and the test shows which one failed. ``timeout_s`` bounds any
    collective, so a broken scenario fails the run instead of hanging it. ``broken=True`` says
    the last scenario leaves the default group broken on purpose: no barrier, no teardown.

    This never returns: after saving, the rank tears a healthy group down and ends the process
    with ``os._exit(0)``, which skips the interpreter's finalization. There, a gloo worker thread
    that drops the last reference to a collective's tensor must take the GIL, which CPython
    answers by ending the thread with ``pthread_exit``; unwinding through the tensor's
    ``noexcept`` destructor calls ``std::terminate`` ("terminate called without an active
    exception", exit -6) after every scenario has passed.
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
    _exit_rank(healthy=not broken)


def _exit_rank(healthy: bool = True) -> NoReturn:
    """End a rank process: tear a healthy group down (after every rank got here), then ``os._exit``.

    See ``run_scenarios`` for why the interpreter's finalization is skipped. A teardown that
    fails (a scenario broke the group by mistake) is printed to the log and exits with 1.
    """
    import traceback

    import torch.distributed as dist

    code = 0
    if healthy and dist.is_initialized():
        try:
            dist.barrier()  # no rank leaves while another still talks to it
            dist.destroy_process_group()
        except Exception:
            traceback.print_exc()
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------- MindSpore
# msrun starts a scheduler and the workers, each ``python SCRIPT ARGS`` with the python found on
# PATH: the running interpreter's folder goes first on PATH and this tree's src first on
# PYTHONPATH. The whole launch runs in its own session and is killed, scheduler and workers
# included, if it outlives its timeout (msrun puts its workers in sessions of their own, so the
# process tree is walked). Worker logs stay in OUT/logs; their tails are shown on failure.

PYTHON_DIR = str(Path(sys.executable).parent)


def msrun_command(args: list[str], out: Path, world: int = 2) -> tuple[list[str], dict[str, str]]:
    """The msrun command line and environment for ``python ARGS`` on ``world`` local ranks."""
    env = {**environment(), "PATH": os.pathsep.join([PYTHON_DIR, os.environ.get("PATH", "")]), "GLOG_v": "3"}
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
        pytest.skip.Exception: this MindSpore has no msrun launcher.
    """
    if importlib.util.find_spec("mindspore.parallel.cluster.run") is None:
        import pytest  # here: the rank workers import this module too, without pytest

        pytest.skip("this MindSpore has no msrun launcher (mindspore.parallel.cluster.run)")
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
