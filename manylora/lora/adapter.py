"""PEFT LoRA adapter folders: find them safely, read them strictly, refuse what we cannot apply exactly.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as
``PeftModel.save_pretrained`` writes them. Targets are read from the tensor keys
(``base_model.model.<module path>.lora_A.weight`` / ``lora_B.weight``): the config's
``target_modules`` may be shortened to suffixes. The scale of each module follows PEFT:
``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), with ``rank_pattern`` / ``alpha_pattern``
matched by PEFT's own pattern rule.

Nothing is ever unpickled: only safetensors is read, and a folder that holds only a
pickled ``adapter_model.bin`` is refused. The weights file is read into memory, never
memory-mapped: a file truncated in place while mapped (``cp`` over it) would kill the
process with SIGBUS. Every refusal is an ``AdapterError``; nothing else escapes.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch

KEY_PREFIX = "base_model.model."
ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: '$' would let a final newline in
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 1 << 20  # safetensors JSON header allowance on top of the tensors themselves
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
    fingerprint: tuple  # weights_fingerprint() when it was read, to notice changes
    # the store's host copy: every module in GPU-slot layout in one buffer (one host->GPU copy
    # per adapter), and the per-module scales in the store's module order
    packed: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    scale_vector: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

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
    if not ADAPTER_ID.fullmatch(adapter_id) or ".." in adapter_id:
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


def _file_key(status: os.stat_result) -> tuple:
    # inode and ctime too: a file renamed over another (atomic deploys) or copied with its
    # mtime kept (cp -p, rsync -t) still counts as changed
    return (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def weights_fingerprint(folder: Path) -> tuple:
    """What identifies the current content of an adapter folder (both files); OSError if one is gone."""
    return (_file_key((folder / CONFIG_FILE).stat()), _file_key((folder / WEIGHTS_FILE).stat()))


def max_weights_bytes(shapes: Mapping[str, tuple[int, int]], max_rank: int) -> int:
    """Largest weights file an adapter of this model can need: every linear at ``max_rank``, float64."""
    return 8 * max_rank * sum(i + o for i, o in shapes.values()) + MAX_HEADER_BYTES


def load_adapter(name: str, folder: Path, shapes: Mapping[str, tuple[int, int]], max_rank: int) -> LoraAdapter:
    """Read and validate one adapter folder against the model's linears ``{path: (in, out)}``.

    Raises AdapterError (INVALID_ARG: cannot be served; UNAVAILABLE: changed while read, retry).
    """
    from peft.utils.other import get_pattern_key
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    def refuse(why: str) -> AdapterError:
        return AdapterError("INVALID_ARG", f"adapter {name!r} cannot be served: {why}")

    def read(path: Path, limit: int, what: str) -> tuple[bytes, tuple]:
        """The whole file and its key, refusing what is not a regular file or is over ``limit``."""
        try:
            before = path.stat()
            if not stat.S_ISREG(before.st_mode):
                raise refuse(f"{what} is not a regular file")
            if before.st_size > limit:
                raise refuse(f"{what} is {before.st_size} bytes, above the limit of {limit}")
            with open(path, "rb") as f:
                data = f.read(limit + 1)
            after = path.stat()
        except OSError as exc:
            raise refuse(f"{what} cannot be read ({exc.strerror})") from None
        if _file_key(before) != _file_key(after) or len(data) != before.st_size:
            raise AdapterError("UNAVAILABLE", f"adapter {name!r} changed while it was read; retry")
        return data, _file_key(before)

    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.exists():
        raise refuse(f"{CONFIG_FILE} is missing")
    if not weights_path.exists():
        pickled = (folder / "adapter_model.bin").exists()
        raise refuse(
            f"{WEIGHTS_FILE} is missing"
            + (" (adapter_model.bin is pickled and is never loaded; save with safe_serialization)" if pickled else "")
        )
    config_bytes, config_key = read(config_path, MAX_CONFIG_BYTES, CONFIG_FILE)
    try:
        config = json.loads(config_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
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
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not _is_int(r_default) or not _is_number(alpha_default):
        raise refuse(f"r {r_default!r} / lora_alpha {alpha_default!r} must be an integer / a number")
    for label, pattern, check in (
        ("rank_pattern", rank_pattern, _is_int),
        ("alpha_pattern", alpha_pattern, _is_number),
    ):
        if not isinstance(pattern, dict) or not all(check(v) for v in pattern.values()):
            raise refuse(f"{label} must map module names to numbers")
        for key in pattern:
            try:
                re.compile(key)
            except re.error as exc:
                raise refuse(f"{label} key {key!r} is not a valid pattern ({exc})") from None
    rslora = bool(config.get("use_rslora", False))

    # the limit: what this model's linears at max_rank could need (a bigger file is not an adapter of it)
    data, weights_key = read(weights_path, max_weights_bytes(shapes, max_rank), WEIGHTS_FILE)
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise refuse(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    del data

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

    modules = {}
    for path, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"{path} has lora_{'A' if 'A' in pair else 'B'} without its partner")
        if path not in shapes:
            raise refuse(f"it targets {path!r}, which is not a linear layer of this checkpoint")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[path]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, a.shape[0]):
            raise refuse(
                f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a "
                f"{in_features}->{out_features} linear"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise refuse(f"{path}: lora_A / lora_B are {a.dtype} / {b.dtype}, not floating point")
        rank = a.shape[0]
        if rank < 1:
            raise refuse(f"{path} has rank 0")
        if rank > max_rank:
            raise refuse(f"{path} has rank {rank}, above max_lora_rank {max_rank}")
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), path), r_default)
        if r != rank:
            raise refuse(f"{path}: config rank {r} does not match the weights' rank {rank}")
        alpha = float(alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), alpha_default))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if not math.isfinite(scale):
            raise refuse(f"{path} has a scale that is not finite")
        # no copy for float32 files (PEFT's default): the tensors own the bytes read above
        modules[path] = LoraModule(a.float(), b.float(), scale)
    # one finiteness test for the whole file (per tensor, 168 of them cost ~20 ms per adapter);
    # the tensor-by-tensor search runs only when it fails, to name the culprit
    if not all_finite(torch.cat([t.reshape(-1) for m in modules.values() for t in (m.a, m.b)])):
        bad = next(p for p, m in modules.items() if not (all_finite(m.a) and all_finite(m.b)))
        raise refuse(f"{bad} holds NaN or infinite weights")
    return LoraAdapter(name, folder, modules, (config_key, weights_key))


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``: their float64 sum is finite exactly then (finite float32 values
    cannot overflow a float64 sum). Much faster than ``isfinite().all()`` on CPU torch, which matters
    with 168 tensors per adapter and 1,024 adapters preloaded per instance."""
    return math.isfinite(torch.sum(t, dtype=torch.float64).item())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
