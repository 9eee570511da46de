#!/usr/bin/env bash
# Quick start, command 1: set up .venv (idempotent) and run the seed experiment
# (MNIST, MLP 784-512-512-10, micro-batch 32 x 2 steps against batch 64, 3 epochs).
# Extra arguments go to "gradaccum compare", e.g. --epochs 1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/gradaccum compare "$@"
