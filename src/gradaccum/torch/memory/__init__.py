"""Memory: AutoBatch (split global batches, recover from out-of-memory), OOM recognition, memory
probes behind ``gradaccum plan``, and batch splitting (docs/MEMORY.md).

It may import the core, ``accumulator.py`` (AutoBatch drives an Accumulator through its public
API), ``_validate.py`` and the sync protocol (``distributed/base.py``)."""
