"""Render the model repository the container serves: the committed one, with the pipeline's
parameters and instance groups taken from the environment.

The committed repository is a pipeline: ``gliner2``, the public model, is a CPU front
(pre- and post-processing, ``count`` instances of ``KIND_CPU``) that sends every batch's rows
by BLS to ``gliner2_core``, the GPU stage, which holds every engine parameter and the only
adapter cache of its GPU. ``manylora_control`` reaches the gliner2_core instances.

The entrypoint runs this once per start, into a writable folder, and points tritonserver
at the copy. The committed config.pbtxt files stay the single source of the inputs, outputs
and batching; only what a deployment sets changes:

    MANYLORA_CHECKPOINT          -> parameter checkpoint of gliner2 (tokenizer and decoding
                                    settings) and of gliner2_core (the weights)
    MANYLORA_ADAPTER_DIR         -> parameter adapter_dir of gliner2_core; empty = no adapters
                                    (base model only)
    MANYLORA_PARAM_<KEY>=value   -> parameter <key> of gliner2_core, e.g.
                                    MANYLORA_PARAM_MAX_GPU_ADAPTERS=64; except the front's keys:
                                    checkpoint and max_request_tokens go to both models,
                                    core_model to gliner2 only; control_dir also goes to
                                    manylora_control (both must name the same folder; 'none'
                                    leaves manylora_control as committed, with no instance
                                    to reach)
    MANYLORA_GPUS                -> gliner2_core's instance_group: "" keeps the committed one
                                    (one instance per visible GPU, CPU where none); "all" =
                                    KIND_GPU on every GPU; "0,1,3" = KIND_GPU on those device ids
    MANYLORA_INSTANCES_PER_GPU   -> count of that group (default 1, the recommended value:
                                    each instance is its own process with its own copy of the
                                    weights and its own adapter cache, and one per GPU keeps
                                    every adapter in one cache per GPU; the fronts, not more
                                    core instances, scale the CPU work)
    MANYLORA_FRONT_INSTANCES     -> count of gliner2's instance group (KIND_CPU; default: the
                                    committed count): one process each, about one busy core
                                    each under load
    MANYLORA_CONTROL_COMMANDS    -> parameter allowed_commands of manylora_control: "" keeps
                                    the committed one (all); "list,stats" = read-only (the other
                                    commands answer UNSUPPORTED); any of list, preload, evict,
                                    stats (comma-separated) or "all"; "none" = leave
                                    manylora_control out of the copy (no adapter control channel:
                                    whoever can send inference requests can otherwise send
                                    the allowed commands)

MANYLORA_PARAM_CORE_MODEL=none serves the old single-model layout: gliner2 runs every stage
itself, so it takes gliner2_core's committed parameters and instance group and every
setting above (MANYLORA_FRONT_INSTANCES is refused), and gliner2_core is left out of the copy.

Relative paths (checkpoint, adapter_dir, control_dir), committed or set here, are made
absolute from the committed model folder, so they keep their meaning in the copy. Parameter
values are not checked here: each model checks every one strictly when it loads
(manylora.config), and an unknown key stops gliner2_core with a message that names the key.

    python3 docker/render_config.py --source model_repository --out /tmp/manylora/model_repository
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

FRONT = "gliner2"
CORE = "gliner2_core"
CONTROL = "manylora_control"
PARAM_PREFIX = "MANYLORA_PARAM_"
# the parameters a front instance reads (manylora.serving.TritonModelHandler with core_model
# set); every other one is the GPU stage's
FRONT_KEYS = frozenset({"checkpoint", "max_request_tokens", "core_model"})
FRONT_ONLY_KEYS = frozenset({"core_model"})
PATH_KEYS = ("checkpoint", "adapter_dir", "control_dir")
SINGLE_MODEL = "none"  # core_model value: the front runs every stage itself
CONTROL_COMMANDS = "MANYLORA_CONTROL_COMMANDS"
# manylora.control.COMMANDS (not imported: the renderer needs no manylora); its order is the rendered one
CONTROL_COMMAND_NAMES = ("list", "preload", "evict", "stats")
NO_CONTROL = "none"  # MANYLORA_CONTROL_COMMANDS value: manylora_control left out
# why a model can be left out of the copy (main prints it)
LEFT_OUT = {
    "gliner2_core": f"core_model {SINGLE_MODEL}: {FRONT} runs every stage",
    "manylora_control": f"{CONTROL_COMMANDS}={NO_CONTROL}: no adapter control channel",
}


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


def _count(env: Mapping[str, str], name: str, default: str) -> int:
    raw = env.get(name, default).strip()
    if not raw.isdigit() or int(raw) < 1:
        raise RenderError(f"{name}: expected a positive integer, got {raw!r}")
    return int(raw)


def _allowed_commands(raw: str) -> str | None:
    """MANYLORA_CONTROL_COMMANDS as manylora_control's allowed_commands ("all", or the named
    commands in their canonical order); None for "none" (leave the control model out)."""
    names = [part.strip().lower() for part in raw.split(",")]
    if names == [NO_CONTROL] or names == ["all"]:
        return None if names == [NO_CONTROL] else "all"
    unknown = sorted({n for n in names if n not in CONTROL_COMMAND_NAMES})
    if unknown or not names:
        raise RenderError(
            f"{CONTROL_COMMANDS}: expected 'all', 'none' or some of {', '.join(CONTROL_COMMAND_NAMES)} "
            f"(comma-separated), got {raw!r}"
        )
    return ",".join(c for c in CONTROL_COMMAND_NAMES if c in names)


def environment_parameters(env: Mapping[str, str]) -> dict[str, str]:
    """Every parameter the environment sets, by key (MANYLORA_PARAM_<KEY> wins over the
    MANYLORA_CHECKPOINT / MANYLORA_ADAPTER_DIR shorthands)."""
    parameters = {}
    if "MANYLORA_CHECKPOINT" in env:
        parameters["checkpoint"] = env["MANYLORA_CHECKPOINT"]
    if "MANYLORA_ADAPTER_DIR" in env:
        parameters["adapter_dir"] = env["MANYLORA_ADAPTER_DIR"]
    for name, value in env.items():
        if name.startswith(PARAM_PREFIX) and len(name) > len(PARAM_PREFIX):
            parameters[name[len(PARAM_PREFIX) :].lower()] = value
    return parameters


def route(parameters: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(gliner2's, gliner2_core's) share of the environment's parameters in the pipeline."""
    front = {k: v for k, v in parameters.items() if k in FRONT_KEYS}
    core = {k: v for k, v in parameters.items() if k not in FRONT_ONLY_KEYS}
    return front, core


def _parse(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _absolute(value: str, model_dir: Path | None) -> str:
    if model_dir is None or value in ("auto", "none") or Path(value).is_absolute():
        return value
    return os.path.normpath(model_dir.resolve() / value)


def _set_parameters(config, parameters: Mapping[str, str], model_dir: Path | None) -> None:
    """Apply ``parameters`` (an empty adapter_dir removes it), then make every path absolute
    from ``model_dir``."""
    for key, value in sorted(parameters.items()):
        if key == "adapter_dir" and not value:
            config.parameters.pop(key, None)
        else:
            config.parameters[key].string_value = value
    for key in PATH_KEYS:
        if key in config.parameters:
            config.parameters[key].string_value = _absolute(config.parameters[key].string_value, model_dir)


def _set_gpu_instances(config, env: Mapping[str, str]) -> None:
    """MANYLORA_GPUS / MANYLORA_INSTANCES_PER_GPU on the model that runs the engine."""
    from tritonclient.grpc import model_config_pb2

    gpus = env.get("MANYLORA_GPUS", "").strip()
    count = _count(env, "MANYLORA_INSTANCES_PER_GPU", "1")
    if gpus:
        ids = _gpu_ids(gpus)
        del config.instance_group[:]
        group = config.instance_group.add()
        group.count = count
        group.kind = model_config_pb2.ModelInstanceGroup.Kind.KIND_GPU
        if ids is not None:
            group.gpus.extend(ids)
    elif "MANYLORA_INSTANCES_PER_GPU" in env:
        for group in config.instance_group:
            group.count = count


def _set_front_instances(config, env: Mapping[str, str]) -> None:
    from tritonclient.grpc import model_config_pb2

    if "MANYLORA_FRONT_INSTANCES" not in env:
        return
    count = _count(env, "MANYLORA_FRONT_INSTANCES", "")
    del config.instance_group[:]
    group = config.instance_group.add()
    group.count = count
    group.kind = model_config_pb2.ModelInstanceGroup.Kind.KIND_CPU


def render_models(source: Path, env: Mapping[str, str]) -> dict[str, str | None]:
    """The rendered config.pbtxt text of each model of ``source`` that the environment
    changes (comments are not kept), by model name; None = leave that model out of the copy.
    gliner2 and gliner2_core are always rendered (their paths are made absolute);
    manylora_control when control_dir or MANYLORA_CONTROL_COMMANDS changes it."""
    from google.protobuf import text_format

    front = _parse((source / FRONT / "config.pbtxt").read_text())
    core = _parse((source / CORE / "config.pbtxt").read_text())
    parameters = environment_parameters(env)
    committed = front.parameters["core_model"].string_value if "core_model" in front.parameters else SINGLE_MODEL
    core_model = parameters.get("core_model", committed).strip()
    if core_model not in (CORE, SINGLE_MODEL):
        raise RenderError(
            f"MANYLORA_PARAM_CORE_MODEL: expected {CORE!r} (the pipeline) or {SINGLE_MODEL!r} "
            f"(one model runs every stage), got {core_model!r}"
        )
    rendered: dict[str, str | None] = {}
    if core_model == SINGLE_MODEL:
        if "MANYLORA_FRONT_INSTANCES" in env:
            raise RenderError(
                "MANYLORA_FRONT_INSTANCES: there is no CPU front with core_model 'none'; "
                "set MANYLORA_GPUS / MANYLORA_INSTANCES_PER_GPU instead"
            )
        # gliner2 becomes the engine: the GPU stage's parameters and instance group
        _set_parameters(core, {}, source / CORE)
        _set_parameters(front, {}, source / FRONT)
        for key, value in core.parameters.items():
            if key not in front.parameters:
                front.parameters[key].string_value = value.string_value
        del front.instance_group[:]
        front.instance_group.extend(core.instance_group)
        _set_parameters(front, parameters, source / FRONT)
        _set_gpu_instances(front, env)
        rendered[FRONT] = text_format.MessageToString(front)
        rendered[CORE] = None
        engine_parameters = parameters
    else:
        front_parameters, core_parameters = route(parameters)
        _set_parameters(front, front_parameters, source / FRONT)
        _set_front_instances(front, env)
        _set_parameters(core, core_parameters, source / CORE)
        _set_gpu_instances(core, env)
        rendered[FRONT] = text_format.MessageToString(front)
        rendered[CORE] = text_format.MessageToString(core)
        engine_parameters = core_parameters
    commands = env.get(CONTROL_COMMANDS, "").strip()
    allowed = _allowed_commands(commands) if commands else ""  # checked even without a control model
    if not (source / CONTROL / "config.pbtxt").is_file():
        return rendered
    if allowed is None:
        rendered[CONTROL] = None
        return rendered
    control = _parse((source / CONTROL / "config.pbtxt").read_text())
    control_dir = engine_parameters.get("control_dir", "").strip()
    if control_dir and control_dir != "none":
        engine_dir = source / (FRONT if core_model == SINGLE_MODEL else CORE)
        # the same folder as the engine's, even when it was given relative (from the engine's folder)
        control.parameters["control_dir"].string_value = _absolute(control_dir, engine_dir)
    if allowed:
        control.parameters["allowed_commands"].string_value = allowed
    if (control_dir and control_dir != "none") or allowed:
        rendered[CONTROL] = text_format.MessageToString(control)
    return rendered


def render_repository(source: Path, out: Path, env: Mapping[str, str]) -> dict[str, str | None]:
    """Copy ``source`` to ``out`` (replacing it) with the rendered configs; the rendered
    models, as render_models returns them."""
    rendered = render_models(source, env)  # first: a bad setting leaves ``out`` alone
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in rendered.items():
        if text is None:
            shutil.rmtree(out / name)
        else:
            (out / name / "config.pbtxt").write_text(text)
    return rendered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the committed model repository")
    parser.add_argument("--out", type=Path, required=True, help="where to write the rendered copy")
    args = parser.parse_args(argv)
    try:
        rendered = render_repository(args.source, args.out, os.environ)
    except RenderError as err:
        print(f"render_config: {err}", file=sys.stderr)
        return 2
    for name, text in rendered.items():
        if text is None:
            print(f"# {name}: left out ({LEFT_OUT.get(name, 'not served')})")
        else:
            print(f"# {name}/config.pbtxt\n{text}", end="" if text.endswith("\n") else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
