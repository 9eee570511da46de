"""``Accumulator.backward_cached``'s machinery: representation caching, one batch whose loss couples
its examples fed as one micro-batch of the window (docs/CONTRASTIVE.md). ``backward.py`` runs the
two passes, ``reps.py`` gathers and slices the representations, ``replay.py`` replays the RNG and
keeps BatchNorm's statistics, ``grads.py`` puts back what a failed call wrote; ``chunks.py`` is
``gradaccum.chunks``, and ``loss_ranks.py`` tells ``gradaccum.contrastive`` which ranks run the loss.

It may import the core, the window's parts beside ``accumulator.py`` (precision, weights,
validation, gradient passes), ``distributed/`` and ``memory/split.py``; never ``accumulator.py``,
which calls it.
"""
