"""``gradaccum compare``: the seed experiment at several micro-batch x steps settings, side by side.

Each setting runs in its own process (``gradaccum train``), with the same seed and data order, so
its time and peak memory are its own. The table shows accuracy and average test loss per epoch,
the largest parameter difference against the first setting, time and peak memory; a PNG overlays
the curves. The output folder is compare's own: a new compare replaces what an earlier one wrote.
Ctrl-C (or SIGTERM) is passed on to the running setting, which writes its checkpoint and stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from gradaccum.cli._errors import CommandError, UsageError
from gradaccum.cli._options import check_count, check_device, mnist_dir, out_dir, plain_int, writable_dir
from gradaccum.cli.train import add_experiment_arguments
from gradaccum.run_folder.interrupt import Interrupted, handling
from gradaccum.run_folder.outputs import CHECKPOINT, atomic_write
from gradaccum.run_folder.run_lock import run_lock

__all__ = ["add_parser", "format_table", "parse_backends", "parse_settings"]

DEFAULT_SETTINGS = "64x1,32x2,8x8"
BACKENDS = ("torch", "mindspore")


def parse_settings(text: str) -> list[tuple[int, int]]:
    """Parse ``"64x1,32x2"`` into ``[(64, 1), (32, 2)]``.

    Raises:
        ValueError: an entry is not ``MICROxSTEPS`` with integers from 1 to
            :data:`~gradaccum.cli._options.MAX_COUNT`, or is given twice (each setting's run
            has a folder of its own).

    Example:
        >>> parse_settings("64x1, 8x8")
        [(64, 1), (8, 8)]
    """
    settings = []
    for entry in text.split(","):
        left, _, right = entry.strip().partition("x")
        micro, steps = plain_int(left), plain_int(right)  # written plainly, as every other count
        if micro is None or steps is None or micro < 1 or steps < 1:
            raise ValueError(f"--settings entry {entry.strip()!r} is not MICROxSTEPS, e.g. 32x2")
        setting = (check_count(micro, "--settings micro-batch"), check_count(steps, "--settings steps"))
        if setting in settings:
            raise ValueError(f"--settings {text!r} gives {setting[0]}x{setting[1]} twice: each "
                             "setting runs once")
        settings.append(setting)
    return settings


def parse_backends(text: str) -> list[str]:
    """Parse ``--backends`` (``"torch,mindspore"``) into a list.

    Raises:
        ValueError: an unknown or repeated backend.

    Example:
        >>> parse_backends("torch, mindspore")
        ['torch', 'mindspore']
    """
    backends = [b.strip() for b in text.split(",")]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends entry {b!r} is not one of {', '.join(BACKENDS)}")
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends {text!r} names a backend twice")
    return backends


def _experiment_argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """Turn the parsed experiment options back into ``train`` arguments (non-defaults only)."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(f"--{'' if value else 'no-'}{action.dest.replace('_', '-')}")
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def _max_param_diff(a: Path, b: Path) -> float:
    import numpy as np

    with np.load(a) as pa, np.load(b) as pb:
        return max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa.files)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of compare's rows (one per setting)."""
    epochs = len(rows[0]["epochs"])
    head = ["setting"] + [f"epoch {e} acc / loss" for e in range(1, epochs + 1)]
    head += [f"max abs param diff vs {rows[0]['setting']}", "time (s)", "peak RSS (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["setting"]]
        cells += [f"{e['test_accuracy']:.1f}% / {e['test_loss']:.4f}" for e in row["epochs"]]
        cells += [f"{row['max_param_diff']:.2e}", f"{row['seconds']:.1f}",
                  f"{row['peak_memory_bytes'] / 2**20:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_child(cmd: list[str], label: str, run_dir: Path) -> int:
    """Run one setting's ``gradaccum train``; pass SIGINT and SIGTERM on to it, once.

    The child has a session of its own, so Ctrl-C in a terminal reaches it only through this
    process (once, not twice), and it can write its checkpoint before it stops.

    Raises:
        Interrupted: a signal arrived; the child has stopped.
    """
    proc = subprocess.Popen(cmd, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    try:
        with handling(forward):
            code = proc.wait()
    finally:
        if proc.poll() is None:  # an error here: leave no setting running on its own
            proc.kill()
            proc.wait()
    if received:
        saved = run_dir / CHECKPOINT
        note = f"; its checkpoint is {saved}" if saved.is_file() else ""
        raise Interrupted(received[0], message=f"interrupted by {signal.Signals(received[0]).name} "
                                               f"during the {label} run (exit {code}){note}")
    return code


def _clear_previous(out: Path) -> None:
    """Remove what an earlier compare wrote into its own folder, so that no table outlives the
    runs it describes (each setting's folder is replaced by its run, with --overwrite)."""
    for name in ("compare.json", "compare.md", "compare.png"):
        (out / name).unlink(missing_ok=True)


def _run(args: argparse.Namespace) -> int:
    from gradaccum.demos.extras import require_demo_extra

    mnist_dir(args.data_dir)  # every run reads MNIST: without it, one line before any run starts
    require_demo_extra()
    try:
        settings = parse_settings(args.settings)
        backends = [args.backend] if args.backends is None else parse_backends(args.backends)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.backends is not None and args.backend != "torch":
        raise UsageError("give --backend or --backends, not both")
    check_device(args.device)
    out: Path = writable_dir(args.out)
    with run_lock(out):  # one compare per folder (each setting's run locks its own)
        return _compare(args, out, settings, backends)


def _compare(args: argparse.Namespace, out: Path, settings: list[tuple[int, int]],
             backends: list[str]) -> int:
    from gradaccum.demos.metrics import plot_runs, read_metrics

    _clear_previous(out)
    rows: list[dict[str, Any]] = []
    for (micro, steps), backend in ((s, b) for s in settings for b in backends):
        # One backend keeps the plain labels; several are told apart by a suffix.
        label = f"{micro}x{steps}" + (f"-{backend}" if len(backends) > 1 else "")
        run_dir = out / label
        print(f"\n=== {label}: micro-batch {micro} x steps {steps} ({backend}) ===", flush=True)
        cmd = [sys.executable, "-m", "gradaccum", "train", "--micro-batch", str(micro),
               "--steps", str(steps), "--out", str(run_dir), "--overwrite",
               *_experiment_argv(args, args.experiment_actions),
               *(["--backend", backend] if args.backends is not None else []),
               *(["--debug"] if getattr(args, "debug", False) else [])]
        code = _run_child(cmd, label, run_dir)
        if code != 0:
            # The run printed its own error line; a usage error stays one (exit 2).
            raise (UsageError if code == 2 else CommandError)(f"the {label} run failed (exit {code})")
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append({"setting": label, "epochs": summary["epochs"], "seconds": summary["seconds"],
                     "peak_memory_bytes": max(e["peak_memory_bytes"] for e in summary["epochs"]),
                     "max_param_diff": _max_param_diff(out / rows[0]["setting"] / "params.npz"
                                                       if rows else run_dir / "params.npz",
                                                       run_dir / "params.npz")})
    table = format_table(rows)
    print("\n" + table)
    atomic_write(out / "compare.json", lambda tmp: tmp.write_text(json.dumps(rows, indent=2) + "\n"))
    atomic_write(out / "compare.md", lambda tmp: tmp.write_text(table + "\n"))
    png = plot_runs([(r["setting"], read_metrics(out / r["setting"] / "metrics.jsonl")) for r in rows],
                    out / "compare.png", title=f"gradaccum compare: {args.model}, same seed and data order")
    print(f"\nTable: {out / 'compare.md'}   plot: {png}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``compare``."""
    p = sub.add_parser("compare", help="run the seed experiment at several micro x steps settings",
                       description="Run the seed experiment for several micro-batch x steps settings "
                                   "with the same seed and data order, and print them side by side.")
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help=f"comma-separated MICROxSTEPS (default {DEFAULT_SETTINGS})")
    p.add_argument("--out", type=out_dir, default=Path("runs/compare"),
                   help="folder for each run's outputs, compare.md/json and compare.png "
                        "(compare's own: a new compare replaces them)")
    p.add_argument("--backends", default=None, metavar="B1,B2",
                   help="run every setting on each backend, side by side (torch,mindspore); "
                        "the parameter difference then compares the backends too")
    actions = add_experiment_arguments(p)
    p.set_defaults(func=_run, experiment_actions=actions)
