#!/usr/bin/env bash
# Idempotent development set-up: a virtualenv in $VENV (default .venv) with torch and this
# project installed (editable, extras serve/test/kernels) plus ruff.
#
# torch: the default PyPI wheel (a CUDA build) when `nvidia-smi` answers, otherwise the
# CPU build. On the project's dev/CI machines `pip install torch==2.13.0` finds the CPU
# wheel in the local wheel directory (pip's find-links). Elsewhere PyPI would serve the
# multi-GB CUDA wheel to a CPU-only host too; to get the CPU build there, run with
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (not reachable from CI).
#
# Nothing is redone while pyproject.toml, this script and the torch flavour are unchanged
# (a stamp in the venv holds their hash). Always installs into the venv, never globally.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0

if nvidia-smi >/dev/null 2>&1; then torch_flavour=cuda; else torch_flavour=cpu; fi
stamp="$VENV/.manylora-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $torch_flavour"
if [[ -x $VENV/bin/python && -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

if [[ ! -x $VENV/bin/python ]]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# -qq: the machine-wide pip config names partial local indexes, which warn on every package.
pip=("$VENV/bin/python" -m pip -qq --disable-pip-version-check)

echo "setup: installing torch $TORCH_VERSION ($torch_flavour)"
"${pip[@]}" install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
if [[ $torch_flavour == cuda ]] &&
  "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
  # A local CPU wheel also satisfies ==$TORCH_VERSION (and sorts first: +cpu).
  echo "setup: warning: nvidia-smi answers but torch is a CPU build;" \
    "remove $VENV and rerun with TORCH_INDEX_URL set to a CUDA index of download.pytorch.org" >&2
fi

# The editable install maps kernels/ and client/ into manylora through an import hook that
# a .pth file registers. The Python backend stub runs site.py of the venv's python3, so the
# hook works there too (tests/e2e/test_launcher.py checks it). Don't use
# editable_mode=compat: it only puts the repository root on sys.path and loses the mapping.
echo "setup: installing manylora (editable) with extras serve,test,kernels and ruff"
"${pip[@]}" install -e '.[serve,test,kernels]' ruff

echo "$want" >"$stamp"
echo "setup: done ($VENV)"
