#!/usr/bin/env bash
# Quick start, command 2: set up .venv with the test extras (idempotent), then run the tests,
# ruff, mypy and the documentation build (warnings as errors, into site/). Extra arguments go to
# pytest, e.g. -k accumulator.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,demo,mindspore,bench
# Two workers (pytest-xdist; one where there is one core): a test isolates its files and ports, so
# none depends on another's order. More workers gain little here: the multi-process tests start
# ranks of their own. Pass -n 0 to run in one process.
.venv/bin/python -m pytest -n auto --maxprocesses 2 "$@"
.venv/bin/ruff check src tests
.venv/bin/mypy
.venv/bin/mkdocs build --strict
