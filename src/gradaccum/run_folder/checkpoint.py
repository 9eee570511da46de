"""``gradaccum train``'s checkpoint: everything a bit-exact ``--resume`` needs, in one file.

``OUT/checkpoint.pt`` (``torch.save``d, then sealed: a header line with the payload's length
and SHA-256, :mod:`gradaccum.run_folder.sealed`; loaded with ``weights_only=True``) holds the model, the
optimizer, the scheduler (the demo has none: ``None``), the accumulator's state (a partial window
included), the RNG states (torch CPU and CUDA, Python's ``random``, NumPy's), the position in the
data (epoch and next micro-batch; each epoch's order is drawn from the seed and the epoch alone),
the metrics so far, and the settings that change the result, which ``--resume`` must repeat.
It is written through a temporary file and renamed (:func:`gradaccum.run_folder.outputs.atomic_write`);
a temporary file a killed run left behind is removed at the next save and on ``--resume``.

``--resume`` refuses, in one line and before anything changes, a file that is damaged, truncated
or edited (its seal), of another format, or whose fields do not hold together: every top-level
field, the RNG states and the position are checked (:mod:`gradaccum.run_folder.checkpoint_fields`).
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradaccum import __version__
from gradaccum.run_folder.checkpoint_fields import RunSettings, check_keys, check_position, check_rng
from gradaccum.run_folder.errors import ConfigError
from gradaccum.run_folder.outputs import CHECKPOINT, atomic_write, clear_leftovers
from gradaccum.run_folder.sealed import SealError, seal, unseal

__all__ = ["FORMAT", "FREE_FIELDS", "Position", "check_resumable", "load_checkpoint", "read_state",
           "restore_rng", "rng_state", "save_checkpoint", "write_state"]

FORMAT = 2  # 2: sealed (0.2.x wrote format 1, a bare torch.save)
# Settings that do not change the result: a resumed run may give other values.
FREE_FIELDS = frozenset({"data_dir", "log_every", "progress", "out", "checkpoint_every"})


@dataclass
class Position:
    """Where a run stands, and what it measured so far.

    Attributes:
        epoch: the epoch in progress (1-based).
        micro_batch: the next micro-batch of that epoch (0: the epoch has not started).
        window_losses, window_samples: the epoch's applied windows so far (metrics.jsonl gets
            them at the end of the epoch).
        epoch_seconds: training seconds of the epoch before this point.
        run_seconds: the run's seconds before this point.
        epochs: the finished epochs' results, as dicts (``gradaccum train``'s ``EpochResult``).
        records: the lines of ``metrics.jsonl`` written so far.
    """

    epoch: int = 1
    micro_batch: int = 0
    window_losses: list[float] = field(default_factory=list)
    window_samples: list[int] = field(default_factory=list)
    epoch_seconds: float = 0.0
    run_seconds: float = 0.0
    epochs: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The state of every random generator a run may draw from (CUDA's on a CUDA device)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
            "python": random.getstate(),
            "numpy": (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))}


def restore_rng(state: dict[str, Any]) -> None:
    """Set the generators back to :func:`rng_state`'s record."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(out: Path, *, config: RunSettings, world: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, accumulator: Any, position: Position,
                    scheduler: Any = None) -> Path:
    """Write ``out/checkpoint.pt`` atomically.

    Args:
        out: the run's folder.
        config: the run's settings.
        world: the number of ranks.
        model, optimizer, accumulator: the run's (``accumulator``: a
            :class:`gradaccum.Accumulator`; mid-window is fine on one process).
        position: where the run stands.
        scheduler: an LR scheduler, if the run has one.

    Returns:
        The checkpoint's path.
    """
    state = {
        "format": FORMAT, "gradaccum": __version__, "config": config.to_json(), "world": world,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "accumulator": accumulator.state_dict(),
        "rng": rng_state(torch.device(config.device)), "position": asdict(position),
    }
    path = write_state(out / CHECKPOINT, state)
    clear_leftovers(out, CHECKPOINT)  # a killed run's temporary file
    return path


def write_state(path: Path, state: dict[str, Any]) -> Path:
    """Serialize ``state`` with ``torch.save``, seal it and write it atomically to ``path``.

    The bytes are built in memory first, so that a full disk fails in the plain file write
    (an ``OSError`` that says so), never inside ``torch.save``'s zip writer.

    Example:
        >>> import tempfile
        >>> path = write_state(Path(tempfile.mkdtemp()) / "x.pt", {"a": 1})
        >>> read_state(path)
        {'a': 1}
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = seal(buffer.getvalue())
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def read_state(path: Path) -> Any:
    """Read what :func:`write_state` wrote, once its seal proves the bytes.

    Raises:
        ConfigError: the file is not sealed, is damaged, truncated or edited, or does not load.
    """
    try:
        payload = unseal(path.read_bytes())
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except SealError as err:
        raise ConfigError(f"--resume: {path} is refused: {err}") from None
    except Exception as err:  # whatever makes it unreadable, it is the same usage error
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(f"--resume: {path} is not a readable checkpoint "
                          f"({type(err).__name__}: {first})") from err


def load_checkpoint(out: Path) -> dict[str, Any]:
    """Read ``out/checkpoint.pt``, proven by its seal, and check its top-level fields.

    Raises:
        ConfigError: there is none; it is damaged, truncated or edited; it is not a checkpoint
            of this format, or a field is missing or of the wrong type.
    """
    path = out / CHECKPOINT
    if not path.is_file():
        finished = " (the run there finished)" if (out / "summary.json").is_file() else ""
        raise ConfigError(f"--resume: no {CHECKPOINT} in {out}{finished}; nothing to resume")
    clear_leftovers(out, CHECKPOINT)
    data = path.read_bytes()
    if not data.startswith(b"gradaccum-sealed"):
        raise ConfigError(f"--resume: {path} is not a gradaccum train checkpoint of format {FORMAT} "
                          "(no integrity header: damaged, or written by gradaccum 0.2 or earlier)")
    state = read_state(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"--resume: {path} is not a gradaccum train checkpoint of format {FORMAT}")
    check_keys(state, CHECKPOINT)
    return state


def _flag(name: str, value: Any) -> str:
    if name == "steps" and isinstance(value, str):
        return "--steps-schedule"
    return "--" + name.replace("_", "-")


def check_resumable(state: dict[str, Any], config: RunSettings, world: int, *,
                    results: type[Any]) -> None:
    """Refuse to resume a checkpoint with settings that change the result, or whose RNG states
    or position do not fit them (the epoch within ``--epochs``, the metrics so far in step).

    Args:
        state: what :func:`load_checkpoint` returned.
        config: this run's settings.
        world: this run's number of ranks.
        results: the dataclass of one finished epoch's results (``EpochResult`` in
            ``gradaccum train``; see :func:`~gradaccum.run_folder.checkpoint_fields.check_position`).

    Raises:
        ConfigError: the first setting that differs, with both values; or the first field wrong.

    Example:
        >>> from dataclasses import make_dataclass
        >>> from types import SimpleNamespace
        >>> def settings(lr):  # a run's settings (a TrainConfig in gradaccum train)
        ...     return SimpleNamespace(device="cpu", epochs=3, to_json=lambda: {"lr": lr})
        >>> saved = {"config": settings(0.01).to_json(), "world": 1, "position": {}, "rng": {}}
        >>> try:
        ...     check_resumable(saved, settings(0.02), 1, results=make_dataclass("Result", ["epoch"]))
        ... except ConfigError as err:
        ...     print(str(err)[:45])
        --resume: --lr is 0.02 here but 0.01 in the r
    """
    if state["world"] != world:
        raise ConfigError(f"--resume: the run being resumed trained on {state['world']} rank(s), "
                          f"this one has {world}")
    saved, now = state["config"], config.to_json()
    for name, value in now.items():
        if name not in FREE_FIELDS and saved.get(name) != value:
            raise ConfigError(f"--resume: {_flag(name, value)} is {value!r} here but "
                              f"{saved.get(name)!r} in the run being resumed; give the run's own "
                              "arguments")
    check_rng(state["rng"], config.device, CHECKPOINT)
    check_position(state["position"], config, CHECKPOINT, results=results)
