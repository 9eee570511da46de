"""``gradaccum bench``: gradaccum against a hand-written loop, Hugging Face Accelerate and the
seed's accumulator, for time, memory and exactness; writes ``BENCHMARKS.md`` and PNG figures.
Beside it: the GPU check (``gpu/``), the models of the contrastive benchmark, and the machine
description of every table.

May import: gradaccum.core, gradaccum.torch, gradaccum.contrastive, gradaccum.demos

Modules: ``config`` (sizes, data), ``loops`` (the contenders), ``seed`` (the seed's accumulator),
``measure`` (allocator peaks, interleaved timing), one module per section (``overhead``,
``sweep``, ``exactness``, ``resident``), then ``plots``, ``report``, ``text``, and ``run``
(:func:`gradaccum.bench.run.run_bench`, what the command calls). Nothing is imported here, so that
``python -m gradaccum.bench.sweep`` (the tuned-malloc child) starts clean.
"""
