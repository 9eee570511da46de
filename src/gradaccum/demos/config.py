"""The demo experiment's settings and results, shared by every backend's trainer and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

# Defined in the run folder's room (its lock and checkpoint refuse with it): the same class.
from gradaccum.run_folder.errors import ConfigError

__all__ = ["BN_MODES", "ConfigError", "EpochResult", "RunResult", "TrainConfig"]

# How a model's BatchNorm layers are treated under accumulation (``gradaccum train --bn``); see
# :func:`gradaccum.demos.models.apply_bn_mode`.
BN_MODES = ("plain", "compound", "linear", "window", "groupnorm")


@dataclass
class TrainConfig:
    """One run of the seed experiment. The defaults are the seed tutorial's: MNIST, the MLP
    784-512-512-10, SGD lr 0.01, micro-batch 32 x 2 steps, 3 epochs.

    Attributes:
        model: a name from :data:`gradaccum.demos.models.MODELS` (``mlp``, ``cnn``, ``cnn-bn``).
        bn: how BatchNorm layers are treated, one of :data:`BN_MODES`
            (``plain``, ``compound``, ``linear``, ``window``, ``groupnorm``).
        init: ``"torch"`` or ``"mindspore"`` (N(0, 0.01) linear weights, zero bias).
        micro_batch: items per micro-batch.
        steps: micro-batches per window: an int, or a schedule string ``"0:4,2:2"``.
        lr: the learning rate (after any scaling rule, see the CLI's ``--lr-rule``).
        optimizer: ``"sgd"``, ``"momentum"`` (SGD, momentum 0.9), ``"adam"`` or ``"adamw"``.
        epochs: passes over the training set, reshuffled every epoch.
        seed: seeds the weights and the data order (same seed, same order for any micro x steps).
        end_of_epoch: ``"flush"`` the partial window at the end of each epoch, or ``"carry"`` it
            into the next epoch (the tutorial's counter does this).
        data_dir: a folder with the four MNIST files (default: the checkout's data/mnist, else
            the user's cache; see :mod:`gradaccum.demos.data_dirs`).
        limit_train, limit_test: use only the first items (tests, smoke runs).
        precision: ``"fp32"`` or ``"bf16"`` (autocast).
        backend: ``"torch"`` or ``"mindspore"``.
        device: where the torch backend trains (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        log_every: print the seed's ``loss: x  [i/size]`` line every this many micro-batches.
        progress: show a progress bar.
        out: a folder for ``metrics.jsonl``, ``summary.json``, ``params.npz`` and ``curves.png``.
        checkpoint_every: write ``out/checkpoint.pt`` every this many optimizer steps (torch
            backend; ``None``: only when interrupted). See :mod:`gradaccum.run_folder.checkpoint`.
    """

    model: str = "mlp"
    bn: str = "plain"
    init: str = "torch"
    micro_batch: int = 32
    steps: int | str = 2
    lr: float = 0.01
    optimizer: str = "sgd"
    epochs: int = 3
    seed: int = 0
    end_of_epoch: Literal["flush", "carry"] = "flush"
    data_dir: Path | None = None
    limit_train: int | None = None
    limit_test: int | None = None
    precision: Literal["fp32", "bf16"] = "fp32"
    backend: Literal["torch", "mindspore"] = "torch"
    device: str = "cpu"
    log_every: int = 100
    progress: bool = True
    out: Path | None = None
    checkpoint_every: int | None = None

    @property
    def label(self) -> str:
        """A short name for tables: ``32x2``."""
        return f"{self.micro_batch}x{self.steps}"

    def to_json(self) -> dict[str, Any]:
        """The settings as JSON-able values."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class EpochResult:
    """What one epoch produced (one line of ``metrics.jsonl`` with ``"kind": "epoch"``)."""

    epoch: int
    test_accuracy: float  # percent
    test_loss: float  # mean over test batches, as the seed prints it
    train_loss: float  # mean of the window losses of the epoch
    optimizer_steps: int  # cumulative
    seconds: float  # training time of the epoch (no evaluation)
    samples_per_s: float
    peak_memory_bytes: int  # allocator peak (CUDA) or process max RSS growth (CPU)
    skipped_windows: int = 0


@dataclass
class RunResult:
    """A whole run: its settings, per-epoch results and the final parameters (for comparisons)."""

    config: TrainConfig
    epochs: list[EpochResult] = field(default_factory=list)
    seconds: float = 0.0
    final_params: Any = None  # list of numpy arrays, in parameter order

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (``summary.json``)."""
        return {"config": self.config.to_json(), "seconds": self.seconds,
                "epochs": [asdict(e) for e in self.epochs]}
