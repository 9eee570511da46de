"""Memory: AutoBatch (split global batches, recover from out-of-memory), OOM recognition, memory
probes behind ``gradaccum plan``, and batch splitting (docs/MEMORY.md)."""
