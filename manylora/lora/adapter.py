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

Speed: a fleet of 1,024 adapters of ~170 tensors each is read at every start-up, and one
torch op per tensor cost ~35 ms per adapter. The safetensors header is parsed here (with
the library's own checks: known dtypes, sizes that match shapes, tensors that tile the data
exactly), and a file in one 16- or 32-bit float dtype (every PEFT file) is used as read: the
modules are views of its bytes, converted by the store in one op for the whole adapter.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

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


# safetensors dtype names -> torch dtypes (the library's table; torch names appear in refusals)
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


class AdapterError(Exception):
    """An adapter that cannot be served; ``code`` is the Triton error code to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # [r, in]: the file's dtype from load_adapter (see _flat_weights), the serving dtype once packed
    b: torch.Tensor  # [out, r]
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
    # load_adapter's result: every module's A and B in one flat tensor, of which ``modules`` are views,
    # and module -> (A, B) element offsets in it, so the store converts and packs it whole
    weights: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    offsets: Optional[Mapping[str, tuple[int, int]]] = field(default=None, compare=False, repr=False)

    @functools.cached_property  # read per row of every batch: computed once
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def _check_id(adapter_id: str) -> None:
    if not ADAPTER_ID.fullmatch(adapter_id) or ".." in adapter_id:
        shown = adapter_id if len(adapter_id) <= 80 else adapter_id[:80] + "..."
        raise AdapterError(
            "INVALID_ARG",
            f"invalid adapter id {shown!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )


def _not_found(adapter_id: str) -> AdapterError:
    return AdapterError("NOT_FOUND", f"unknown adapter {adapter_id!r}: no folder {adapter_id} in the adapter directory")


def resolve_adapter_dir(root: Path, adapter_id: str) -> Path:
    """The folder of ``adapter_id`` under ``root``; NOT_FOUND / INVALID_ARG otherwise.

    Ids are plain names (letters, digits, '.', '_', '-'; no path separators, no '..'),
    and the resolved folder (symlinks followed) must stay inside the adapter root.
    """
    _check_id(adapter_id)
    try:
        root = root.resolve()
        folder = (root / adapter_id).resolve()
    except (RuntimeError, OSError):  # a symlink loop (RuntimeError before Python 3.13)
        raise _not_found(adapter_id) from None
    if folder.parent != root and root not in folder.parents:
        raise AdapterError("INVALID_ARG", f"adapter {adapter_id!r} resolves outside the adapter directory")
    if not folder.is_dir():
        raise _not_found(adapter_id)
    return folder


class AdapterLocator:
    """``(folder, weights_fingerprint(folder))`` of an adapter id, checked on every request.

    The same answers as ``resolve_adapter_dir`` + ``weights_fingerprint`` in three ``stat``
    calls: an id's paths are built once, and a folder that is no symlink is a direct child of
    the root by the id's syntax, so only symlinked ones take the full resolve (staying inside
    the root). The fingerprint is None when a file is missing (the load says which).
    """

    MAX_IDS = 1 << 16  # ids whose paths are kept (each a few hundred bytes)

    def __init__(self, root: Path):
        # absolute, not normalised: ".." after a symlinked part of the root must follow the link,
        # and a root that is itself a symlink is followed anew on every call (atomic deploys)
        self.root = Path(root).absolute()
        self._paths: dict[str, tuple[str, Path, str, str]] = {}

    def __call__(self, adapter_id: str) -> tuple[Path, Optional[tuple]]:
        paths = self._paths.get(adapter_id)
        if paths is None:
            _check_id(adapter_id)
            base = os.path.join(self.root, adapter_id)
            paths = (base, Path(base), os.path.join(base, CONFIG_FILE), os.path.join(base, WEIGHTS_FILE))
            if len(self._paths) < self.MAX_IDS:
                self._paths[adapter_id] = paths
        base, folder, config, weights = paths
        try:
            mode = os.lstat(base).st_mode
        except OSError:
            raise _not_found(adapter_id) from None
        if stat.S_ISLNK(mode):
            folder = resolve_adapter_dir(self.root, adapter_id)
            config, weights = str(folder / CONFIG_FILE), str(folder / WEIGHTS_FILE)
        elif not stat.S_ISDIR(mode):
            raise _not_found(adapter_id)
        try:
            return folder, (_file_key(os.stat(config)), _file_key(os.stat(weights)))
        except OSError:
            return folder, None


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

    def refuse(why: str) -> AdapterError:
        return AdapterError("INVALID_ARG", f"adapter {name!r} cannot be served: {why}")

    def read(path: Path, limit: int, what: str) -> tuple[torch.Tensor, tuple]:
        """The whole file as uint8 and its key, refusing what is not a regular file or is over ``limit``."""
        try:
            before = path.stat()
            if not stat.S_ISREG(before.st_mode):
                raise refuse(f"{what} is not a regular file")
            if before.st_size > limit:
                raise refuse(f"{what} is {before.st_size} bytes, above the limit of {limit}")
            # one byte more than expected, to notice a file that grew; a torch buffer so that the
            # weights are used where they were read
            data = torch.empty(before.st_size + 1, dtype=torch.uint8)
            with open(path, "rb") as f:
                size = f.readinto(data.numpy())
            after = path.stat()
        except OSError as exc:
            raise refuse(f"{what} cannot be read ({exc.strerror})") from None
        if _file_key(before) != _file_key(after) or size != before.st_size:
            raise AdapterError("UNAVAILABLE", f"adapter {name!r} changed while it was read; retry")
        return data[:size], _file_key(before)

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
        config = json.loads(config_bytes.numpy().tobytes().decode("utf-8"))
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
        start, entries = _safetensors_header(data)
    except ValueError as exc:
        raise refuse(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None

    pairs: dict[str, dict[str, _Entry]] = {}
    for entry in entries:
        key = entry.key
        match = re.match(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if match is None:
            if "lora_embedding" in key:
                raise refuse("LoRA on embeddings is not supported")
            if "lora_magnitude_vector" in key:
                raise refuse("DoRA magnitude vectors are not supported")
            raise refuse(f"unexpected tensor {key!r} (only lora_A / lora_B weights can be applied)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = entry
    if not pairs:
        raise refuse("it holds no LoRA weights")

    scales = {}
    for path, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"{path} has lora_{'A' if 'A' in pair else 'B'} without its partner")
        if path not in shapes:
            raise refuse(f"it targets {path!r}, which is not a linear layer of this checkpoint")
        a, b = pair["A"].shape, pair["B"].shape
        in_features, out_features = shapes[path]
        if len(a) != 2 or len(b) != 2 or a[1] != in_features or b != (out_features, a[0]):
            raise refuse(f"{path}: lora_A {a} / lora_B {b} do not fit a {in_features}->{out_features} linear")
        dtype_a, dtype_b = pair["A"].dtype, pair["B"].dtype
        if not (dtype_a.is_floating_point and dtype_b.is_floating_point):
            raise refuse(f"{path}: lora_A / lora_B are {dtype_a} / {dtype_b}, not floating point")
        rank = a[0]
        if rank < 1:
            raise refuse(f"{path} has rank 0")
        if rank > max_rank:
            raise refuse(f"{path} has rank {rank}, above max_lora_rank {max_rank}")
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), path), r_default)
        if r != rank:
            raise refuse(f"{path}: config rank {r} does not match the weights' rank {rank}")
        alpha = float(alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), alpha_default))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        scales[path] = scale  # finite: alpha is a finite number (checked above) and r >= 1

    weights, element = _flat_weights(data, start, entries)
    offsets, modules = {}, {}
    for path, scale in scales.items():
        (rank, in_features), (out_features, _) = pairs[path]["A"].shape, pairs[path]["B"].shape
        oa, ob = element[pairs[path]["A"].key], element[pairs[path]["B"].key]
        offsets[path] = (oa, ob)
        a = weights.as_strided((rank, in_features), (in_features, 1), weights.storage_offset() + oa)
        b = weights.as_strided((out_features, rank), (rank, 1), weights.storage_offset() + ob)
        modules[path] = LoraModule(a, b, scale)
    # one finiteness test for the whole file (NaN propagates to the extremes, an infinity is one);
    # the module-by-module search runs only when it fails, to name the culprit
    if not all(map(math.isfinite, torch.aminmax(weights))):
        bad = next(p for p, m in modules.items() if not (all_finite(m.a) and all_finite(m.b)))
        raise refuse(f"{bad} holds NaN or infinite weights")
    return LoraAdapter(name, folder, modules, (config_key, weights_key), weights=weights, offsets=offsets)


class _Entry(NamedTuple):
    """One tensor of a safetensors file: ``begin`` / ``end`` are byte offsets in its data section."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _safetensors_header(data: torch.Tensor) -> tuple[int, list[_Entry]]:
    """Where the data section of a safetensors file starts, and its tensors in file order; ValueError
    saying why when it is not one. Checks what the safetensors library checks before it reads a tensor."""
    if data.numel() < 8:
        raise ValueError("shorter than its 8-byte header size")
    size = int.from_bytes(data[:8].numpy().tobytes(), "little")
    if size > data.numel() - 8:
        raise ValueError(f"header of {size} bytes is longer than the file")
    try:
        header = json.loads(data[8 : 8 + size].numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"header is not valid JSON: {exc}") from None
    if type(header) is not dict:
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings")
    entries = []
    for key, info in header.items():
        if type(info) is not dict or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{key!r} is not described by dtype, shape and data_offsets")
        dtype, shape, span = _DTYPES.get(str(info["dtype"])), info["shape"], info["data_offsets"]
        if dtype is None:
            raise ValueError(f"{key!r} has an unknown dtype {info['dtype']!r}")
        # type(n) is int: JSON true / 1.0 are no sizes
        if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{key!r} has an invalid shape {shape!r}")
        if type(span) is not list or len(span) != 2 or type(span[0]) is not int or type(span[1]) is not int:
            raise ValueError(f"{key!r} has invalid data_offsets {span!r}")
        if span[1] - span[0] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{key!r} data_offsets {span} do not hold a {info['dtype']} tensor of shape {shape}")
        entries.append(_Entry(key, dtype, tuple(shape), span[0], span[1]))
    # the tensors tile the data section: no gap, no overlap, nothing after them
    entries.sort(key=lambda e: (e.begin, e.end))
    end = 0
    for entry in entries:
        if entry.begin != end:
            raise ValueError(f"{entry.key!r} starts at byte {entry.begin} of the data, not {end}")
        end = entry.end
    if 8 + size + end != data.numel():
        raise ValueError(f"the tensors take {end} bytes, the data section holds {data.numel() - 8 - size}")
    return 8 + size, entries


def _flat_weights(data: torch.Tensor, start: int, entries: list[_Entry]) -> tuple[torch.Tensor, dict[str, int]]:
    """Every tensor of the file (``entries`` in file order) back to back, and key -> element offset in it.

    A file in one dtype that float32 holds exactly (float32, float16, bfloat16: every PEFT file)
    stays in it, uncopied: the store converts it once, to its serving dtype, rounding each value
    as from its float32 value. Other files become float32 (one conversion per run of same-dtype
    tensors), rounded as ``Tensor.float()`` rounds: converting float64 straight to a 16-bit
    dtype would round twice differently."""
    runs: list[list[_Entry]] = []
    for entry in entries:
        if runs and runs[-1][0].dtype == entry.dtype:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    element, total = {}, 0
    for entry in entries:
        element[entry.key] = total
        total += math.prod(entry.shape)

    def typed(run: list[_Entry]) -> torch.Tensor:
        raw = data[start + run[0].begin : start + run[-1].end]
        if (start + run[0].begin) % run[0].dtype.itemsize:  # a misaligned tensor: an aligned copy
            raw = raw.clone()
        return raw.view(run[0].dtype)

    if len(runs) == 1 and runs[0][0].dtype in (torch.float32, torch.float16, torch.bfloat16):
        return typed(runs[0]), element
    weights = torch.empty(total, dtype=torch.float32)
    for run in runs:
        begin = element[run[0].key]
        weights[begin : begin + (run[-1].end - run[0].begin) // run[0].dtype.itemsize].copy_(typed(run))
    return weights, element


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``: their float64 sum is finite exactly then (finite float32 values
    cannot overflow a float64 sum). Much faster than ``isfinite().all()`` on CPU torch, which matters
    with 168 tensors per adapter and 1,024 adapters preloaded per instance."""
    return math.isfinite(torch.sum(t, dtype=torch.float64).item())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # a JSON integer too large for any float
        return False
