"""A run's folder on disk, for ``gradaccum train`` and ``gradaccum compare``: the lock that keeps
a second run out (``run_lock``), files that prove their bytes (``sealed``), the checkpoint's
format (``checkpoint``) and the checks of its every field (``checkpoint_fields``), the run's files
and their atomic writes (``outputs``), stopping cleanly on SIGINT or SIGTERM (``interrupt``), and
the refusal they share, ``ConfigError`` (``errors``). docs/CLI.md tells what a user sees of them.

May import: gradaccum.core, gradaccum.torch

It sits below the seed experiment (``gradaccum.demos``) and the commands (``gradaccum.cli``),
which import it; it knows a run's settings and results only through what they hand it. Besides
``gradaccum.__version__`` it imports torch and numpy (the checkpoint). Nothing is imported here:
``gradaccum.demos.config`` imports ``errors`` and must not load torch.
"""
