#!/usr/bin/env bash
# The one install procedure for ManyLoRA and its Python dependencies, shared by the local
# set-up (scripts/setup.sh: a virtualenv, editable) and the container image (docker/Dockerfile:
# the NGC image's python3), so CI, which has no Docker engine, runs the image's steps too.
#
#   scripts/install.sh --python PY [--step torch|package|all] [--torch-flavour cpu|cuda]
#                      [--extras serve,test,kernels] [--editable] [EXTRA_PACKAGE...]
#
# Steps, in order (--step picks one; the image runs them as two layers so that a source
# change does not reinstall torch):
#   torch    torch==$TORCH_VERSION from pip's configured indexes, or from TORCH_INDEX_URL.
#            Where pip is configured with a local wheel directory (find-links) holding the
#            CPU wheel, as on the project's dev and CI machines, that wheel is taken.
#   package  this repository with its dependencies (numpy<2 among them: the 24.10 Python
#            backend stub mis-reads input tensors under numpy 2.x) and EXTRA_PACKAGEs, then
#            checks that numpy is 1.x.
#
# Run from anywhere; it installs the repository it lives in. Nothing here creates a venv or
# decides whether to reinstall: the caller does (setup.sh keeps a stamp).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
python=""
step=all
flavour=cpu
extras=""
editable=0
packages=()

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

while (($#)); do
  case $1 in
  --python) python=${2:?--python needs a value}; shift 2 ;;
  --step) step=${2:?--step needs a value}; shift 2 ;;
  --torch-flavour) flavour=${2:?--torch-flavour needs a value}; shift 2 ;;
  --extras) extras=${2:?--extras needs a value}; shift 2 ;;
  --editable) editable=1; shift ;;
  -h | --help) usage 0 ;;
  -*) echo "install: unknown option $1" >&2; usage ;;
  *) packages+=("$1"); shift ;;
  esac
done
[[ -n $python ]] || { echo "install: --python is required" >&2; usage; }
case $step in torch | package | all) ;; *) echo "install: --step must be torch, package or all" >&2; exit 2 ;; esac
case $flavour in cpu | cuda) ;; *) echo "install: --torch-flavour must be cpu or cuda" >&2; exit 2 ;; esac

# -qq: the machine-wide pip config of the dev machines names partial local indexes, which
# warn on every package.
pip=("$python" -m pip -qq --disable-pip-version-check)

if [[ $step == torch || $step == all ]]; then
  echo "install: torch $TORCH_VERSION ($flavour) into $python"
  "${pip[@]}" install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  if [[ $flavour == cuda ]] &&
    "$python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    # A local CPU wheel also satisfies ==$TORCH_VERSION (and sorts first: +cpu).
    echo "install: warning: a GPU is expected but torch is a CPU build;" \
      "reinstall with TORCH_INDEX_URL set to a CUDA index of download.pytorch.org" >&2
  fi
fi

if [[ $step == package || $step == all ]]; then
  target=.${extras:+[$extras]}
  # The editable install maps kernels/ and client/ into manylora through an import hook that
  # a .pth file registers. The Python backend stub runs site.py of the python3 first on PATH,
  # so the hook works there too (tests/e2e/test_launcher.py checks it). Don't use
  # editable_mode=compat: it only puts the repository root on sys.path and loses the mapping.
  if ((editable)); then
    echo "install: manylora (editable) ${extras:+with extras $extras }${packages[*]}"
    "${pip[@]}" install -e "$target" ${packages[@]+"${packages[@]}"}
  else
    echo "install: manylora ${extras:+with extras $extras }${packages[*]}"
    "${pip[@]}" install "$target" ${packages[@]+"${packages[@]}"}
  fi
  "$python" -c 'import numpy, sys; sys.exit(f"install: numpy {numpy.__version__} is 2.x; the Python backend stub needs numpy<2" if int(numpy.__version__.split(".")[0]) >= 2 else 0)'
fi
