"""``Accumulator.backward_pipeline``'s machinery: one ``torch.distributed.pipelining`` schedule's
``step()`` as one micro-batch of a window that spans every stage and replica (docs/PIPELINE.md).
``feed.py`` weighs each pipeline micro-batch's loss, ``checks.py`` is what the ranks agree on and
the mistakes each sees, ``boundary.py`` the window's one all-reduce and step, ``sync.py`` the
stages' collectives and data-parallel reduction.

It may import the core, the window's parts beside ``accumulator.py`` (boundary, precision,
weights, validation, window loss) and ``distributed/``; never ``accumulator.py``, which calls it.
"""
