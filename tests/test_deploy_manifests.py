"""The Kubernetes manifests (deploy/k8s) are valid and say what pushkv accepts.

Each document is validated against the Kubernetes API schema from the
registries (kubernetes-validate, strict: an unknown field is an error). Then
what the schema cannot know: every `pushkv` command line parses with pushkv's
own CLI, every `--kv-transfer-config` parses with the connector's settings
(`$(VAR)` expanded as the kubelet would), and the addresses that clients,
coordinators and etcd give each other name replicas that the manifests run.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

# No type information for these: kubernetes-validate ships none, and the dev
# extras do not install types-PyYAML.
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]

from pushkv.cli.main import build_parser
from pushkv.harness.vllm_server import pushkv_config
from pushkv.vllm_integration.settings import ConnectorSettings

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
DOCS: list[tuple[str, dict[str, Any]]] = [
    (path.name, doc)
    for path in sorted(K8S.glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if doc
]
VERSION = latest_version()


def _named(kind: str, name: str) -> dict[str, Any]:
    for _, doc in DOCS:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


def _container(kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _named(kind, name)["spec"]["template"]["spec"]
    containers: list[dict[str, Any]] = spec["containers"]
    (c,) = containers
    return c


def _expand(text: str, values: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in command lines."""
    return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], text)


def _flag(cmd: list[str], name: str) -> str:
    prefix = f"--{name}="
    (value,) = [a[len(prefix) :] for a in cmd if a.startswith(prefix)]
    return value


def _replicas(statefulset: str, service: str, port: int) -> list[str]:
    n = _named("StatefulSet", statefulset)["spec"]["replicas"]
    return [f"{statefulset}-{i}.{service}:{port}" for i in range(n)]


def test_every_kind_is_present() -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in DOCS}
    assert {
        ("StatefulSet", "pushkv-etcd"),
        ("StatefulSet", "pushkv-coordinator"),
        ("Deployment", "pushkv-prefill"),
        ("Deployment", "pushkv-decode"),
        ("Deployment", "pushkv-router"),
        ("Service", "pushkv-coordinator"),
        ("Service", "pushkv-router"),
    } <= kinds
    assert _named("StatefulSet", "pushkv-coordinator")["spec"]["replicas"] == 3


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_schema_valid(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_schema_check_catches_a_typo() -> None:
    """Negative control: the validator rejects a misspelt field."""
    doc = copy.deepcopy(_named("StatefulSet", "pushkv-coordinator"))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSION, strict=True)


def _relay(role: str) -> dict[str, Any]:
    """The engine pod's node relay: a native sidecar (an init container that restarts)."""
    spec = _named("Deployment", f"pushkv-{role}")["spec"]["template"]["spec"]
    relays: list[dict[str, Any]] = [c for c in spec["initContainers"] if c["name"] == "relay"]
    (c,) = relays
    return c


def test_pods_get_no_service_link_variables() -> None:
    """Service links inject `PUSHKV_ROUTER_PORT=tcp://...` and the like into
    every pod (tests/test_service_links.py shows pushkv ignoring them); the
    manifests turn them off as well."""
    pods = [
        doc["spec"]["template"]["spec"]
        for _, doc in DOCS
        if doc["kind"] in ("StatefulSet", "Deployment")
    ]
    assert len(pods) == 5
    assert all(pod.get("enableServiceLinks") is False for pod in pods)


def test_pushkv_commands_parse() -> None:
    parser, _ = build_parser()
    commands = [
        _container("StatefulSet", "pushkv-coordinator")["command"],
        _container("Deployment", "pushkv-router")["command"],
        *(_relay(role)["command"] for role in ("prefill", "decode")),
    ]
    for cmd in commands:
        assert cmd[0] == "pushkv"
        parser.parse_args(_expand(a, {"POD_NAME": "pod-0"}) for a in cmd[1:])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_agents_dial_their_pods_relay_with_the_pods_identity(role: str) -> None:
    relay = _relay(role)
    assert relay["restartPolicy"] == "Always"  # a sidecar, up before the engine
    cmd = relay["command"]
    assert _flag(cmd, "coordinator").split(",") == _replicas(
        "pushkv-coordinator", "pushkv-coordinator", 50151
    )
    engine = _container("Deployment", f"pushkv-{role}")
    raw = engine["command"][engine["command"].index("--kv-transfer-config") + 1]
    extra = json.loads(_expand(raw, {"POD_NAME": "p", "POD_IP": "10.0.0.7"}))
    assert extra["kv_connector_extra_config"]["agent_coordinator"] == _flag(cmd, "listen")
    assert _flag(cmd, "listen").startswith("127.0.0.1:")  # the pod's loopback only
    # The relay speaks for the engine with the engine pod's own certificate.
    (mount,) = [m["mountPath"] for m in relay["volumeMounts"] if m["name"] == "tls"]
    assert _flag(cmd, "tls-cert") == f"{mount}/tls.crt"


def test_probes_ask_what_each_side_serves() -> None:
    coord = _container("StatefulSet", "pushkv-coordinator")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The overall status: SERVING on standbys too (write services are not).
        assert coord[probe]["grpc"] == {"port": 50151}, probe
    for role in ("prefill", "decode"):
        c = _container("Deployment", f"pushkv-{role}")
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_metrics_are_on_vllms_own_port(role: str) -> None:
    """Every rank's connector counters are on vLLM's /metrics (its API port):
    no port of their own, and vLLM's stats, which carry them, left on."""
    c = _container("Deployment", f"pushkv-{role}")
    assert [p["containerPort"] for p in c["ports"]] == [8000]
    assert "--disable-log-stats" not in c["command"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_connector_config_parses(role: str, tmp_path: Path) -> None:
    c = _container("Deployment", f"pushkv-{role}")
    cmd = c["command"]
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls"]
    for name in ("ca.crt", "tls.crt", "tls.key"):  # what the CSI driver writes
        (tmp_path / name).write_text("")
    raw = cmd[cmd.index("--kv-transfer-config") + 1].replace(mount, str(tmp_path))
    config = json.loads(_expand(raw, {"POD_NAME": f"pushkv-{role}-abc", "POD_IP": "10.0.0.7"}))
    reference = pushkv_config(
        {"prefill": "kv_producer", "decode": "kv_consumer"}[role], "x", "c:1", "http://h:1"
    )
    for key in ("kv_connector", "kv_role"):
        assert config[key] == reference[key], key
    # vLLM finds the connector by name (vllm_integration/plugin.py).
    assert "kv_connector_module_path" not in config
    assert config["engine_id"] == f"pushkv-{role}-abc"  # one identity per pod
    settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
    coordinators = settings.coordinator.split(",")
    assert coordinators == _replicas("pushkv-coordinator", "pushkv-coordinator", 50151)
    assert settings.tls_ca and settings.tls_cert and settings.tls_key
    tls = {
        v["name"]: v
        for v in _named("Deployment", f"pushkv-{role}")["spec"]["template"]["spec"]["volumes"]
    }["tls"]
    assert tls["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"] == "engine:${POD_NAME}"


def test_clients_and_coordinators_name_running_replicas() -> None:
    router = _container("Deployment", "pushkv-router")["command"]
    coordinators = _replicas("pushkv-coordinator", "pushkv-coordinator", 50151)
    assert _flag(router, "coordinator").split(",") == coordinators
    coord = _container("StatefulSet", "pushkv-coordinator")["command"]
    etcd = [f"http://{a}" for a in _replicas("pushkv-etcd", "pushkv-etcd", 2379)]
    assert _flag(coord, "etcd").split(",") == etcd
    assert _expand(_flag(coord, "advertise"), {"POD_NAME": "pushkv-coordinator-1"}) in coordinators
