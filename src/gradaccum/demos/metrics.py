"""What a demo run writes: ``metrics.jsonl``, ``summary.json``, and PNG plots of its curves."""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from gradaccum.demos.config import EpochResult, RunResult
from gradaccum.run_folder.outputs import atomic_write

__all__ = ["MetricsWriter", "peak_rss_bytes", "plot_runs", "read_metrics", "write_summary"]


def peak_rss_bytes() -> int:
    """The process's own peak resident memory so far.

    On Linux this is ``VmHWM`` from ``/proc/self/status``, not ``getrusage``'s ``ru_maxrss``:
    a process started by another one (``gradaccum compare`` starts one per setting) begins with
    the starter's peak in ``ru_maxrss``, carried over by the kernel through ``exec``.
    Elsewhere ``ru_maxrss`` (macOS reports bytes, other systems KiB).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MetricsWriter:
    """Append JSON lines to ``DIR/metrics.jsonl`` (nothing when ``out`` is None).

    Each line has a ``kind``: ``"window"`` (one applied window: epoch, samples seen when it was
    applied, its loss) or ``"epoch"`` (an :class:`~gradaccum.demos.config.EpochResult`).
    :attr:`records` keeps every line written, for a checkpoint; a resumed run passes them back
    as ``records`` and the file starts again from them (dropping lines a killed run wrote after
    its last checkpoint).

    Example:
        >>> w = MetricsWriter(None)
        >>> w.windows(epoch=1, samples=[64, 128], losses=[2.3, 2.2])
        >>> len(w.records)
        2
    """

    def __init__(self, out: Path | None, records: Sequence[dict[str, Any]] = ()) -> None:
        self._file: TextIO | None = None
        self.records: list[dict[str, Any]] = []
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self._file = (out / "metrics.jsonl").open("w")
        for record in records:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def windows(self, *, epoch: int, samples: Sequence[int], losses: Sequence[float]) -> None:
        """Record the windows of one epoch: samples seen when each was applied, and its loss."""
        for seen, loss in zip(samples, losses, strict=True):
            self._write({"kind": "window", "epoch": epoch, "samples": seen, "loss": loss})

    def epoch(self, result: EpochResult) -> None:
        """Record one epoch's results."""
        self._write({"kind": "epoch", **asdict(result)})

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` back."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(run: RunResult, out: Path) -> Path:
    """Write ``summary.json`` (settings, per-epoch results, time) into ``out``, atomically."""
    text = json.dumps(run.summary(), indent=2) + "\n"
    return atomic_write(out / "summary.json", lambda tmp: tmp.write_text(text))


def _smooth(x: Sequence[float], y: Sequence[float], points: int = 200) -> tuple[list[float], list[float]]:
    """Average consecutive values into at most ``points`` points (window losses are noisy)."""
    k = max(1, len(y) // points)
    return ([sum(x[i:i + k]) / len(x[i:i + k]) for i in range(0, len(x), k)],
            [sum(y[i:i + k]) / len(y[i:i + k]) for i in range(0, len(y), k)])


def plot_runs(runs: Sequence[tuple[str, list[dict[str, Any]]]], path: Path, title: str) -> Path:
    """Plot training loss against samples seen and test accuracy per epoch, one line per run.

    Args:
        runs: ``(label, metrics records)`` pairs, as :func:`read_metrics` returns them.
        path: the PNG to write.
        title: the figure's title.

    Returns:
        ``path`` (written atomically).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs:
        windows = [r for r in records if r["kind"] == "window"]
        epochs = [r for r in records if r["kind"] == "epoch"]
        x, y = _smooth([r["samples"] for r in windows], [r["loss"] for r in windows])
        ax_loss.plot(x, y, label=label, linewidth=1, alpha=0.8)
        ax_acc.plot([r["epoch"] for r in epochs], [r["test_accuracy"] for r in epochs],
                    marker="o", label=label)
    ax_loss.set(xlabel="training samples seen", ylabel="window loss (moving average)",
                title="training loss")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)
    return path
