"""Settings from the environment, as a pod in deploy/k8s gets it.

Kubernetes injects service-link variables for every Service into every pod
started after it (`enableServiceLinks`, on by default): the Service
`pushkv-router` gives `PUSHKV_ROUTER_PORT=tcp://<ip>:8000`, which has the
spelling of the router's port setting. Every subcommand must start with them
(here with their addresses on loopback), and a bad `PUSHKV_*` value is a
one-line usage error naming the variable, not a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from pushkv.cli import main as cli
from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.harness.vllm_server import RouterProcess
from pushkv.net.env import EnvSettingError, env_setting, is_service_link

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"


def _services() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "Service"
    ]


def service_link_env() -> dict[str, str]:
    """The variables the kubelet injects for the Services in deploy/k8s
    (the docker-links form), each Service on its own loopback address.
    Headless Services get none in a cluster; they are included here anyway."""
    env: dict[str, str] = {}
    for i, svc in enumerate(_services(), start=2):
        name = svc["metadata"]["name"].upper().replace("-", "_")
        ip = f"127.0.0.{i}"
        ports = svc["spec"]["ports"]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{name}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
        for p in ports:
            port, proto = p["port"], p.get("protocol", "TCP")
            if "name" in p:
                env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(port)
            base = f"{name}_PORT_{port}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{port}"
            env[f"{base}_PROTO"] = proto.lower()
            env[f"{base}_PORT"] = str(port)
            env[f"{base}_ADDR"] = ip
    return env


@pytest.fixture
def service_links(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    env = service_link_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env


def test_the_router_service_shadows_a_setting() -> None:
    """The trap itself: without the service-link rule the router's port
    setting would read the Service's link."""
    env = service_link_env()
    assert env["PUSHKV_ROUTER_PORT"].startswith("tcp://127.0.0.")
    assert env_setting("router_port", 8000, environ=env) == 8000


@pytest.mark.parametrize("command", ["coordinator", "router", "relay", "status", "bench", "demo"])
def test_every_subcommand_helps_with_service_links(
    command: str, service_links: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: pushkv" in capsys.readouterr().out


def test_servers_start_with_service_links(service_links: dict[str, str]) -> None:
    """A coordinator, a relay and a router, each a child process that
    inherits the pod's variables, start and answer."""
    with CoordinatorProcess() as coord:
        relay = RelayProcess(coord.address).start()
        router = RouterProcess(coord.address)
        try:
            router.start(wait_engines=False)
            assert router.proc is not None and router.proc.poll() is None
            assert relay.proc is not None and relay.proc.poll() is None
        finally:
            router.stop()
            relay.stop()


def test_a_bad_number_is_one_line_naming_the_variable() -> None:
    """Through the installed entry point's module, as an operator runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "pushkv.cli.main", "status", "--help"],
        env={"PUSHKV_PORT": "abc", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.splitlines() == ["pushkv: error: PUSHKV_PORT='abc': not a valid int value"]


@pytest.mark.parametrize(
    ("var", "value", "named"),
    [
        ("PUSHKV_SHUTDOWN_GRACE_S", "soon", "float"),
        ("PUSHKV_RANK_METRICS", "maybe", "bool"),
        ("PUSHKV_EVENT_LOOP", "trio", "one of uvloop, asyncio"),
    ],
)
def test_bad_values_are_usage_errors(
    var: str,
    value: str,
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(var, value)
    assert cli.main(["coordinator", "--help"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pushkv: error: {var}={value!r}: ")
    assert named in line


def test_service_link_forms() -> None:
    assert is_service_link("tcp://10.0.0.7:8000")
    assert is_service_link("udp://127.0.0.2:53")
    assert is_service_link("tcp://[fd00::7]:8000")
    assert not is_service_link("8000")
    assert not is_service_link("127.0.0.1:50151")
    assert not is_service_link("http://127.0.0.1:2379")  # an etcd URL is a setting


def test_settings_still_read_from_the_environment() -> None:
    env = {"PUSHKV_PORT": "6000", "PUSHKV_RANK_METRICS": "off", "PUSHKV_ETCD": "http://e:2379"}
    assert env_setting("port", 50151, environ=env) == 6000
    assert env_setting("rank_metrics", True, environ=env) is False
    assert env_setting("etcd", "", environ=env) == "http://e:2379"
    assert env_setting("host", "127.0.0.1", environ=env) == "127.0.0.1"
    with pytest.raises(EnvSettingError, match="PUSHKV_PORT"):
        env_setting("port", 1, environ={"PUSHKV_PORT": "tcp"})


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pushkv {version('pushkv')}"
