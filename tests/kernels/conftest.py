"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is defined, i.e. before
manylora.kernels.sgmv_* is imported; this conftest is loaded before the test modules.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: quick end-to-end check of a script (seconds)")


@pytest.fixture
def device() -> str:
    return DEVICE
