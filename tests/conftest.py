"""Fixtures shared by every test folder: the tiny demo checkpoint and GLiNER2 itself."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from manylora.train_demo import pin_cpu_kernels

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the same vector kernels on every x86 host, set before torch runs an op: the trained demo's
# quality bars (tests/engine/test_demo.py) then hold on AVX-512 hosts too
CPU_KERNELS = pin_cpu_kernels()
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


def _trained_demo_dir(tmp_path_factory) -> Path:
    """Where the trained demo is built: models/.test-cache/trained-<key> (models/ is gitignored)
    when it can be written, so later sessions reuse it (training takes about 2 minutes), else
    the session's temp dir. The key covers everything the checkpoint depends on: the recipe, the
    training data and code, the builder and the library versions."""
    import hashlib
    import importlib.metadata
    import json
    from dataclasses import asdict

    from manylora import demo, train_demo

    root = Path(__file__).resolve().parents[1]
    sources = [Path(demo.__file__), Path(train_demo.__file__)]
    made_of = {  # the adapters beside it are rebuilt when what they were made from changes (demo_adapters.json)
        "recipe": asdict(train_demo.Recipe()),
        "data": train_demo.data_fingerprint(),
        "corpus": hashlib.sha256((demo.DATA_DIR / "corpus.txt").read_bytes()).hexdigest(),
        "sources": [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources],
        "versions": [importlib.metadata.version(d) for d in ("torch", "transformers", "gliner2", "peft")],
        "cpu_kernels": CPU_KERNELS,
    }
    key = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:16]
    folder = root / "models" / ".test-cache" / f"trained-{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return tmp_path_factory.mktemp("trained")
    for stale in folder.parent.glob("trained-*"):  # builds of older code or data: never used again
        if stale != folder and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return folder


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory) -> Path:
    """The trained tiny demo checkpoint (``python -m manylora.demo --train``), as `make demo` builds it."""
    from manylora.demo import build_demo_checkpoint

    return build_demo_checkpoint(_trained_demo_dir(tmp_path_factory) / "demo-tiny", size="tiny", train=True)


@pytest.fixture(scope="session")
def trained_adapters(trained_checkpoint) -> dict:
    """The trained demo adapters (LoRA fine-tunes with PEFT) of the trained checkpoint: name -> folder."""
    from manylora.lora.demo_adapters import build_trained_adapters

    return build_trained_adapters(trained_checkpoint, trained_checkpoint.parent / "demo-tiny-adapters")


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
