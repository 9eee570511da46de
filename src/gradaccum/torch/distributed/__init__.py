"""One gradient sync per window across data-parallel ranks (docs/DISTRIBUTED.md).

:mod:`~gradaccum.torch.distributed.base` holds the protocol and the single-process strategy,
:mod:`~gradaccum.torch.distributed.collectives` the collectives every distributed strategy
shares (rank agreement, the window's loss and item reduction), one module per strategy
(:mod:`~gradaccum.torch.distributed.ddp`, :mod:`~gradaccum.torch.distributed.fsdp`), and
:mod:`~gradaccum.torch.distributed.selector` picks one for a model. A pipeline's sync, whose window
spans the stages, is ``backward_pipeline``'s (``torch/pipeline/sync.py``).

It may import the core and two of the window's parts beside ``accumulator.py`` (gradient passes,
weights); never ``accumulator.py``, ``pipeline/`` or ``cached/``, which use it.
"""
