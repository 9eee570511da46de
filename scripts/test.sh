#!/usr/bin/env bash
# Quick start, command 2: set up .venv with the test extras (idempotent), then run the tests,
# ruff, mypy and the documentation build (warnings as errors, into site/). Extra arguments go to
# pytest, e.g. -k accumulator.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,demo,mindspore,bench
.venv/bin/python -m pytest "$@"
.venv/bin/ruff check src tests
.venv/bin/mypy
.venv/bin/mkdocs build --strict
