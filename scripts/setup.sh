#!/usr/bin/env bash
# Idempotent development set-up: a virtualenv in $VENV (default .venv) with torch and this
# project installed (editable, extras serve/test/kernels) plus ruff. The installing itself
# is scripts/install.sh, the same script the container image (docker/Dockerfile) runs.
#
# torch: the default PyPI wheel (a CUDA build) when `nvidia-smi` answers, otherwise the
# CPU build. On the project's dev/CI machines `pip install torch==2.13.0` finds the CPU
# wheel in the local wheel directory (pip's find-links). Elsewhere PyPI would serve the
# multi-GB CUDA wheel to a CPU-only host too; to get the CPU build there, run with
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (not reachable from CI).
#
# Nothing is redone while pyproject.toml, this script, scripts/install.sh and the torch
# flavour are unchanged (a stamp in the venv holds their hash). Always installs into the
# venv, never globally.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
export TORCH_VERSION=2.13.0

if nvidia-smi >/dev/null 2>&1; then torch_flavour=cuda; else torch_flavour=cpu; fi
stamp="$VENV/.manylora-setup"
want="$(cat pyproject.toml scripts/setup.sh scripts/install.sh | sha256sum | cut -d' ' -f1) $torch_flavour"
if [[ -x $VENV/bin/python && -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

if [[ ! -x $VENV/bin/python ]]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi

bash scripts/install.sh --python "$VENV/bin/python" --torch-flavour "$torch_flavour" \
  --editable --extras serve,test,kernels ruff

echo "$want" >"$stamp"
echo "setup: done ($VENV)"
