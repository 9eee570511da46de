"""Every field of a ``gradaccum train`` checkpoint, checked before any of it is used.

A checkpoint's bytes are proven by its seal (:mod:`gradaccum.run_folder.sealed`); these checks catch
what a seal cannot: a file written with the right seal but wrong content (edited by a tool that
re-sealed it, or by a bug). Each check raises :class:`ConfigError` naming the field and its
value, so that ``--resume`` refuses the file in one line (exit 2) before anything changes.

The checks know the run's settings by what they read of them (:class:`RunSettings`) and a
finished epoch's record by the dataclass the caller names (``results``): the seed experiment's
``TrainConfig`` and ``EpochResult`` live in :mod:`gradaccum.demos`, a floor above this one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, Protocol

import numpy as np
import torch

from gradaccum.run_folder.errors import ConfigError

__all__ = ["RunSettings", "check_keys", "check_position", "check_rng"]

_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": int, "gradaccum": str, "config": dict, "world": int, "model": dict, "optimizer": dict,
    "scheduler": (dict, type(None)), "accumulator": dict, "rng": dict, "position": dict}


class RunSettings(Protocol):
    """What a checkpoint records and checks of a run's settings (``gradaccum train``'s
    ``TrainConfig`` is one)."""

    @property
    def device(self) -> str:
        """Where the run trains (``"cpu"``, ``"cuda:1"``): whose generators the checkpoint holds."""

    @property
    def epochs(self) -> int:
        """Passes over the training set: a position's epoch is within ``1..epochs``."""

    def to_json(self) -> dict[str, Any]:
        """The settings as JSON-able values, as the checkpoint records them."""


def _refuse(where: str, problem: str) -> ConfigError:
    return ConfigError(f"--resume: {where}: {problem}; the checkpoint cannot be resumed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rng(rng: Any, device: str, where: str) -> None:
    """Check the generators' states: each one is tried on a scratch generator of its kind.

    Raises:
        ConfigError: a state missing, of the wrong type, or one its generator refuses.

    Example:
        >>> from gradaccum.run_folder.checkpoint import rng_state
        >>> check_rng(rng_state(torch.device("cpu")), "cpu", "checkpoint.pt")
    """
    if not isinstance(rng, dict) or set(rng) != {"torch", "cuda", "python", "numpy"}:
        keys = sorted(rng) if isinstance(rng, dict) else type(rng).__name__
        raise _refuse(where, f"rng must hold torch, cuda, python and numpy states, got {keys}")
    tries: dict[str, Callable[[Any], object]] = {"torch": lambda s: torch.Generator().set_state(s),
             "python": lambda s: random.Random().setstate(s),
             "numpy": lambda s: np.random.RandomState().set_state(
                 (s[0], np.array(s[1], dtype=np.uint32), *s[2:]))}
    for name, attempt in tries.items():
        state = rng[name]
        if name == "torch" and not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8):
            raise _refuse(where, f"rng.torch must be a uint8 tensor, got {type(state).__name__}")
        try:
            attempt(state)
        except (TypeError, ValueError, RuntimeError, IndexError, OverflowError) as err:
            raise _refuse(where, f"rng.{name} is not a {name} generator state "
                                 f"({type(err).__name__})") from None
    cuda = rng["cuda"]
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda != (cuda is not None) or (cuda is not None and not (
            isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                           for t in cuda))):
        raise _refuse(where, f"rng.cuda must be {'a list of uint8 tensors' if on_cuda else 'None'} "
                             f"on --device {device}, got {type(cuda).__name__}")


def _check_epochs(position: dict[str, Any], where: str, results: type[Any]) -> None:
    """The finished epochs (each a ``results`` as a dict: a field with a default may be missing)
    and the metrics lines agree with the position's epoch."""
    epoch, epochs, records = position["epoch"], position["epochs"], position["records"]
    names = {f.name for f in fields(results)}
    required = {f.name for f in fields(results) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(epochs, list) or len(epochs) != epoch - 1:
        raise _refuse(where, f"position.epochs must list the {epoch - 1} finished epoch(s), got "
                             f"{len(epochs) if isinstance(epochs, list) else type(epochs).__name__}")
    for k, result in enumerate(epochs, start=1):
        if not (isinstance(result, dict) and required <= set(result) <= names
                and result["epoch"] == k and all(_is_number(v) for v in result.values())):
            raise _refuse(where, f"position.epochs[{k - 1}] is not epoch {k}'s results")
    if not (isinstance(records, list) and all(isinstance(r, dict) and r.get("kind") in
                                              ("window", "epoch") for r in records)):
        raise _refuse(where, "position.records must be metrics lines of kind window or epoch")
    done = [r for r in records if r["kind"] == "epoch"]
    if len(done) != epoch - 1:
        raise _refuse(where, f"position.records hold {len(done)} epoch line(s), not {epoch - 1}")


def check_position(position: Any, config: RunSettings, where: str,
                   micro_batches: int | None = None, *, results: type[Any]) -> None:
    """Check where a checkpoint stands against the run's settings.

    Args:
        position: the checkpoint's ``position`` (a :class:`~gradaccum.run_folder.checkpoint.Position`
            as a dict).
        config: the run's settings (``epochs`` bounds the epoch).
        where: the checkpoint's name, for messages.
        micro_batches: micro-batches in one epoch on this rank, when known (bounds the
            micro-batch).
        results: the dataclass of one finished epoch's results (``EpochResult`` in
            ``gradaccum train``): each of ``position.epochs`` must be one as a dict.

    Raises:
        ConfigError: a field missing, of the wrong type, or out of its range.

    Example:
        >>> from dataclasses import asdict, make_dataclass
        >>> from types import SimpleNamespace
        >>> from gradaccum.run_folder.checkpoint import Position
        >>> run = SimpleNamespace(epochs=3)  # a run's settings (a TrainConfig in gradaccum train)
        >>> result = make_dataclass("Result", ["epoch", "test_loss"])
        >>> try:
        ...     check_position(asdict(Position(epoch=9)), run, "x", results=result)
        ... except ConfigError as err:
        ...     print(str(err)[:50])
        --resume: x: position.epoch is 9, outside 1..3 (--
    """
    names = {"epoch", "micro_batch", "window_losses", "window_samples", "epoch_seconds",
             "run_seconds", "epochs", "records"}
    if not isinstance(position, dict) or set(position) != names:
        raise _refuse(where, f"position must hold {sorted(names)}")
    epoch, micro = position["epoch"], position["micro_batch"]
    if not (_is_int(epoch) and 1 <= epoch <= config.epochs):
        raise _refuse(where, f"position.epoch is {epoch!r}, outside 1..{config.epochs} (--epochs)")
    top = micro_batches if micro_batches is not None else math.inf
    if not (_is_int(micro) and 0 <= micro <= top):
        span = f"0..{micro_batches}" if micro_batches is not None else ">= 0"
        raise _refuse(where, f"position.micro_batch is {micro!r}, outside {span} (one epoch)")
    losses, samples = position["window_losses"], position["window_samples"]
    if not (isinstance(losses, list) and all(isinstance(v, float) for v in losses)
            and isinstance(samples, list) and all(_is_int(v) and v >= 0 for v in samples)
            and len(losses) == len(samples) and samples == sorted(samples)):
        raise _refuse(where, "position.window_losses and window_samples must be one float and "
                             "one growing count >= 0 per window")
    for name in ("epoch_seconds", "run_seconds"):
        value = position[name]
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise _refuse(where, f"position.{name} is {value!r}, not a finite number >= 0")
    _check_epochs(position, where, results)


def check_keys(state: Any, where: str) -> None:
    """Check that a loaded checkpoint holds every top-level field, each of its type.

    Raises:
        ConfigError: the first field missing or of another type.

    Example:
        >>> try:
        ...     check_keys({"format": 2}, "checkpoint.pt")
        ... except ConfigError as err:
        ...     print(str(err)[:50])
        --resume: checkpoint.pt: it has no 'gradaccum'; th
    """
    if not isinstance(state, dict):
        raise _refuse(where, f"a checkpoint is a dict, got {type(state).__name__}")
    for key, kind in _KEYS.items():
        if key not in state:
            raise _refuse(where, f"it has no {key!r}")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise _refuse(where, f"{key!r} is a {type(state[key]).__name__}")
    if state["world"] < 1:
        raise _refuse(where, f"'world' is {state['world']}, not a number of ranks >= 1")
