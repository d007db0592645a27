"""Fixtures shared by every test folder: the tiny demo checkpoint and GLiNER2 itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The embedded tiny demo checkpoint, built once per session (seconds)."""
    from manylora.demo import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("models") / "demo-tiny", size="tiny")


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint):
    """GLiNER2 itself on the tiny checkpoint: the reference for every fidelity test."""
    from gliner2 import GLiNER2

    model = GLiNER2.from_pretrained(str(tiny_checkpoint))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    from manylora.config import EngineConfig
    from manylora.engine import Engine

    return Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}))
