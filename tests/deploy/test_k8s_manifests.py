"""Kubernetes manifests: every YAML parses, every object validates against the Kubernetes
JSON schemas (kubernetes-validate ships them: no cluster, no network), and the objects
agree with each other (selectors, ports, metric names, the router's upstreams)."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from deploy_files import K8S, REPO, find, load_script, yaml_documents
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

# the oldest Kubernetes release these manifests claim, and a current one
K8S_VERSIONS = ("1.28", "1.33")
SERVER_LABELS = {"app.kubernetes.io/name": "manylora", "app.kubernetes.io/component": "server"}
ROUTER_LABELS = {"app.kubernetes.io/name": "manylora", "app.kubernetes.io/component": "router"}
ALL_YAML = sorted(p.relative_to(REPO).as_posix() for d in ("deploy", "docker") for p in (REPO / d).rglob("*.y*ml"))


@pytest.mark.parametrize("relative", ALL_YAML)
def test_every_yaml_file_parses(relative):
    assert yaml_documents(REPO / relative), f"{relative} holds no YAML document"


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_kubernetes_schemas(k8s_objects, version):
    assert len(k8s_objects) >= 10
    failures = []
    for obj in k8s_objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(map(str, err.path))
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {err.message}")
    assert not failures, "\n".join(failures)


def test_strict_validation_catches_a_misspelt_field(k8s_objects):
    deployment = find(k8s_objects, "Deployment", "manylora")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_everything_lives_in_one_namespace(k8s_objects):
    namespaced = [o for o in k8s_objects if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"manylora"}


def test_server_deployment(k8s_objects):
    pod = find(k8s_objects, "Deployment", "manylora")["spec"]["template"]
    assert SERVER_LABELS.items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    find(k8s_objects, "PersistentVolumeClaim", claim)


def test_server_parameters_are_known_to_the_engine(k8s_objects):
    from manylora.config import EngineConfig

    pod = find(k8s_objects, "Deployment", "manylora")["spec"]["template"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    parameters = {k[len("MANYLORA_PARAM_") :].lower(): v for k, v in env.items() if k.startswith("MANYLORA_PARAM_")}
    assert parameters and set(parameters) <= set(EngineConfig.PARAMETERS)
    for key, raw in parameters.items():
        EngineConfig.PARAMETERS[key][0](key, raw)  # each value parses as the model will parse it
    assert int(parameters["max_cpu_adapters"]) >= int(parameters["max_gpu_adapters"])
    assert env["MANYLORA_DEMO"] == "never"


def test_server_environment_renders_the_pipeline(k8s_objects):
    """The pod's MANYLORA_* through docker/render_config.py: one GPU-stage instance on the
    pod's one GPU with the cache settings, CPU fronts sized to the pod's cores as measured."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    render_config = load_script("docker/render_config.py")
    pod = find(k8s_objects, "Deployment", "manylora")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    rendered = {
        name: text_format.Parse(text, model_config_pb2.ModelConfig())
        for name, text in render_config.render_models(REPO / "model_repository", env).items()
    }
    front, core = rendered["gliner2"], rendered["gliner2_core"]
    (group,) = core.instance_group
    # one instance per GPU: one copy of the weights and one adapter cache on the pod's GPU
    assert (group.kind, group.count, list(group.gpus)) == (group.KIND_GPU, 1, [])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for key, value in env.items():
        if key.startswith("MANYLORA_PARAM_"):
            assert core.parameters[key[len("MANYLORA_PARAM_") :].lower()].string_value == value
    assert core.parameters["checkpoint"].string_value == env["MANYLORA_CHECKPOINT"]
    assert core.parameters["adapter_dir"].string_value == env["MANYLORA_ADAPTER_DIR"]
    assert front.parameters["checkpoint"].string_value == env["MANYLORA_CHECKPOINT"]
    assert set(front.parameters) <= {"checkpoint", "max_request_tokens", "core_model"}
    (fronts,) = front.instance_group
    assert fronts.kind == fronts.KIND_CPU and fronts.count == int(env["MANYLORA_FRONT_INSTANCES"])
    # fronts wait while their batch is in the GPU stage: up to 4 per core (docs/tuning.md, the
    # measured 32 and 64 on 16 cores), and the GPU stage's torch threads within the pod's cores
    cores = int(container["resources"]["requests"]["cpu"])
    assert fronts.count <= 4 * cores
    assert int(core.parameters["cpu_threads"].string_value) <= cores


@pytest.mark.parametrize("service", ["manylora", "manylora-headless"])
def test_services_select_the_server_pods(k8s_objects, service):
    spec = find(k8s_objects, "Service", service)["spec"]
    assert spec["selector"] == SERVER_LABELS
    assert {p["port"] for p in spec["ports"]} >= {8000, 8001}
    if service == "manylora-headless":
        assert spec["clusterIP"] == "None"


def test_disruption_budgets_select_pods_that_exist(k8s_objects):
    assert find(k8s_objects, "PodDisruptionBudget", "manylora")["spec"]["selector"]["matchLabels"] == SERVER_LABELS
    assert find(k8s_objects, "PodDisruptionBudget", "manylora-router")["spec"]["selector"]["matchLabels"] == (
        ROUTER_LABELS
    )
    router_pod = find(k8s_objects, "Deployment", "manylora-router")["spec"]["template"]
    assert ROUTER_LABELS.items() <= router_pod["metadata"]["labels"].items()


def test_autoscaler_metrics_come_from_the_adapter_rules(k8s_objects):
    hpa = find(k8s_objects, "HorizontalPodAutoscaler", "manylora")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "manylora"}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
    rules = yaml.safe_load((REPO / "deploy" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    served = {r["name"]["as"] for r in rules}
    assert wanted and wanted <= served
    queries = " ".join(r["metricsQuery"] for r in rules)
    assert "nv_inference_queue_duration_us" in queries and "nv_inference_pending_request_count" in queries
    # every series is the public model's, the CPU fronts that clients call (the GPU stage's
    # requests are the fronts' BLS calls, one per front batch: not client requests)
    public = text_format.Parse(
        (REPO / "model_repository" / "gliner2" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    ).name
    for rule in rules:
        for query in (rule["seriesQuery"], rule["metricsQuery"]):
            models = re.findall(r'model="([^"]*)"', query)
            assert models and set(models) == {public}, query


def test_router_hashes_the_adapter_header_onto_the_server_pods(k8s_objects):
    envoy = yaml.safe_load(find(k8s_objects, "ConfigMap", "manylora-router")["data"]["envoy.yaml"])
    headless = find(k8s_objects, "Service", "manylora-headless")
    fqdn = f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    service_ports = {p["port"] for p in headless["spec"]["ports"]}
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    listener_ports = set()
    for listener in envoy["static_resources"]["listeners"]:
        listener_ports.add(listener["address"]["socket_address"]["port_value"])
        (manager,) = listener["filter_chains"][0]["filters"]
        for host in manager["typed_config"]["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                assert route["route"]["hash_policy"] == [{"header": {"header_name": "x-adapter-id"}}]
                assert route["route"]["cluster"] in clusters
    assert listener_ports == {8000, 8001}
    for cluster in clusters.values():
        (policy,) = cluster["load_balancing_policy"]["policies"]
        ring = policy["typed_extension_config"]
        assert ring["name"] == "envoy.load_balancing_policies.ring_hash"
        assert ring["typed_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] >= 100
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert address["address"] == fqdn and address["port_value"] in service_ports
    grpc = clusters["triton_grpc"]["typed_extension_protocol_options"]
    assert (
        "http2_protocol_options"
        in grpc["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    )
