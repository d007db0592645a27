"""PEFT LoRA adapter folders: find them safely, read them strictly, refuse what we cannot apply exactly.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as
``PeftModel.save_pretrained`` writes them. Targets are read from the tensor keys
(``base_model.model.<module path>.lora_A.weight`` / ``lora_B.weight``): the config's
``target_modules`` may be shortened to suffixes. The scale of each module follows PEFT:
``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), with ``rank_pattern`` / ``alpha_pattern``
matched by PEFT's own pattern rule.

Nothing is ever unpickled: only safetensors is read, and a folder that holds only a
pickled ``adapter_model.bin`` is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

KEY_PREFIX = "base_model.model."
ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# PEFT LoRA variants whose update is not a plain scale * x A^T B^T on a linear layer
_UNSUPPORTED_OPTIONS = (
    "trainable_token_indices",
    "layer_replication",
    "fan_in_fan_out",
    "alora_invocation_tokens",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
    "use_qalora",
    "lora_ga_config",
)


class AdapterError(Exception):
    """An adapter that cannot be served; ``code`` is the Triton error code to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    modules: Mapping[str, LoraModule]  # module path (no base_model.model.) -> weights
    fingerprint: tuple  # (mtime_ns, size) of the weights file, to notice changes

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * 4 + m.b.numel() * 4 for m in self.modules.values())


def resolve_adapter_dir(root: Path, adapter_id: str) -> Path:
    """The folder of ``adapter_id`` under ``root``; NOT_FOUND / INVALID_ARG otherwise.

    Ids are plain names (letters, digits, '.', '_', '-'; no path separators, no '..'),
    and the resolved folder (symlinks followed) must stay inside the adapter root.
    """
    if not ADAPTER_ID.match(adapter_id) or ".." in adapter_id:
        shown = adapter_id if len(adapter_id) <= 80 else adapter_id[:80] + "..."
        raise AdapterError(
            "INVALID_ARG",
            f"invalid adapter id {shown!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    root = root.resolve()
    folder = (root / adapter_id).resolve()
    if folder.parent != root and root not in folder.parents:
        raise AdapterError("INVALID_ARG", f"adapter {adapter_id!r} resolves outside the adapter directory")
    if not folder.is_dir():
        raise AdapterError(
            "NOT_FOUND", f"unknown adapter {adapter_id!r}: no folder {adapter_id} in the adapter directory"
        )
    return folder


def weights_fingerprint(folder: Path) -> tuple:
    stat = (folder / WEIGHTS_FILE).stat()
    return (stat.st_mtime_ns, stat.st_size)


def load_adapter(name: str, folder: Path, shapes: Mapping[str, tuple[int, int]], max_rank: int) -> LoraAdapter:
    """Read and validate one adapter folder against the model's linears ``{path: (in, out)}``."""
    from peft.utils.other import get_pattern_key
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def refuse(why: str) -> AdapterError:
        return AdapterError("INVALID_ARG", f"adapter {name!r} cannot be served: {why}")

    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise refuse(f"{CONFIG_FILE} is missing")
    if not weights_path.is_file():
        pickled = (folder / "adapter_model.bin").exists()
        raise refuse(
            f"{WEIGHTS_FILE} is missing"
            + (" (adapter_model.bin is pickled and is never loaded; save with safe_serialization)" if pickled else "")
        )
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise refuse(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']} replaces whole modules per adapter")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse("trained biases (bias / lora_bias) are not supported")
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise refuse(f"{option} is not supported (the update would not be a plain x A^T B^T)")

    fingerprint = weights_fingerprint(folder)
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise refuse(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.match(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if match is None:
            if "lora_embedding" in key:
                raise refuse("LoRA on embeddings is not supported")
            if "lora_magnitude_vector" in key:
                raise refuse("DoRA magnitude vectors are not supported")
            raise refuse(f"unexpected tensor {key!r} (only lora_A / lora_B weights can be applied)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    if not pairs:
        raise refuse("it holds no LoRA weights")

    r_default, alpha_default = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    modules = {}
    for path, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"{path} has lora_{'A' if 'A' in pair else 'B'} without its partner")
        if path not in shapes:
            raise refuse(f"it targets {path!r}, which is not a linear layer of this checkpoint")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[path]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise refuse(
                f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a "
                f"{in_features}->{out_features} linear"
            )
        if rank > max_rank:
            raise refuse(f"{path} has rank {rank}, above max_lora_rank {max_rank}")
        r = int(rank_pattern.get(get_pattern_key(rank_pattern.keys(), path), r_default))
        if r != rank:
            raise refuse(f"{path}: config rank {r} does not match the weights' rank {rank}")
        alpha = float(alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), alpha_default))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise refuse(f"{path} holds NaN or infinite weights")
        modules[path] = LoraModule(a.float().contiguous(), b.float().contiguous(), scale)
    return LoraAdapter(name, folder, modules, fingerprint)
