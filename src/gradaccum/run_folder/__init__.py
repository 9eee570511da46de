"""A run's folder on disk, for ``gradaccum train`` and ``gradaccum compare``: one run per folder.

The lock that keeps a second run out (``run_lock``), files that prove their bytes (``sealed``),
the checkpoint's format (``checkpoint``) and the checks of its every field
(``checkpoint_fields``), the run's files and their atomic writes (``outputs``), stopping cleanly
on SIGINT or SIGTERM (``interrupt``), and the refusal they share, ``ConfigError`` (``errors``).
docs/CLI.md tells what a user sees of them.

It sits below the seed experiment (``gradaccum.demos``) and the commands (``gradaccum.cli``),
which import it; it reads a run's settings and results only through what they are handed. It
imports torch and numpy (the checkpoint) and ``gradaccum.__version__``. Nothing is imported here:
``gradaccum.demos.config`` imports ``errors`` and must not load torch.

May import: gradaccum.core, gradaccum.torch
"""
