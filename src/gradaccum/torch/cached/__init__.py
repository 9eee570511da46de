"""``Accumulator.backward_cached``'s machinery: representation caching, one batch whose loss couples
its examples fed as one micro-batch of the window (docs/CONTRASTIVE.md).

It may import the core, the window's parts beside ``accumulator.py`` (precision, weights,
validation, gradient passes) and ``distributed/``; never ``accumulator.py``, which calls it.
``gradaccum.chunks`` (``chunks.py``) cuts its input; ``gradaccum.contrastive`` reads which ranks
run the loss (``loss_ranks.py``).
"""
