"""Render the model repository the container serves: the committed one, with the gliner2
model's parameters and instance group taken from the environment.

The entrypoint runs this once per start, into a writable folder, and points tritonserver
at the copy. The committed config.pbtxt stays the single source of the inputs, outputs and
batching; only what a deployment sets changes:

    MANYLORA_CHECKPOINT          -> parameter checkpoint (absolute path)
    MANYLORA_ADAPTER_DIR         -> parameter adapter_dir; empty = no adapters (base model only)
    MANYLORA_PARAM_<KEY>=value   -> parameter <key>, e.g. MANYLORA_PARAM_MAX_GPU_ADAPTERS=64
    MANYLORA_GPUS                -> instance_group: "" keeps the committed one (one instance per
                                    visible GPU, CPU where none); "all" = KIND_GPU on every GPU;
                                    "0,1,3" = KIND_GPU on those device ids
    MANYLORA_INSTANCES_PER_GPU   -> count of that group (default 1); each instance is its own
                                    process with its own adapter cache

Parameter values are not checked here: the model checks every one strictly when it loads
(manylora.config), and an unknown key stops it with a message that names the key.

    python3 docker/render_config.py --source model_repository --out /tmp/manylora/model_repository
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

MODEL = "gliner2"
PARAM_PREFIX = "MANYLORA_PARAM_"


class RenderError(ValueError):
    """An environment variable the renderer cannot turn into config."""


def _gpu_ids(raw: str) -> list[int] | None:
    """None for "all", else the listed device ids."""
    if raw.strip() == "all":
        return None
    try:
        ids = [int(part, 10) for part in raw.split(",")]
    except ValueError:
        raise RenderError(f"MANYLORA_GPUS: expected 'all' or comma-separated device ids, got {raw!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise RenderError(f"MANYLORA_GPUS: device ids must be distinct and >= 0, got {raw!r}")
    return ids


def render_config(text: str, env: Mapping[str, str], model_dir: Path | None = None) -> str:
    """The config.pbtxt text with ``env``'s settings applied (comments are not kept).

    Relative checkpoint and adapter paths are made absolute from ``model_dir`` (the committed
    model folder), so they keep their meaning in the copy.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    parameters = {}
    if "MANYLORA_CHECKPOINT" in env:
        parameters["checkpoint"] = env["MANYLORA_CHECKPOINT"]
    if "MANYLORA_ADAPTER_DIR" in env:
        parameters["adapter_dir"] = env["MANYLORA_ADAPTER_DIR"]
    for name, value in env.items():
        if name.startswith(PARAM_PREFIX) and len(name) > len(PARAM_PREFIX):
            parameters[name[len(PARAM_PREFIX) :].lower()] = value
    for key, value in sorted(parameters.items()):
        if key == "adapter_dir" and not value:
            config.parameters.pop(key, None)
        else:
            config.parameters[key].string_value = value
    for key in ("checkpoint", "adapter_dir"):
        if model_dir is not None and key in config.parameters:
            path = Path(config.parameters[key].string_value)
            if not path.is_absolute():
                config.parameters[key].string_value = os.path.normpath(model_dir.resolve() / path)

    gpus = env.get("MANYLORA_GPUS", "").strip()
    count_raw = env.get("MANYLORA_INSTANCES_PER_GPU", "1")
    if not count_raw.isdigit() or int(count_raw) < 1:
        raise RenderError(f"MANYLORA_INSTANCES_PER_GPU: expected a positive integer, got {count_raw!r}")
    if gpus:
        ids = _gpu_ids(gpus)
        del config.instance_group[:]
        group = config.instance_group.add()
        group.count = int(count_raw)
        group.kind = model_config_pb2.ModelInstanceGroup.Kind.KIND_GPU
        if ids is not None:
            group.gpus.extend(ids)
    elif "MANYLORA_INSTANCES_PER_GPU" in env:
        for group in config.instance_group:
            group.count = int(count_raw)
    return text_format.MessageToString(config)


def render_repository(source: Path, out: Path, env: Mapping[str, str]) -> Path:
    """Copy ``source`` to ``out`` (replacing it) with the gliner2 config rendered."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("__pycache__"))
    config = out / MODEL / "config.pbtxt"
    config.write_text(render_config(config.read_text(), env, model_dir=source / MODEL))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the committed model repository")
    parser.add_argument("--out", type=Path, required=True, help="where to write the rendered copy")
    args = parser.parse_args(argv)
    try:
        out = render_repository(args.source, args.out, os.environ)
    except RenderError as err:
        print(f"render_config: {err}", file=sys.stderr)
        return 2
    print((out / MODEL / "config.pbtxt").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
