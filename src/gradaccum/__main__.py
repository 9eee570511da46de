"""``python -m gradaccum`` runs the same command line as the ``gradaccum`` script."""

from gradaccum.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
