"""The container files, checked without a Docker engine: the Dockerfile's base image and
install steps, the install script that `make setup` shares with it (run against a stand-in
python that records its calls), the entrypoint (against a stand-in tritonserver), the
config renderer, and the compose file's references."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_files import REPO, load_script

PINNED_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"
INSTALL = "scripts/install.sh"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_starts_from_the_pinned_triton_image():
    froms = [args.split() for op, args in dockerfile_instructions() if op == "FROM"]
    assert froms[0][0] == PINNED_IMAGE
    stages = []
    for words in froms:
        assert words[0] == PINNED_IMAGE or words[0] in stages, f"FROM {words[0]}: not the pinned image or a stage"
        stages.append(words[2] if len(words) == 3 and words[1].upper() == "AS" else None)
    assert stages[-1] == "server", "the default (last) stage must be the server"


def test_dockerfile_installs_only_through_the_shared_script():
    runs = [args for op, args in dockerfile_instructions() if op == "RUN"]
    installs = [r for r in runs if "install" in r]
    assert installs and all(f"bash {INSTALL} --python python3" in r for r in installs)
    assert not [r for r in runs if re.search(r"\bpip3? install\b", r)], "pip install outside scripts/install.sh"


def test_dockerfile_copies_files_that_exist():
    for op, args in dockerfile_instructions():
        if op == "COPY" and not args.startswith("--from"):
            *sources, _ = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: no such path"


def test_dockerfile_health_check_and_entrypoint():
    instructions = dict(dockerfile_instructions())  # the last of each kind: the server stage's
    assert "/v2/health/ready" in instructions["HEALTHCHECK"]
    entrypoint = yaml.safe_load(instructions["ENTRYPOINT"])[0]
    assert entrypoint.startswith("/opt/manylora/")
    script = REPO / entrypoint.removeprefix("/opt/manylora/")
    assert script.is_file() and os.access(script, os.X_OK)
    assert "--shm-size" in DOCKERFILE.read_text()


def test_setup_uses_the_install_script_and_stamps_it():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert f"bash {INSTALL} " in setup
    assert re.search(r"cat [^|]*scripts/install\.sh[^|]*\| sha256sum", setup), "the stamp must hash install.sh"
    assert not re.search(r"pip3? install|-m pip", re.sub(r"#.*", "", setup)), (
        "setup.sh installs through install.sh only"
    )


@pytest.fixture
def fake_python(tmp_path) -> tuple[Path, Path]:
    """A python3 stand-in that logs its arguments, one call per line."""
    log = tmp_path / "calls.log"
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, log


def run_install(python: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / INSTALL), "--python", str(python), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_install_script_as_setup_runs_it(fake_python):
    python, log = fake_python
    done = run_install(python, "--torch-flavour", "cpu", "--editable", "--extras", "serve,test,kernels", "ruff")
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0].endswith("install torch==2.13.0")
    assert calls[1].endswith("install -e .[serve,test,kernels] ruff")
    assert "numpy" in calls[2]  # the numpy<2 check
    assert len(calls) == 3


def test_install_script_as_the_image_runs_it(fake_python):
    python, log = fake_python
    url = "https://download.pytorch.org/whl/cu126"
    torch = run_install(python, "--step", "torch", "--torch-flavour", "cuda", env={"TORCH_INDEX_URL": url})
    package = run_install(python, "--step", "package", "--extras", "kernels")
    assert torch.returncode == 0 and package.returncode == 0, torch.stderr + package.stderr
    calls = log.read_text().splitlines()
    assert calls[0].endswith(f"install torch==2.13.0 --index-url {url}")
    assert "torch.version.cuda" in calls[1]  # the CUDA build check (the stand-in reports a CPU build)
    assert "CPU build" in torch.stderr
    assert calls[2].endswith("install .[kernels]")
    assert "numpy" in calls[3]


def test_install_script_refuses_bad_arguments(fake_python):
    python, _ = fake_python
    assert run_install(python, "--step", "everything").returncode == 2
    assert run_install(python, "--torch-flavour", "rocm").returncode == 2
    assert run_install(python, "--frobnicate").returncode == 2


# --- entrypoint (docker/render_config.py itself: test_render_config.py) ---


def parse_config_text(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def parse_config(path: Path):
    return parse_config_text(path.read_text())


def run_entrypoint(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with a tritonserver stand-in that prints its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    server = bin_dir / "tritonserver"
    server.write_text('#!/bin/sh\necho "tritonserver $*"\n')
    server.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    return subprocess.run(
        [str(REPO / "docker" / "entrypoint.sh"), "--log-verbose=1"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path, "MANYLORA_RUN_DIR": str(tmp_path / "run"), **env},
        timeout=60,
    )


def test_entrypoint_renders_then_execs_tritonserver(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    done = run_entrypoint(
        tmp_path, {"MANYLORA_CHECKPOINT": str(checkpoint), "MANYLORA_ADAPTER_DIR": "", "MANYLORA_DEMO": "never"}
    )
    assert done.returncode == 0, done.stderr
    repository = tmp_path / "run" / "model_repository"
    # --strict-readiness: /v2/health/ready (the image's health check, the pods' probes) waits
    # for every model, the gliner2 front and its GPU stage gliner2_core
    assert done.stdout.strip().splitlines()[-1] == (
        f"tritonserver --model-repository={repository} --disable-auto-complete-config "
        "--strict-readiness=true --exit-timeout-secs=30 --log-verbose=1"
    )
    front, core = (parse_config(repository / name / "config.pbtxt") for name in ("gliner2", "gliner2_core"))
    assert front.parameters["checkpoint"].string_value == core.parameters["checkpoint"].string_value == str(checkpoint)
    assert front.parameters["core_model"].string_value == "gliner2_core"
    assert "adapter_dir" not in core.parameters and "adapter_dir" not in front.parameters
    for name in ("gliner2", "gliner2_core", "manylora_control"):
        assert (repository / name / "1" / "model.py").is_file()
    # the log shows both rendered configs
    assert "# gliner2/config.pbtxt" in done.stdout and "# gliner2_core/config.pbtxt" in done.stdout


def test_entrypoint_stops_on_a_setting_the_renderer_refuses(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    done = run_entrypoint(
        tmp_path, {"MANYLORA_CHECKPOINT": str(checkpoint), "MANYLORA_DEMO": "never", "MANYLORA_FRONT_INSTANCES": "0"}
    )
    assert done.returncode == 2
    assert "MANYLORA_FRONT_INSTANCES" in done.stderr and "tritonserver" not in done.stdout


def test_entrypoint_without_checkpoint_in_production_stops(tmp_path):
    done = run_entrypoint(tmp_path, {"MANYLORA_CHECKPOINT": str(tmp_path / "absent"), "MANYLORA_DEMO": "never"})
    assert done.returncode == 1
    assert "no GLiNER2 checkpoint" in done.stderr and "tritonserver" not in done.stdout


# --- compose ---


def test_compose_services_ports_and_paths():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"triton", "locust"}
    stages = {args.split()[-1] for op, args in dockerfile_instructions() if op == "FROM" and " AS " in args}
    for service in services.values():
        build = service["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == REPO and (context / build["dockerfile"]) == DOCKERFILE
        assert build["target"] in stages
        for volume in service.get("volumes", []):
            source = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", volume).split(":")[0]  # the defaults
            if source.startswith((".", "/")):  # a bind mount: its folder, or the folder holding it, exists
                path = (COMPOSE.parent / source).resolve()
                assert path.exists() or path.parent.is_dir(), volume
            else:
                assert source in compose["volumes"], f"named volume {source} is not declared"

    triton = services["triton"]
    assert {p.split(":")[0].strip('"') for p in triton["ports"]} == {"8000", "8001", "8002"}
    assert triton["shm_size"]
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    (device,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def compose_defaults(environment: dict) -> dict[str, str]:
    """The service's environment with every ${VAR:-default} at its default."""
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in environment.items()}


def test_compose_server_settings_render_the_pipeline():
    from manylora.config import EngineConfig

    render_config = load_script("docker/render_config.py")
    env = compose_defaults(yaml.safe_load(COMPOSE.read_text())["services"]["triton"]["environment"])
    keys = {k[len("MANYLORA_PARAM_") :].lower() for k in env if k.startswith("MANYLORA_PARAM_")}
    assert keys and keys <= set(EngineConfig.PARAMETERS)
    rendered = {
        name: parse_config_text(text)
        for name, text in render_config.render_models(REPO / "model_repository", env).items()
    }
    front, core = rendered["gliner2"], rendered["gliner2_core"]
    (core_group,) = core.instance_group
    assert (core_group.kind, core_group.count, list(core_group.gpus)) == (core_group.KIND_GPU, 1, [])
    (front_group,) = front.instance_group
    assert front_group.kind == front_group.KIND_CPU and front_group.count == int(env["MANYLORA_FRONT_INSTANCES"])
    for key in keys:  # the cache sizes reach the GPU stage, not the front
        assert core.parameters[key].string_value == env["MANYLORA_PARAM_" + key.upper()]
        assert key not in front.parameters


def test_compose_locust_uses_the_locustfile_settings():
    locust = yaml.safe_load(COMPOSE.read_text())["services"]["locust"]
    assert locust["depends_on"]["triton"]["condition"] == "service_healthy"
    locustfile = (REPO / "perf" / "locustfile.py").read_text()
    for name in ("MANYLORA_ADAPTERS", "MANYLORA_GRPC_PORT", "MANYLORA_HTTP_PORT"):
        assert name in locust["environment"] and name in locustfile
    assert locust["environment"]["LOCUST_HOST"] == "triton"
    loadtest_entrypoint = [a for op, a in dockerfile_instructions() if op == "ENTRYPOINT"][0]
    assert "/opt/manylora/perf/locustfile.py" in loadtest_entrypoint
