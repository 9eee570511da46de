"""``gradaccum bench``: gradaccum against a hand-written loop, Hugging Face Accelerate and the
seed's accumulator, for time, memory and exactness; writes ``BENCHMARKS.md`` and PNG figures.

Modules: ``config`` (sizes, data), ``loops`` (the contenders), ``seed`` (the seed's accumulator),
``measure`` (allocator peaks, interleaved timing), one module per section (``overhead``,
``sweep``, ``exactness``, ``resident``), then ``plots``, ``report``, ``text``, and ``run``
(:func:`gradaccum.bench.run.run_bench`, what the command calls). Nothing is imported here, so that
``python -m gradaccum.bench.sweep`` (the tuned-malloc child) starts clean.
"""
