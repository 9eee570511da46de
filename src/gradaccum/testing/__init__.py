"""Test your own accumulation loop: does it give the full batch's updates, for any split?

May import: gradaccum.core, gradaccum.torch

``assert_accumulation_exact`` runs your update step (your model, optimizer and accumulation code
over a list of micro-batches: one optimizer step) for several windows of a scheduled learning
rate, on the same global batch split several ways, on one process or on W gloo ranks, and
compares every window's parameters with a full-batch reference's (clipped as your loop clips).
When a split differs, it runs more splits and names a cause only when the evidence singles it
out (``0.25x the full batch: divided by the steps twice``, with the ratios that show it);
otherwise it gives the difference and lists the candidates. Import it explicitly
(``import gradaccum`` does not load it)::

    from gradaccum.testing import assert_accumulation_exact

For pytest: it raises ``AssertionError``. See docs/TESTING.md.
"""

from gradaccum.testing._assert import assert_accumulation_exact
from gradaccum.testing._report import AccumulationReport, SplitResult, describe_update

__all__ = ["AccumulationReport", "SplitResult", "assert_accumulation_exact", "describe_update"]
