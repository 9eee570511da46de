#!/usr/bin/env bash
# The GPU check: every CUDA claim of gradaccum, measured by one command (docs/BENCHMARKS.md, "GPU").
#   bash scripts/gpu_check.sh [--smoke] [--only overhead,oom] [--out runs/gpu_check]
# Sets up .venv first (scripts/setup.sh: a CUDA build of torch where nvidia-smi sees a GPU, the
# CPU build elsewhere; idempotent, with the extras already installed there), then runs
# `python -m gradaccum.bench.gpu`: each check time-boxed in a process of its own (630 s in
# all on one GPU), or, without CUDA, each check's CPU smoke (seconds each). Prints the table and
# writes runs/gpu_check/report.md and report.json. Exit status: 0 when every check returned its
# figures (a missed target is a FAIL in its row); 1 when a check raised (or a smoke check hung).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.gradaccum-stamp
extras=""
[ -f "$stamp" ] && extras="$(sed -n 's/.* extras=//p' "$stamp")"
bash scripts/setup.sh "$extras"
exec .venv/bin/python -m gradaccum.bench.gpu "$@"
