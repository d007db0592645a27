"""Fixtures shared by every test folder: the tiny demo checkpoint and GLiNER2 itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
try:  # Triton kernels run under the interpreter where there is no GPU (set before they are defined)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The embedded tiny demo checkpoint, built once per session (seconds)."""
    from manylora.demo import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("models") / "demo-tiny", size="tiny")


@pytest.fixture(scope="session")
def demo_adapters(tiny_checkpoint, tmp_path_factory) -> dict:
    """The demo adapters (made with PEFT itself) on the tiny checkpoint: name -> folder."""
    from manylora.lora.demo_adapters import build_demo_adapters

    return build_demo_adapters(tiny_checkpoint, tmp_path_factory.mktemp("adapters") / "demo-tiny-adapters")


@pytest.fixture(scope="session")
def peft_reference(tiny_checkpoint):
    """GLiNER2 + PEFT with one adapter alone (or none): the reference for adapter fidelity."""
    from gliner2 import GLiNER2
    from peft import PeftModel

    cache = {}

    def model_for(adapter_folder):
        key = str(adapter_folder) if adapter_folder else ""
        if key not in cache:
            model = GLiNER2.from_pretrained(str(tiny_checkpoint))
            if adapter_folder:
                PeftModel.from_pretrained(model, str(adapter_folder))
            cache[key] = model.eval()
        return cache[key]

    return model_for


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
