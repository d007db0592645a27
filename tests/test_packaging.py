"""The package's commands run from the repository root, as the Makefile runs them.

There, ``sys.path[0]`` is the root, so ``import kernels`` finds this repository's kernels/
folder before any distribution of that name. transformers 5.25 requires the PyPI ``kernels``
distribution and imports it at start-up, which then fails (pyproject.toml pins below it)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gliner2_and_the_engine_import_from_the_repository_root():
    code = "import gliner2, transformers.modeling_utils, manylora.engine; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
