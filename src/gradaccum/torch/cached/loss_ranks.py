"""Which ranks run ``backward_cached``'s ``loss_fn`` on the same gathered representations.

Under data parallel every rank runs ``loss_fn`` on the same leaves (every rank's outputs, gathered
in rank order). While it runs, :func:`loss_ranks` names those ranks (:func:`ranks_running_loss`
sets it), so that a loss that knows it, the tiled losses of ``gradaccum.contrastive``, may share
its rows out among the ranks and sum their parts. A loss of one's own never reads it, and keeps
the global computation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from gradaccum.torch.distributed.base import GradSync
from gradaccum.torch.distributed.collectives import RankGroups

__all__ = ["loss_ranks", "ranks_running_loss"]

_LOSS_RANKS: ContextVar[RankGroups | None] = ContextVar("gradaccum_loss_ranks", default=None)


@contextmanager
def ranks_running_loss(sync: GradSync) -> Iterator[None]:
    """While the block runs (``loss_fn`` on the gathered leaves), :func:`loss_ranks` returns
    ``sync`` when it spans more than one rank: every rank runs the same loss on the same inputs."""
    if sync.world_size == 1:
        yield
        return
    assert isinstance(sync, RankGroups)
    token = _LOSS_RANKS.set(sync)
    try:
        yield
    finally:
        _LOSS_RANKS.reset(token)


def loss_ranks() -> RankGroups | None:
    """The ranks that run the current ``loss_fn`` on the same gathered representations, or None
    (one process, or outside ``backward_cached``'s loss)."""
    return _LOSS_RANKS.get()
