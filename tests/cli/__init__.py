"""Tests of the command line; :func:`run` is their one way to call it and read the error."""

from gradaccum.cli import main


def run(argv, capsys):
    """``main(argv)``'s exit code and what it wrote on stderr."""
    code = main(argv)
    return code, capsys.readouterr().err
