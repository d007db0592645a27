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

# System libraries the tools need: libb64 (perf_analyzer from the tritonclient wheel) and
# libpython3.X (the Python backend stub links it; manylora.tritonserver points the stub at the
# venv interpreter's own copy when it has one, the system's copy is the fallback). Installed
# with apt-get where missing and we may (root); otherwise the message says what to install.
py_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
missing=()
ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d' || missing+=(libb64-0d)
ldconfig -p 2>/dev/null | grep -q "libpython$py_version\.so\.1" || missing+=("libpython$py_version")
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing system libraries: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing system libraries ${missing[*]}: install them (e.g. sudo apt-get install ${missing[*]})" >&2
  fi
fi

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
