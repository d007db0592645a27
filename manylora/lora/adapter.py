"""PEFT LoRA adapter folders: find them safely, read them strictly, refuse what we cannot apply exactly.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as
``PeftModel.save_pretrained`` writes them. Targets are read from the tensor keys
(``base_model.model.<module path>.lora_A.weight`` / ``lora_B.weight``): the config's
``target_modules`` may be shortened to suffixes. Of those, only the modules PEFT would apply from the
config (``target_modules``, ``layers_to_transform`` / ``layers_pattern``, ``exclude_modules``) are
kept; the others are listed in ``LoraAdapter.ignored``. The scale of each module follows PEFT:
``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), with ``rank_pattern`` / ``alpha_pattern``
matched by PEFT's own pattern rule.

Nothing is ever unpickled: only safetensors is read, and a folder that holds only a
pickled ``adapter_model.bin`` is refused. The weights file is read into memory, never
memory-mapped: a file truncated in place while mapped (``cp`` over it) would kill the
process with SIGBUS. Every refusal is an ``AdapterError``; nothing else escapes.

Adapter folders come from untrusted tenants: files are opened relative to the folder's descriptor,
never through a symlink and never blocking, and read from the descriptor checked to be a regular
file; config regexes are matched with bounded cost (``_Patterns``); the safetensors header is
bounded (size, dimensions, elements) before anything is allocated for it; messages say what is
wrong without quoting the files, at most MAX_MESSAGE_CHARS characters.

Speed: a fleet of 1,024 adapters of ~170 tensors each is read at every start-up, and one
torch op per tensor cost ~35 ms per adapter. The safetensors header is parsed here (with
the library's own checks: known dtypes, sizes that match shapes, tensors that tile the data
exactly), and a file in one 16- or 32-bit float dtype (every PEFT file) is used as read: the
modules are views of its bytes, converted by the store in one op for the whole adapter.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

import regex
import torch

try:  # Python >= 3.11
    from re import _constants as _re_constants
    from re import _parser as _re_parser
except ImportError:  # pragma: no cover
    import sre_constants as _re_constants
    import sre_parse as _re_parser

KEY_PREFIX = "base_model.model."
ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: '$' would let a final newline in
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 1 << 20  # safetensors JSON header allowance on top of the tensors themselves; its size limit
MAX_DIMS = 8  # dimensions of a safetensors tensor (a LoRA factor has 2)
MAX_ELEMENTS = 1 << 40  # elements of any tensor, whatever the model
MAX_MESSAGE_CHARS = 1000  # an AdapterError's message, at most
# regexes of adapter configs (target_modules, exclude_modules, layers_pattern, rank/alpha_pattern keys)
MAX_PATTERN_CHARS = 1000
MAX_PATTERNS = 1024
PATTERN_MATCH_SECONDS = 0.025  # one match; a module path against a sane pattern takes microseconds
PATTERN_BUDGET_SECONDS = 0.25  # every match of one adapter load
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LORA_KEY = re.compile(r"base_model\.model\.([^\n]+)\.lora_([AB])(?:\.[^.\n]+)?\.weight")  # fullmatch
_FIRST_LAYER = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")  # PEFT's layer index without layers_pattern
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
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
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
    # modules whose tensors the file holds but the config does not select (PEFT ignores them too)
    ignored: tuple[str, ...] = field(default=(), compare=False)

    @functools.cached_property  # read per row of every batch: computed once
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @functools.cached_property  # read per chunk: adapters of one layout share equal sets
    def module_names(self) -> frozenset:
        return frozenset(self.modules)

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

    # ids whose paths are kept, least recently used first out: only ids whose folder exists (unknown
    # ids cost nothing here), at most MAX_IDS of them and MAX_BYTES of path text
    MAX_IDS = 4096
    MAX_BYTES = 4 << 20

    def __init__(self, root: Path):
        # absolute, not normalised: ".." after a symlinked part of the root must follow the link,
        # and a root that is itself a symlink is followed anew on every call (atomic deploys)
        self.root = Path(root).absolute()
        self._paths: OrderedDict[str, tuple[str, Path, str, str]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # called from request and loader threads

    @staticmethod
    def _size(adapter_id: str, paths: tuple) -> int:
        return len(adapter_id) + 4 * len(paths[0]) + 2 * len(CONFIG_FILE) + 256  # strings, Path and entry overhead

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def __call__(self, adapter_id: str) -> tuple[Path, Optional[tuple]]:
        with self._lock:
            paths = self._paths.get(adapter_id)
            if paths is not None:
                self._paths.move_to_end(adapter_id)
        known = paths is not None
        if not known:
            _check_id(adapter_id)
            base = os.path.join(self.root, adapter_id)
            paths = (base, Path(base), os.path.join(base, CONFIG_FILE), os.path.join(base, WEIGHTS_FILE))
        base, folder, config, weights = paths
        try:
            mode = os.lstat(base).st_mode
        except OSError:
            if known:
                with self._lock:
                    if self._paths.pop(adapter_id, None) is not None:
                        self._bytes -= self._size(adapter_id, paths)
            raise _not_found(adapter_id) from None
        if not known:
            with self._lock:
                if adapter_id not in self._paths:
                    self._paths[adapter_id] = paths
                    self._bytes += self._size(adapter_id, paths)
                    while len(self._paths) > self.MAX_IDS or self._bytes > self.MAX_BYTES:
                        old_id, old = self._paths.popitem(last=False)
                        self._bytes -= self._size(old_id, old)
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


def load_adapter(
    name: str,
    folder: Path,
    shapes: Mapping[str, tuple[int, int]],
    max_rank: int,
    root: Optional[Path] = None,
) -> LoraAdapter:
    """Read and validate one adapter folder against the model's linears ``{path: (in, out)}``.

    With ``root``, the folder (symlinks followed) must lie inside it: checked on the opened
    directory, not on its path. The files are opened relative to that directory, never through a
    symlink, without blocking, and read from the descriptor checked to be a regular file.

    Raises AdapterError (INVALID_ARG: cannot be served; UNAVAILABLE: changed while read, retry).
    """

    def refuse(why: str) -> AdapterError:
        return AdapterError("INVALID_ARG", f"adapter {name!r} cannot be served: {why}")

    dir_fd = _open_folder(name, folder, root, refuse)
    try:
        return _load_from(name, folder, dir_fd, shapes, max_rank, refuse)
    finally:
        os.close(dir_fd)


def _open_folder(name: str, folder: Path, root: Optional[Path], refuse) -> int:
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise refuse(f"its folder cannot be opened ({exc.strerror})") from None
    if root is not None:
        try:
            # where the opened directory is (no path race): /proc/self/fd names it
            where = os.readlink(f"/proc/self/fd/{dir_fd}")
        except OSError:
            where = os.path.realpath(folder)
        top = os.path.realpath(root)
        if not where.startswith(top.rstrip("/") + "/"):
            os.close(dir_fd)
            raise AdapterError("INVALID_ARG", f"adapter {name!r} resolves outside the adapter directory")
    return dir_fd


def _open_in(dir_fd: int, file_name: str) -> int:
    """A descriptor of ``file_name`` in the directory ``dir_fd``: never through a symlink, never blocking
    (a FIFO or a device opens at once and is refused by its fstat)."""
    return os.open(file_name, _OPEN_FLAGS, dir_fd=dir_fd)


def _read_fd(fd: int, size: int) -> torch.Tensor:
    """Up to ``size`` bytes of ``fd`` from its start, as a uint8 tensor (a torch buffer: the
    weights are used where they were read)."""
    data = torch.empty(size, dtype=torch.uint8)
    view, done = memoryview(data.numpy()), 0
    while done < size:
        n = os.preadv(fd, [view[done:]], done)
        if n == 0:
            break
        done += n
    return data[:done]


def _load_from(name, folder, dir_fd, shapes, max_rank, refuse) -> LoraAdapter:
    def read(file_name: str, limit: int, what: str, header: bool = False) -> tuple[torch.Tensor, tuple]:
        """The whole file as uint8 and its key, refusing what is not a regular file or is over ``limit``."""
        try:
            fd = _open_in(dir_fd, file_name)
        except FileNotFoundError:
            missing = f"{what} is missing"
            if file_name == WEIGHTS_FILE and _exists_in(dir_fd, "adapter_model.bin"):
                missing += " (adapter_model.bin is pickled and is never loaded; save with safe_serialization)"
            raise refuse(missing) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refuse(
                    f"{what} is a symbolic link (adapter files must be regular files in their folder)"
                ) from None
            raise refuse(f"{what} cannot be opened ({exc.strerror})") from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise refuse(f"{what} is not a regular file")
            if before.st_size > limit:
                raise refuse(f"{what} is {before.st_size} bytes, above the limit of {limit}")
            if header:  # the safetensors header size, checked before the file is read whole
                prefix = os.pread(fd, 8, 0)
                if len(prefix) == 8:
                    declared = int.from_bytes(prefix, "little")
                    if declared > MAX_HEADER_BYTES:
                        raise refuse(
                            f"{what} is not a readable safetensors file (header of {declared} bytes, "
                            f"above the limit of {MAX_HEADER_BYTES})"
                        )
            # one byte more than expected, to notice a file that grew
            data = _read_fd(fd, before.st_size + 1)
            after = os.fstat(fd)
        except OSError as exc:
            raise refuse(f"{what} cannot be read ({exc.strerror})") from None
        finally:
            os.close(fd)
        if _file_key(before) != _file_key(after) or data.numel() != before.st_size:
            raise AdapterError("UNAVAILABLE", f"adapter {name!r} changed while it was read; retry")
        return data, _file_key(before)

    config_bytes, config_key = read(CONFIG_FILE, MAX_CONFIG_BYTES, CONFIG_FILE)
    if not _exists_in(dir_fd, WEIGHTS_FILE):  # said before the config's content is judged
        read(WEIGHTS_FILE, 0, WEIGHTS_FILE)  # raises: missing, a link, ...
    config = _json(config_bytes.numpy().tobytes(), lambda why: refuse(f"{CONFIG_FILE} is not valid JSON ({why})"))
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type is not LORA")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save replaces whole modules per adapter")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse("trained biases (bias / lora_bias) are not supported")
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise refuse(f"{option} is not supported (the update would not be a plain x A^T B^T)")
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not _is_int(r_default) or not _is_number(alpha_default):
        raise refuse(f"r ({_kind(r_default)}) / lora_alpha ({_kind(alpha_default)}) must be an integer / a number")
    patterns = _Patterns(refuse)
    for label, pattern, check in (
        ("rank_pattern", rank_pattern, _is_int),
        ("alpha_pattern", alpha_pattern, _is_number),
    ):
        if not isinstance(pattern, dict) or not all(check(v) for v in pattern.values()):
            raise refuse(f"{label} must map module names to numbers")
        patterns.add_keys(label, pattern)
    selection = _Selection(config, patterns, refuse)
    rslora = bool(config.get("use_rslora", False))

    # the limit: what this model's linears at max_rank could need (a bigger file is not an adapter of it)
    data, weights_key = read(WEIGHTS_FILE, max_weights_bytes(shapes, max_rank), WEIGHTS_FILE, header=True)
    # no tensor of a file within that limit can hold more elements than its bytes at 2 bytes
    # each (the narrowest float); a looser bound than the largest factor at max_rank, so that an
    # adapter of too high a rank is still refused by name below ("has rank 64, above ...")
    largest = max_weights_bytes(shapes, max_rank) // 2
    try:
        start, entries = _safetensors_header(data, max_elements=largest)
    except ValueError as exc:
        raise refuse(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None

    pairs: dict[str, dict[str, _Entry]] = {}
    for number, entry in enumerate(entries):
        match = _LORA_KEY.fullmatch(entry.key)
        if match is None:
            if "lora_embedding" in entry.key:
                raise refuse("LoRA on embeddings is not supported")
            if "lora_magnitude_vector" in entry.key:
                raise refuse("DoRA magnitude vectors are not supported")
            raise refuse(f"unexpected tensor #{number} (only lora_A / lora_B weights can be applied)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = entry
    if not pairs:
        raise refuse("it holds no LoRA weights")
    if not pairs.keys() <= shapes.keys():  # an adapter of another model, whatever its config selects
        raise refuse("it targets a module that is not a linear layer of this checkpoint")
    # the modules PEFT applies from this config (target_modules, layers, exclusions); the others'
    # tensors PEFT ignores, and so do we
    ignored = tuple(path for path in sorted(pairs) if not selection(path))
    for path in ignored:
        del pairs[path]
    if not pairs:
        raise refuse("its config selects none of the modules its weights are for (target_modules / layers)")

    scales = {}
    for path, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"{path} has lora_{'A' if 'A' in pair else 'B'} without its partner")
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
        r = rank_pattern.get(patterns.key("rank_pattern", path), r_default)
        if r != rank:
            raise refuse(f"{path}: config rank {r} does not match the weights' rank {rank}")
        alpha = float(alpha_pattern.get(patterns.key("alpha_pattern", path), alpha_default))
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
    # the module-by-module search runs only when it fails, to name the culprit (an ignored tensor's
    # values do not matter)
    if not all(map(math.isfinite, torch.aminmax(weights))):
        bad = next((p for p, m in modules.items() if not (all_finite(m.a) and all_finite(m.b))), None)
        if bad is not None:
            raise refuse(f"{bad} holds NaN or infinite weights")
    return LoraAdapter(
        name, folder, modules, (config_key, weights_key), weights=weights, offsets=offsets, ignored=ignored
    )


def _exists_in(dir_fd: int, file_name: str) -> bool:
    try:
        os.stat(file_name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _json(raw: bytes, refuse):
    """JSON of ``raw``; ``refuse(why)`` otherwise, saying what is wrong and never what the bytes are."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(f"not UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise refuse(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise refuse("nested too deeply") from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise refuse("a number too long to read") from None


def _kind(value) -> str:
    """What a JSON value is, without quoting it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


class _Patterns:
    """The regexes of one adapter config, matched as PEFT matches them (``re`` syntax and meaning),
    with bounded cost: at most MAX_PATTERN_CHARS characters and MAX_PATTERNS patterns, each match
    stopped after PATTERN_MATCH_SECONDS and all of them after PATTERN_BUDGET_SECONDS (the ``regex``
    package's timeouts: ``re`` cannot stop a catastrophic backtrack). A pattern that runs out of
    time refuses the adapter: PEFT itself would hang on it."""

    def __init__(self, refuse):
        self._refuse = refuse
        self._keys: dict[str, list[tuple[str, object]]] = {}
        self._count = 0
        self._deadline: Optional[float] = None  # set by the first match: compiling is bounded by the limits

    def compile(self, what: str, source: str):
        """``source`` compiled, refusing what ``re`` refuses (PEFT would fail) or what is too long."""
        self._count += 1
        if self._count > MAX_PATTERNS:
            raise self._refuse(f"its config holds more than {MAX_PATTERNS} patterns")
        if len(source) > MAX_PATTERN_CHARS:
            raise self._refuse(f"{what} is {len(source)} characters long, above the limit of {MAX_PATTERN_CHARS}")
        try:
            re.compile(source)
            nested = _nested_repeat(_re_parser.parse(source))
        except (re.error, RecursionError, OverflowError, ValueError) as exc:
            why = exc.msg if isinstance(exc, re.error) else "too complex"
            raise self._refuse(f"{what} is not a valid pattern ({why})") from None
        if nested:
            raise self._refuse(f"{what} nests repetitions, as in (a+)+, which can backtrack catastrophically")
        try:
            return regex.compile(source, regex.VERSION0)
        except Exception:  # noqa: BLE001 - re takes it, regex does not: not matchable with a deadline
            raise self._refuse(f"{what} cannot be matched with a bounded cost") from None

    def add_keys(self, label: str, pattern: Mapping[str, object]) -> None:
        # get_pattern_key: re.match(rf"(.*\.)?({key})$", module path), the first key that matches wins
        self._keys[label] = [
            (key, self.compile(f"{label} key #{k}", rf"(.*\.)?({key})$")) for k, key in enumerate(pattern)
        ]

    def key(self, label: str, path: str) -> str:
        """peft.utils.other.get_pattern_key(keys, path)."""
        for k, (key, compiled) in enumerate(self._keys[label]):
            if self.run(compiled.match, path, f"{label} key #{k}"):
                return key
        return path

    def run(self, method, text: str, what: str):
        if self._deadline is None:
            self._deadline = time.monotonic() + PATTERN_BUDGET_SECONDS
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._refuse(f"its config's patterns take more than {PATTERN_BUDGET_SECONDS:g} s to match")
        try:
            return method(text, timeout=min(left, PATTERN_MATCH_SECONDS))
        except TimeoutError:
            raise self._refuse(
                f"{what} takes more than {PATTERN_MATCH_SECONDS * 1000:g} ms to match a module name "
                "(catastrophic backtracking)"
            ) from None


def _nested_repeat(parsed, inside: bool = False) -> bool:
    """Whether a parsed ``re`` pattern repeats (more than once) something that itself repeats: the
    shape of exponential backtracking. Refused before any match; the timeouts catch the rest."""
    for op, arg in parsed:
        if op in (_re_constants.MAX_REPEAT, _re_constants.MIN_REPEAT, _re_constants.POSSESSIVE_REPEAT):
            low, high, body = arg
            many = high > 1
            if many and inside:
                return True
            if _nested_repeat(body, inside or many):
                return True
        elif op is _re_constants.SUBPATTERN:
            if _nested_repeat(arg[-1], inside):
                return True
        elif op is _re_constants.BRANCH:
            if any(_nested_repeat(branch, inside) for branch in arg[1]):
                return True
        elif op in (_re_constants.ASSERT, _re_constants.ASSERT_NOT):
            if _nested_repeat(arg[1], inside):
                return True
        elif op is _re_constants.ATOMIC_GROUP:
            if _nested_repeat(arg, inside):
                return True
        elif op is _re_constants.GROUPREF_EXISTS:
            if any(b is not None and _nested_repeat(b, inside) for b in arg[1:]):
                return True
    return False


class _Selection:
    """peft.tuners.tuners_utils.check_target_module_exists for a LoRA config, on module paths, with
    its regexes bounded by ``_Patterns``. ``target_modules`` absent (or "all-linear") selects every
    module of the file."""

    def __init__(self, config: dict, patterns: _Patterns, refuse):
        self._patterns = patterns
        self._exclude, self._exclude_re = self._names(config.get("exclude_modules"), "exclude_modules", refuse)
        target = config.get("target_modules")
        self._all = target is None or target == "all-linear"
        self._target, self._target_re = (None, None) if self._all else self._names(target, "target_modules", refuse)
        layers = config.get("layers_to_transform")
        if layers is not None and not (_is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
            raise refuse("layers_to_transform must be an integer or a list of integers")
        self._layers = None if layers is None or layers == [] else (set(layers) if isinstance(layers, list) else layers)
        pattern = config.get("layers_pattern")
        if isinstance(pattern, str):
            pattern = [pattern] if pattern else None  # PEFT: an empty layers_pattern is any layer
        if pattern is not None and not (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern)):
            raise refuse("layers_pattern must be a string or a list of strings")
        self._layers_re = [
            patterns.compile(f"layers_pattern #{k}", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
            for k, p in enumerate(pattern or ())
        ]

    def _names(self, value, label: str, refuse):
        """(names, None) for a list of names, (None, compiled) for a regex string, (None, None) if absent."""
        if value is None or value == []:
            return None, None
        if isinstance(value, str):
            return None, self._patterns.compile(label, value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return frozenset(value), None
        raise refuse(f"{label} must be a string or a list of strings")

    def __call__(self, key: str) -> bool:
        if self._exclude_re is not None:
            if self._patterns.run(self._exclude_re.fullmatch, key, "exclude_modules"):
                return False
        elif self._exclude is not None and (key in self._exclude or any(key.endswith(f".{e}") for e in self._exclude)):
            return False
        if self._all:
            return True
        if self._target_re is not None:
            return bool(self._patterns.run(self._target_re.fullmatch, key, "target_modules"))
        if key not in self._target:
            found = any(key.endswith(f".{t}") for t in self._target)
            if not found or self._layers is None:
                return found
            if not self._layers_re:
                match = _FIRST_LAYER.match(key)
            else:
                match = None
                for k, compiled in enumerate(self._layers_re):
                    match = self._patterns.run(compiled.match, key, f"layers_pattern #{k}")
                    if match is not None:
                        break
            if match is None or match.groupdict().get("idx") is None:
                return False
            index = int(match.group("idx"))
            return index == self._layers if isinstance(self._layers, int) else index in self._layers
        return True


class _Entry(NamedTuple):
    """One tensor of a safetensors file: ``begin`` / ``end`` are byte offsets in its data section."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _safetensors_header(data: torch.Tensor, max_elements: Optional[int] = None) -> tuple[int, list[_Entry]]:
    """Where the data section of a safetensors file starts, and its tensors in file order; ValueError
    saying why when it is not one. Checks what the safetensors library checks before it reads a tensor,
    and, before anything is allocated for a tensor, that the header is at most MAX_HEADER_BYTES and no
    tensor has more than MAX_DIMS dimensions or more than ``max_elements`` elements. Messages name
    tensors by their number in the header, never by what the file says."""
    if data.numel() < 8:
        raise ValueError("shorter than its 8-byte header size")
    size = int.from_bytes(data[:8].numpy().tobytes(), "little")
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"header of {size} bytes, above the limit of {MAX_HEADER_BYTES}")
    if size > data.numel() - 8:
        raise ValueError(f"header of {size} bytes is longer than the file")

    def bad_json(why: str) -> ValueError:
        return ValueError(f"header is not valid JSON ({why})")

    header = _json(data[8 : 8 + size].numpy().tobytes(), bad_json)
    if type(header) is not dict:
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings")
    entries = []
    for number, (key, info) in enumerate(header.items()):
        tensor = f"tensor #{number}"
        if type(info) is not dict or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{tensor} is not described by dtype, shape and data_offsets")
        dtype, shape, span = (
            _DTYPES.get(info["dtype"]) if type(info["dtype"]) is str else None,
            info["shape"],
            info["data_offsets"],
        )
        if dtype is None:
            raise ValueError(f"{tensor} has an unknown dtype")
        if type(shape) is not list:
            raise ValueError(f"{tensor} has an invalid shape")
        if len(shape) > MAX_DIMS:  # before looking at each: a header may declare 160,000 of them
            raise ValueError(f"{tensor} has {len(shape)} dimensions, more than {MAX_DIMS}")
        # type(n) is int: JSON true / 1.0 are no sizes
        if not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{tensor} has an invalid shape")
        elements = 1
        for n in shape:  # bounded at each step: no product of huge integers
            elements *= n
            if elements > MAX_ELEMENTS or (max_elements is not None and elements > max_elements):
                limit = MAX_ELEMENTS if max_elements is None else min(max_elements, MAX_ELEMENTS)
                raise ValueError(
                    f"{tensor} has more than {limit} elements, more than a file of this model's adapters holds"
                )
        if type(span) is not list or len(span) != 2 or type(span[0]) is not int or type(span[1]) is not int:
            raise ValueError(f"{tensor} has invalid data_offsets")
        if span[1] - span[0] != elements * dtype.itemsize:
            raise ValueError(f"{tensor}'s data_offsets do not hold a {dtype} tensor of shape {shape}")
        entries.append(_Entry(key, dtype, tuple(shape), span[0], span[1]))
    # the tensors tile the data section: no gap, no overlap, nothing after them
    entries.sort(key=lambda e: (e.begin, e.end))
    end = 0
    for entry in entries:
        if entry.begin != end:
            raise ValueError(f"a tensor starts at byte {entry.begin} of the data, not {end}")
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
