"""``gradaccum bench``: gradaccum against a hand-written loop, Hugging Face Accelerate and the
seed's accumulator, for time, memory and exactness; writes ``BENCHMARKS.md`` and PNG figures.

Modules: ``config`` (sizes, data), ``loops`` (the contenders), ``seed`` (the seed's accumulator),
``measure`` (allocator peaks, interleaved timing), one module per section (``overhead``,
``sweep``, ``exactness``, ``resident``), and ``plots``, ``report``, ``text``, ``run``.
"""

from gradaccum.bench.run import run_bench

__all__ = ["run_bench"]
