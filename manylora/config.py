"""Engine configuration: one typed, frozen object built strictly from Triton's model config.

Every config.pbtxt parameter arrives as a string. Each is parsed on its own; an unknown
key, a value that does not parse, or an unfilled ``${placeholder}`` stops the model from
loading with a message that names the key. Nothing falls back to a default silently.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PLACEHOLDER = re.compile(r"\$\{[^}]*\}")


class ConfigError(ValueError):
    """A config.pbtxt parameter is missing, unknown or malformed."""


def _positive_int(key: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"parameter {key!r}: expected a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"parameter {key!r}: expected a positive integer, got {raw!r}")
    return value


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(key: str, raw: str) -> str:
        if raw not in allowed:
            raise ConfigError(f"parameter {key!r}: expected one of {', '.join(allowed)}; got {raw!r}")
        return raw

    return parse


def _auto_or_positive_int(key: str, raw: str, what: str = "a positive integer") -> int:
    """'auto' (0: chosen by the device) or a positive integer."""
    if raw.strip() == "auto":
        return 0
    try:
        return _positive_int(key, raw.strip())
    except ConfigError:
        raise ConfigError(f"parameter {key!r}: expected 'auto' or {what}, got {raw!r}") from None


def _threads(key: str, raw: str) -> int:
    """'auto' (0: the host's cores shared by the instances) or a positive thread count."""
    return _auto_or_positive_int(key, raw, "a positive number of torch threads per instance")


def _preload(key: str, raw: str) -> str:
    names = [n.strip() for n in raw.split(",")]
    if raw.strip() != "all" and not all(names):
        raise ConfigError(f"parameter {key!r}: expected 'all' or a comma-separated list of adapter ids, got {raw!r}")
    return raw.strip()


def _control_dir(key: str, raw: str) -> str:
    if raw.strip() in ("auto", "none"):
        return raw.strip()
    return _path(key, raw)


def _model_name(key: str, raw: str) -> str:
    """'none' (run every stage in this instance) or the name of the GPU-stage model."""
    name = raw.strip()
    if name == "none":
        return ""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name):
        raise ConfigError(f"parameter {key!r}: expected 'none' or a Triton model name, got {raw!r}")
    return name


def _on_off(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"parameter {key!r}: expected 'on' or 'off', got {raw!r}")
    return value == "on"


def _fraction(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"parameter {key!r}: expected a number in (0, 1], got {raw!r}") from None
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"parameter {key!r}: expected a number in (0, 1], got {raw!r}")
    return value


def _count(key: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"parameter {key!r}: expected an integer >= 0, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"parameter {key!r}: expected an integer >= 0, got {raw!r}")
    return value


def _seconds(key: str, raw: str, zero: bool = False) -> float:
    """A finite number of seconds above 0 (or at least 0, with ``zero``)."""
    what = f"a number of seconds {'>=' if zero else '>'} 0"
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"parameter {key!r}: expected {what}, got {raw!r}") from None
    if not (0.0 <= value if zero else 0.0 < value) or value == float("inf"):
        raise ConfigError(f"parameter {key!r}: expected {what}, got {raw!r}")
    return value


def _path(key: str, raw: str) -> str:
    if not raw.strip():
        raise ConfigError(f"parameter {key!r}: empty path")
    return raw


# chunk_cost_tokens 'auto', by device type (EngineConfig.chunk_cost_tokens says why)
CHUNK_COST_TOKENS_AUTO = {"cuda": 32768, "cpu": 128}


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs; README.md has the same table for config.pbtxt users."""

    checkpoint: Path
    adapter_dir: Optional[Path] = None
    max_gpu_adapters: int = 32
    max_cpu_adapters: int = 128
    max_lora_rank: int = 64
    dtype: str = "auto"
    max_batch_tokens: int = 65536
    max_request_tokens: int = 4096
    kernel_backend: str = "auto"
    preload_adapters: str = ""
    control_dir: str = "auto"
    cpu_threads: int = 0  # 0 = auto
    core_model: str = ""  # "" = this instance runs pre, GPU stage and post itself
    # a front instance's batches in the GPU stage at once (1: execute() waits for it). 4 measured on the
    # H200 in session 13 (same call, 16 fronts, 1,024 adapters): at 70% of saturation p95 base 165 -> 83 ms,
    # LoRA 200 -> 139 ms. Not the default: when a front's stub dies, its batches in flight wait for the
    # model's reload instead of failing at once (Triton 2.51's Python backend does not fail the requests a
    # dead stub was answering through response senders; tests/e2e/test_soak_faults.py failed with it)
    front_inflight: int = 1
    core_overlap: bool = True  # GPU stage: parse and answer on their own threads (serving.CoreModelHandler)
    # GPU stage: the engine, its GPU thread and the adapter cache in a child process of their own
    # (manylora.core_process), so that Triton's parse and responses leave its interpreter lock. Off
    # until measured on a GPU (docs/architecture.md, session 26)
    core_process: bool = False
    gpu_memory_fraction: float = 0.9  # the GPU stage's allocator cap, a share of its GPU's memory
    cuda_graphs: bool = True  # GPU stage: replay the encoder forward as CUDA graphs (manylora.graphs)
    cuda_graph_warmup_rows: int = 16  # GPU stage: graphs captured at load for batches of up to this many rows
    # GPU stage: graphs only for forwards of up to this many padded tokens. 65536 (a whole default
    # token budget) since session 12: H200, 16 fronts, c=1,024, same call, 1,024 adapters 2,192 ->
    # 3,341 req/s against 16384 (perf/README.md): the GPU stage's one process launches less
    cuda_graph_max_tokens: int = 65536
    # GPU stage: the heads of entity-only chunks replayed as CUDA graphs (manylora.lora.head_graphs): one
    # replay instead of ~230 operations a chunk, each of which can hand the GPU thread's interpreter lock over
    cuda_graph_heads: bool = True
    chunk_pipeline: bool = True  # GPU stage: chunk k's host work while chunk k+1's forward runs (Engine._core_begin)
    # GPU stage: what one more chunk of a call is taken to cost, in padded tokens, when a call's rows are
    # cut into length-sorted chunks (Engine._budget_chunks): lower values cut more finely, with less
    # padding. 0 = auto: CHUNK_COST_TOKENS_AUTO by device type. Session 17: on the H200 in process
    # (perf/profile_core.py, interleaved) 2048 made a 110-row call 1.08x faster (LoRA; base 1.10x: 2
    # chunks, padding 34.5% -> 19.4%) and 1,024 rows 0.98x / 1.00x, but through the server (same call,
    # 32 fronts, 1,024 adapters) LoRA saturation fell 4,392 -> 3,616 req/s: more chunks cost the GPU
    # stage's one process host time, so 32768 stays there (session 3's estimate of a chunk's ~20-30 ms of
    # host time, perf/h200-2026-11-29/session3/profile-lora.txt). On the CPU (2-core host, profile_core,
    # interleaved, same answers) 128 served 128 rows of the tiny demo 2.8x and 48 rows of the base demo
    # 2.5x faster than 32768 (padding 27% -> 5-6%, smaller attention tensors); 32 and 8 were no faster
    chunk_cost_tokens: int = 0
    # GPU stage: span scores by kernels/spanscores.py (triton backend only). On since session 12:
    # H200, same call, with the 65536 graph cap: base 4,271 -> 5,025 req/s, 1,024 adapters 3,341 ->
    # 3,719; in process the same rows (0 of 1,024 differ)
    fused_span_scores: bool = True
    # GPU stage: DeBERTa's attention by kernels/disattn.py (triton backend only). On since session 13:
    # H200, same call, tree of 88ad5fc, 16 fronts, c=1,024: base 5,132 -> 5,599 req/s, 1,024 adapters
    # 4,027 -> 4,179; LoRA p95 at 70% of saturation 302 -> 166 ms (perf/README.md, session 13)
    fused_attention: bool = True
    # GPU stage: DeBERTa's residual adds and GELU inside the LoRA expand of batches whose every row
    # has an adapter (LoraBatch.fuses_epilogue): a [tokens, 3,072] and two [tokens, 768] read-and-write
    # passes fewer per layer. On since session 14: H200, perf/profile_core.py, 1,024 adapters,
    # interleaved on the same engine: 1,024 rows 215.4 -> 209.6 ms (1.03x), 96 rows 1.02x, the same rows
    fused_lora_epilogue: bool = True
    # GPU stage: the LoRA shrinks and expands (epilogues included) skip each row's padding, where the
    # attention kernel runs (fused_attention: it never reads a key or value past a row's length, and every
    # other step is token-local). Off: not yet measured on a GPU (docs/architecture.md, session 25)
    lora_skip_padding: bool = False
    adapter_load_timeout: float = 10.0  # seconds a batch waits for one adapter's disk load
    # GPU stage (core_overlap on): its metrics are published at most this often, after the answers. Every
    # call published them before its answers until session 19: ~35 messages to the Triton process, ~2 ms
    # of each call under load on the H200 (manylora_core_phase_seconds_total{phase="publish"})
    metrics_interval: float = 0.25
    # pipeline front: seconds one batch waits for the GPU stage's answer. Without it a GPU-stage
    # stub that dies holding batches leaves the fronts waiting forever (seen on the CPU: every
    # client of a killed gliner2_core stub waited out its own deadline; manylora.serving.CallDeadline).
    # 20: above adapter_load_timeout (10), below the committed queue timeout (30 s), so that the
    # requests queued behind a blocked front are answered before they expire
    core_timeout: float = 20.0
    device: str = "cpu"

    # key -> (parser, mandatory, help); the README table is generated from the same facts
    PARAMETERS = {
        "checkpoint": (_path, True, "GLiNER2 checkpoint directory (relative paths: from the model's folder)"),
        "adapter_dir": (_path, False, "folder of PEFT LoRA adapter folders; ADAPTER_ID names a subfolder"),
        "max_gpu_adapters": (_positive_int, False, "adapters resident in GPU slots (default 32)"),
        "max_cpu_adapters": (_positive_int, False, "parsed adapters kept in host memory (default 128; >= GPU slots)"),
        "max_lora_rank": (
            _positive_int,
            False,
            "largest adapter rank accepted; GPU slots are sized for it (default 64)",
        ),
        "dtype": (_choice("auto", *DTYPES), False, "auto = bfloat16 on GPU, float32 on CPU"),
        "max_batch_tokens": (_positive_int, False, "token budget of one encoder forward; larger batches are split"),
        "max_request_tokens": (
            _positive_int,
            False,
            "longest request (schema + text tokens) accepted; longer ones get INVALID_ARG",
        ),
        "kernel_backend": (
            _choice("auto", "triton", "torch"),
            False,
            "SGMV kernels: auto = triton on GPU, torch (float32 reference) on CPU",
        ),
        "preload_adapters": (
            _preload,
            False,
            "adapters loaded at model load: 'all' (as many as the tiers hold) or a comma list",
        ),
        "cpu_threads": (
            _threads,
            False,
            "torch CPU threads of each instance: auto = the host's cores / instances on it, or a count",
        ),
        "control_dir": (
            _control_dir,
            False,
            "folder where the manylora_control model meets this model's instances: 'auto' (one per "
            "tritonserver, under the temp folder), 'none' (no adapter control) or a path",
        ),
        "front_inflight": (
            _positive_int,
            False,
            "pipeline front (gliner2 with core_model): batches one instance may have in the GPU stage at once. "
            "1 (default): execute() calls the GPU stage and waits for it; N > 1: execute() prepares its batch, "
            "hands the call and the decoding to one of N threads and takes the next batch (answers go through "
            "the requests' response senders; with N in flight, execute() waits for one to finish)",
        ),
        "core_model": (
            _model_name,
            False,
            "the GPU-stage model this CPU front sends its batches to (BLS), e.g. gliner2_core; "
            "'none' (default) = this instance runs every stage itself",
        ),
        "gpu_memory_fraction": (
            _fraction,
            False,
            "share of its GPU's memory the GPU stage may allocate (default 0.9); weights, adapter slots and "
            "one token budget's activations must fit in it, or the model refuses to load",
        ),
        "cuda_graph_warmup_rows": (
            _count,
            False,
            "GPU stage: CUDA graphs captured at load for every batch of up to this many rows (default 16), for "
            "base rows and each preloaded adapters' module set; larger shapes are captured on first use; 0 = none",
        ),
        "cuda_graph_max_tokens": (
            _positive_int,
            False,
            "GPU stage: CUDA graphs only for encoder forwards of up to this many padded tokens (default 65536, "
            "at most max_batch_tokens); larger forwards launch every kernel",
        ),
        "chunk_pipeline": (
            _on_off,
            False,
            "GPU stage: 'on' (default) finishes each chunk on the host while the next chunk's forward runs on "
            "the GPU; 'off' runs each chunk's steps in turn (for A/B runs)",
        ),
        "chunk_cost_tokens": (
            _auto_or_positive_int,
            False,
            "GPU stage: what one more chunk is taken to cost, in padded tokens, when a call's rows (sorted by "
            "length) are cut into encoder forwards; lower values cut more finely and pad less. 'auto' (default): "
            "32768 on a GPU, 128 on the CPU",
        ),
        "fused_span_scores": (
            _on_off,
            False,
            "GPU stage with the triton backend: 'on' scores spans with one kernel that never builds GLiNER2's "
            "[rows, words, max_width, 4 x hidden] span tensor (default; checked against GLiNER2's head at load); "
            "'off' runs GLiNER2's own span head",
        ),
        "fused_attention": (
            _on_off,
            False,
            "GPU stage with the triton backend: 'on' runs DeBERTa's disentangled attention in one kernel "
            "(kernels/disattn.py: no [rows, heads, L, L] bias tensor, padding keys skipped; checked against "
            "the eager attention at load; default); 'off' writes the bias and runs "
            "scaled_dot_product_attention",
        ),
        "fused_lora_epilogue": (
            _on_off,
            False,
            "GPU stage: 'on' adds DeBERTa's residuals and applies its GELU inside the LoRA expand kernel of "
            "batches whose every row has an adapter (the same roundings as the separate passes; default); "
            "'off' runs them as their own passes",
        ),
        "lora_skip_padding": (
            _on_off,
            False,
            "GPU stage: 'on' lets the LoRA kernels skip each row's padding tokens where fused_attention runs "
            "(padding then holds values no real token reads); 'off' (default) computes them",
        ),
        "core_timeout": (
            _seconds,
            False,
            "pipeline front (gliner2 with core_model): seconds one batch waits for the GPU stage's answer "
            "(default 20); past it the batch's requests get UNAVAILABLE. While 4 x front_inflight calls of an "
            "instance are past their deadline (a frozen GPU stage), its next batches get UNAVAILABLE at once, "
            "but for one probe call per deadline; any call answered in time starts the count again",
        ),
        "adapter_load_timeout": (
            _seconds,
            False,
            "seconds a batch waits for one adapter's load from disk (default 10); past it the requests "
            "for that adapter get UNAVAILABLE, the load goes on, and later requests use it",
        ),
        "metrics_interval": (
            lambda key, raw: _seconds(key, raw, zero=True),
            False,
            "GPU stage (core_overlap on): seconds between two publishes of its metrics (default 0.25), "
            "made after the answers of the calls they cover and when it goes idle; 0 publishes after every call",
        ),
        "cuda_graphs": (
            _on_off,
            False,
            "GPU stage: 'on' (default) replays the encoder forward of each batch shape as a CUDA graph "
            "(captured on first use; one launch instead of ~300); 'off' launches every encoder kernel (for A/B runs; the heads' graphs are cuda_graph_heads)",
        ),
        "cuda_graph_heads": (
            _on_off,
            False,
            "GPU stage: 'on' (default) replays the heads of chunks whose span tasks are all entity tasks as CUDA "
            "graphs (captured on first use; one replay instead of ~230 launches); 'off' launches them (for A/B runs)",
        ),
        "core_overlap": (
            _on_off,
            False,
            "GPU stage (decoupled): 'on' (default) parses the next batches and answers the last ones on "
            "their own threads while one runs on the GPU; 'off' runs each batch in turn (for A/B runs)",
        ),
        "core_process": (
            _on_off,
            False,
            "GPU stage: 'on' runs the engine, its GPU thread and the adapter cache in a child process, away from "
            "the interpreter lock of Triton's request parsing and responses (the overlap always on there); a "
            "worker that exits fails its requests in flight UNAVAILABLE and is started again. 'off' (default): "
            "one process; not yet measured on a GPU",
        ),
    }

    @property
    def backend(self) -> str:
        if self.kernel_backend == "auto":
            return "triton" if self.device.startswith("cuda") else "torch"
        return self.kernel_backend

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]

    def chunk_cost(self, device_type: str) -> int:
        """``chunk_cost_tokens`` for a device type, 'auto' resolved (CHUNK_COST_TOKENS_AUTO; other
        accelerators take the GPU's)."""
        return self.chunk_cost_tokens or CHUNK_COST_TOKENS_AUTO.get(device_type, CHUNK_COST_TOKENS_AUTO["cuda"])

    @classmethod
    def from_parameters(
        cls, parameters: Mapping[str, str], *, model_dir: Optional[Path] = None, device: str = "cpu"
    ) -> "EngineConfig":
        unknown = sorted(set(parameters) - set(cls.PARAMETERS))
        if unknown:
            raise ConfigError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))}; known: {', '.join(cls.PARAMETERS)}"
            )
        values: dict[str, Any] = {"device": device}
        for key, (parse, mandatory, _) in cls.PARAMETERS.items():
            if key not in parameters:
                if mandatory:
                    raise ConfigError(f"parameter {key!r} is mandatory")
                continue
            raw = parameters[key]
            if not isinstance(raw, str):
                raise ConfigError(f"parameter {key!r}: expected a string value, got {type(raw).__name__}")
            if _PLACEHOLDER.search(raw):
                raise ConfigError(f"parameter {key!r} holds an unfilled template {raw!r}")
            values[key] = parse(key, raw)
        for key in ("checkpoint", "adapter_dir"):
            if key in values:
                path = Path(os.path.expanduser(values[key]))
                if not path.is_absolute() and model_dir is not None:
                    path = (Path(model_dir) / path).resolve()
                values[key] = path
        control_dir = values.get("control_dir")
        if control_dir not in (None, "auto", "none"):
            path = Path(os.path.expanduser(control_dir))
            if not path.is_absolute() and model_dir is not None:
                path = (Path(model_dir) / path).resolve()
            values["control_dir"] = str(path)
        checkpoint = values["checkpoint"]
        if "adapter_dir" in values and not values["adapter_dir"].is_dir():
            raise ConfigError(f"parameter 'adapter_dir': {values['adapter_dir']} is not a directory")
        if values.get("preload_adapters") and "adapter_dir" not in values:
            raise ConfigError("parameter 'preload_adapters' needs 'adapter_dir'")
        if values.get("max_cpu_adapters", 128) < values.get("max_gpu_adapters", 32):
            raise ConfigError("parameter 'max_cpu_adapters' must be >= 'max_gpu_adapters'")
        if not (checkpoint / "config.json").is_file():
            raise ConfigError(f"parameter 'checkpoint': {checkpoint} has no config.json (not a GLiNER2 checkpoint)")
        if values.get("dtype") in ("bfloat16", "float16") and not device.startswith("cuda"):
            raise ConfigError(f"parameter 'dtype': {values['dtype']} needs a GPU instance; this one runs on {device}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_model_config(
        cls, model_config: str | Mapping, *, model_dir: Optional[Path] = None, device: str = "cpu"
    ) -> "EngineConfig":
        """Build from Triton's ``args["model_config"]`` (JSON text or its parsed dict)."""
        if isinstance(model_config, str):
            model_config = json.loads(model_config)
        raw = model_config.get("parameters", {}) or {}
        parameters = {}
        for key, value in raw.items():
            if not isinstance(value, Mapping) or "string_value" not in value:
                raise ConfigError(f"parameter {key!r}: expected {{string_value: ...}}, got {value!r}")
            parameters[key] = value["string_value"]
        return cls.from_parameters(parameters, model_dir=model_dir, device=device)
