#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv in the checkout and install gradaccum into it.
#   bash scripts/setup.sh [EXTRAS]      e.g. EXTRAS=dev,mindspore,bench
# Idempotent: a stamp records what was installed; a second run with the same pyproject.toml and
# extras installs nothing and prints nothing. Otherwise each step says what it does, one line on
# stderr (a first set-up downloads torch and takes minutes). torch is installed first, as the CPU
# build on machines without an NVIDIA GPU, so that the plain "torch" requirement never pulls a
# multi-GB CUDA build there.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv=.venv
py="${PYTHON:-python3}"
torch_version=2.13.0
started=$SECONDS

say() { echo "setup: $*" >&2; }
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }

stamp="$venv/.gradaccum-stamp"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) extras=$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    say "creating the virtual environment $venv ($py -m venv)"
    "$py" -m venv "$venv"
fi

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        say "installing torch $torch_version into $venv, the CUDA build (minutes on a first set-up)"
        pip install "torch==$torch_version"
    else
        # The CPU build: from a local wheel directory where pip is configured with one, else
        # from PyTorch's CPU index.
        say "installing torch $torch_version into $venv, the CPU build (minutes on a first set-up)"
        pip install "torch==$torch_version+cpu" 2>/dev/null \
            || pip install "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
say "installing gradaccum into $venv, editable, with ${extras:+the extras $extras and }its requirements"
pip install -e "$spec" 2>&1 | grep -v "is ignored: it is neither" || true
"$venv/bin/python" -c "import gradaccum" || { echo "gradaccum failed to install" >&2; exit 1; }
echo "$want" > "$stamp"
say "$venv is ready ($((SECONDS - started)) s)"
