"""Each system's deployment: its vLLM servers, and what runs in front of them.

- ``pull`` / ``vllm-push`` (and their ``-noprog`` controls): a prefill and a
  decode server with vLLM's ``NixlConnector`` / ``NixlPushConnector``, and this
  benchmark's proxy for that flow (``pushkv.bench.serving.proxy``);
- ``pushkv``: a coordinator, then the same two servers with pushkv's connector,
  and ``pushkv router`` (``pushkv.harness.vllm_server.PushkvCluster``, as the demo);
- ``single``: one server.

The prefill engine's worker is on core 0 and the decode engine's on core 1; the
single engine on core 0. With ``--prefill-tp 2`` the prefill engine's two
workers are on cores 0 and 1 (rank r on core r), the decode engine's on core 1.
Every server of every system gets the same ``sitecustomize`` patches
(``pushkv.bench.serving.vllm_patches``) and the same UCX settings, apart from the
unpinning of vLLM's NIXL connectors and the ``-noprog`` controls.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Protocol

from pushkv.agent.nixl_adapter import DEFAULT_UCX_PARAMS
from pushkv.bench.serving.config import (
    DECODE_ENGINE_ID,
    PREFILL_ENGINE_ID,
    TP2_COORDINATOR_FLAGS,
    BenchConfig,
)
from pushkv.bench.serving.processes import ChildProcess
from pushkv.bench.serving.vllm_patches import sitecustomize
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import PushkvCluster, ServerOptions, VllmServer, free_port

# UCX environment for every server of every system. vLLM's NIXL connectors set
# this one for themselves (vllm.distributed.nixl_utils, "a rare memory leak in
# UCX") when they load NIXL; pushkv's agent does not. UCX_NET_DEVICES and the
# log levels come from VllmServer, the same for all.
UCX_ENV: Final = {"UCX_RCACHE_MAX_UNRELEASED": "1024"}


@dataclass(frozen=True)
class Place:
    """Where one engine runs: its network namespace ("" the host's), the address
    its API server listens on (the host reaches it there), its address on the
    KV link (vLLM's NIXL side channel) and the environment that puts UCX on it."""

    netns: str = ""
    host: str = "127.0.0.1"
    kv_addr: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def options(self) -> ServerOptions:
        return {"netns": self.netns, "host": self.host, "env": dict(self.env)}


@dataclass(frozen=True)
class Placement:
    """Where a system runs: the prefill engine (and the single engine), the decode
    engine, and the address the coordinator listens on (both engines reach it).
    The default, :data:`LOOPBACK`, is everything on the host."""

    prefill: Place = Place()
    decode: Place = Place()
    coordinator_host: str = "127.0.0.1"
    name: str = "loopback"


LOOPBACK: Final = Placement()


class _Stoppable(Protocol):
    def stop(self) -> None: ...


@dataclass
class Deployment:
    system: str
    scenario: str
    front_url: str = ""  # base URL the load goes to
    warm_url: str = ""  # the engine whose prefix cache the prefixhit scenario warms
    coordinator: str = ""  # pushkv only
    servers: list[VllmServer] = field(default_factory=list)
    helpers: list[_Stoppable] = field(default_factory=list)  # proxy / router / coordinator
    workdir: Path | None = None

    def stop(self) -> None:
        # A second Ctrl-C or SIGTERM must not interrupt the cleanup and orphan servers.
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for h in reversed(self.helpers):
                with contextlib.suppress(Exception):
                    h.stop()
            for s in self.servers:
                with contextlib.suppress(Exception):
                    s.stop()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def pgids(self) -> dict[str, int]:
        return {s.name: s.proc.pid for s in self.servers if s.proc is not None}

    def all_pgids(self) -> dict[str, int]:
        """Servers, plus the router / proxy / coordinator (each leads its own session)."""
        out = self.pgids()
        for h in self.helpers:
            proc = getattr(h, "proc", None)
            if proc is not None:
                name = type(h).__name__.removesuffix("Process").lower() or "helper"
                out[getattr(h, "name", name) if name == "child" else name] = proc.pid
        return out


def server_env(cfg: BenchConfig, system: str, workdir: Path) -> dict[str, str]:
    """The environment a system's servers add: UCX settings, and the patches'
    sitecustomize on PYTHONPATH (written into ``workdir``)."""
    shim = sitecustomize(
        unpin=system not in ("single", "pushkv", "pushkv-whole"),  # vLLM's NIXL connectors
        noprog=system.endswith("-noprog"),
        spin_ms=cfg.vllm_spin_ms,
        ucx_params=DEFAULT_UCX_PARAMS,
    )
    (workdir / "sitecustomize.py").write_text(shim)
    path = os.pathsep.join(x for x in (str(workdir), os.environ.get("PYTHONPATH", "")) if x)
    return {**UCX_ENV, "PYTHONPATH": path}


def _options(
    cfg: BenchConfig, scenario: str, env: dict[str, str], tp_size: int = 1, place: Place = Place()
) -> ServerOptions:
    """Every system's server settings; ``place``: where this server runs."""
    caching = "--enable-prefix-caching" if scenario == "prefixhit" else "--no-enable-prefix-caching"
    return ServerOptions(
        pin_process=cfg.pin == "engines",
        tp_size=tp_size,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        kvcache_gib=cfg.kvcache_gib,
        extra_args=(caching, *_step_budget(cfg)),
        env={**env, **place.env},
        netns=place.netns,
        host=place.host,
    )


def _step_budget(cfg: BenchConfig) -> tuple[str, ...]:
    return ("--max-num-batched-tokens", str(cfg.step_tokens)) if cfg.step_tokens else ()


def _nixl_config(cfg: BenchConfig, connector: str, role: str, engine_id: str) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }
    if cfg.kv_lease_s is not None:
        conf["kv_connector_extra_config"] = {"kv_lease_duration": cfg.kv_lease_s}
    return conf


def deploy(
    cfg: BenchConfig, system: str, scenario: str, placement: Placement = LOOPBACK
) -> Deployment:
    """Start one system's processes and wait until they serve (bounded)."""
    dep = Deployment(system, scenario)
    try:
        dep.workdir = Path(tempfile.mkdtemp(prefix="bench-shim-"))
        env = server_env(cfg, system, dep.workdir)
        if system == "single":
            _deploy_single(cfg, dep, env, placement.prefill)
        elif system in ("pushkv", "pushkv-whole"):
            _deploy_pushkv(cfg, dep, env, placement, armed=system == "pushkv")
        else:
            _deploy_vllm_nixl(cfg, dep, env, placement)
        return dep
    except BaseException:
        dep.stop()
        raise


def _deploy_single(cfg: BenchConfig, dep: Deployment, env: dict[str, str], place: Place) -> None:
    options = _options(cfg, dep.scenario, env, place=place)
    s = VllmServer(cfg.model_dir, "single", cpu_core=0, **options)
    dep.servers.append(s)
    s.start()
    s.wait_ready(cfg.startup_timeout_s)
    dep.front_url = dep.warm_url = s.url


def _deploy_pushkv(
    cfg: BenchConfig,
    dep: Deployment,
    env: dict[str, str],
    placement: Placement = LOOPBACK,
    *,
    armed: bool = True,
) -> None:
    flags = TP2_COORDINATOR_FLAGS if cfg.prefill_tp > 1 else ()
    arm = ("--arm-orders", "true" if armed else "false")
    coord = CoordinatorProcess(
        *flags, *arm, "--log-level", "WARNING", host=placement.coordinator_host
    )
    dep.helpers.append(coord)
    coord.start()
    cluster = PushkvCluster.around(
        coord.address,
        cfg.model_dir,
        names=("prefill", "decode"),
        # The benchmark's core layout holds for every system: vLLM's NIXL
        # connectors are kept off their reserved core (unpin above), and
        # pushkv's threads stay on the engine thread's core (its default,
        # "auto", would move them off it). --pushkv-setting thread_cpus=auto
        # measures that default.
        extra_config={"thread_cpus": "inherit", **dict(cfg.pushkv_extra)},
        prefill_tp=cfg.prefill_tp,
        sides=(placement.prefill.options(), placement.decode.options()),
        **_options(cfg, dep.scenario, env),
    )
    dep.servers += [cluster.prefill, cluster.decode]
    cluster.start_engines(cfg.startup_timeout_s)
    dep.helpers.append(cluster.router)
    cluster.start_router(timeout=120)
    dep.front_url, dep.warm_url = cluster.router.url, cluster.decode.url
    dep.coordinator = coord.address


def _deploy_vllm_nixl(
    cfg: BenchConfig, dep: Deployment, env: dict[str, str], placement: Placement = LOOPBACK
) -> None:
    """vLLM's NIXL connectors (pull or push), and this benchmark's proxy for them."""
    pull = dep.system.startswith("pull")
    connector = "NixlConnector" if pull else "NixlPushConnector"
    side_p, side_d = free_port(), free_port()
    servers = []
    for name, core, tp, role, engine_id, side, place in (
        ("prefill", 0, cfg.prefill_tp, "kv_producer", PREFILL_ENGINE_ID, side_p, placement.prefill),
        ("decode", 1, 1, "kv_consumer", DECODE_ENGINE_ID, side_d, placement.decode),
    ):
        side_channel = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": place.kv_addr,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
        }
        servers.append(
            VllmServer(
                cfg.model_dir,
                name,
                cpu_core=core,
                kv_transfer_config=_nixl_config(cfg, connector, role, engine_id),
                **_options(cfg, dep.scenario, {**env, **side_channel}, tp_size=tp, place=place),
            )
        )
    p, d = servers
    dep.servers += servers
    p.start()
    d.start()
    p.wait_ready(cfg.startup_timeout_s)
    d.wait_ready(cfg.startup_timeout_s)
    port = free_port()
    proxy = ChildProcess(
        f"proxy-{dep.system}",
        [
            sys.executable,
            "-m",
            "pushkv.bench.serving",
            "proxy",
            "--mode",
            "pull" if pull else "push",
            "--port",
            str(port),
            "--prefill",
            p.url,
            "--decode",
            d.url,
            "--prefill-engine-id",
            PREFILL_ENGINE_ID,
            "--prefill-side-port",
            str(side_p),
            "--prefill-side-host",
            placement.prefill.kv_addr,
        ],
        f"http://127.0.0.1:{port}/health",
    )
    dep.helpers.append(proxy)
    proxy.start()
    dep.front_url, dep.warm_url = f"http://127.0.0.1:{port}", d.url
