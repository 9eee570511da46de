"""``Accumulator.backward_pipeline``'s machinery: one ``torch.distributed.pipelining`` schedule's
``step()`` as one micro-batch of a window that spans every stage and replica (docs/PIPELINE.md).

It may import the core, the window's parts beside ``accumulator.py`` (boundary, precision,
weights, validation, window loss) and ``distributed/``; never ``accumulator.py``, which calls it.
"""
