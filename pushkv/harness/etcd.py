"""Start a real etcd server as a child process (tests, benchmarks).

Debian's etcd-server (``/usr/bin/etcd``, 3.4; ``scripts/setup.sh`` installs
it). One member (``EtcdServer``) or a cluster of several (``EtcdCluster``) on
loopback, on free ports, with their data in temporary directories. Raft
timings are shortened (heartbeat 50 ms, election 500 ms) so that etcd grants
leases as short as 1 s (its minimum TTL is 1.5 election timeouts).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from pushkv.net.tls import TLSFiles

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# A free port is picked before etcd binds it; another process may take it in
# between. Such a start is retried on new ports, at most this many times.
PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """etcd could not bind a port picked for it: another process took it."""


class EtcdServer:
    def __init__(
        self, name: str = "pushkv-test", tls: TLSFiles | None = None, auth_token_ttl_s: int = 0
    ) -> None:
        """With `tls`: clients reach it over https only, with a certificate the
        CA signed (--client-cert-auth); `tls.cert`/`tls.key` are its own.
        `auth_token_ttl_s`: how long an auth token lives unused (etcd's
        --auth-token-ttl; 0 keeps etcd's 300 s)."""
        self.name = name
        self.tls = tls
        self.auth_token_ttl_s = auth_token_ttl_s
        self.dir = Path(tempfile.mkdtemp(prefix="pushkv-etcd-"))
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.dir / "etcd.log"
        self._log_from = 0  # where this launch's log starts
        # name=peer URL of every member; this one alone unless EtcdCluster sets it.
        self.initial_cluster = f"{name}={self.peer_url}"

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, deadline_s: float = 20.0) -> EtcdServer:
        for attempt in range(PORT_ATTEMPTS):
            try:
                self.launch()
                self.wait_healthy(deadline_s)
                return self
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                self.new_ports()
                self.initial_cluster = f"{self.name}={self.peer_url}"
        raise AssertionError("unreachable")

    def new_ports(self) -> None:
        """Other free ports and an empty data directory, for a start again."""
        self.client_port, self.peer_port = _free_port(), _free_port()
        shutil.rmtree(self.dir / "data", ignore_errors=True)

    def launch(self) -> None:
        """Start the process without waiting (cluster members need each other)."""
        cmd = [
            ETCD,
            f"--name={self.name}",
            f"--data-dir={self.dir / 'data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            "--initial-cluster-token=pushkv-test",
            "--initial-cluster-state=new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
            "--logger=zap",
        ]
        if self.auth_token_ttl_s:
            cmd.append(f"--auth-token-ttl={self.auth_token_ttl_s}")
        if self.tls:
            cmd += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_healthy(self, deadline_s: float = 20.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + deadline_s
        while not self.healthy():
            if self.proc.poll() is not None:
                with open(self.log_path, "rb") as f:
                    f.seek(self._log_from)
                    text = f.read().decode(errors="replace")
                if "address already in use" in text:
                    raise PortTaken(f"etcd could not bind its ports: {text[-500:]}")
                raise RuntimeError(f"etcd exited: {text[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"etcd not healthy within {deadline_s} s")
            time.sleep(0.05)  # polling another process's HTTP endpoint

    def healthy(self) -> bool:
        context = None
        if self.tls:  # our own certificate doubles as a client one (devpki: both uses)
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1, context=context) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def pause(self) -> None:
        """SIGSTOP: etcd stops answering (its clients' calls time out)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL: the member is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def call(self, path: str, body: dict[str, object], token: str = "") -> dict[str, object]:
        """One call on etcd's JSON gateway (plain http only), e.g. "/v3/auth/enable"."""
        headers = {"Authorization": token} if token else {}
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            doc: dict[str, object] = json.loads(r.read())
            return doc

    def enable_auth(self, root_password: str, users: dict[str, tuple[str, str, str]]) -> None:
        """Turn etcd's authentication on, with `root` and `users`: name ->
        (password, permission READ/WRITE/READWRITE, key prefix it applies to)."""
        assert not self.tls, "enable_auth uses the plain-http gateway"

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        def prefix_end(prefix: str) -> str:  # etcd's range end of a key prefix
            raw = prefix.encode()
            return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()

        self.call("/v3/auth/user/add", {"name": "root", "password": root_password})
        self.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        for name, (password, perm, prefix) in users.items():
            self.call("/v3/auth/user/add", {"name": name, "password": password})
            self.call("/v3/auth/role/add", {"name": name})
            grant = {"permType": perm, "key": b64(prefix), "range_end": prefix_end(prefix)}
            self.call("/v3/auth/role/grant", {"name": name, "perm": grant})
            self.call("/v3/auth/user/grant", {"user": name, "role": name})
        self.call("/v3/auth/enable", {})

    def status(self) -> tuple[int, int]:
        """(this member's id, the raft leader's id), from etcd's JSON gateway."""
        req = urllib.request.Request(self.url + "/v3/maintenance/status", data=b"{}")
        with urllib.request.urlopen(req, timeout=2) as r:
            doc = json.loads(r.read())
        return int(doc["header"]["member_id"]), int(doc["leader"])


class EtcdCluster:
    """`size` etcd members on loopback forming one cluster."""

    def __init__(self, size: int = 3) -> None:
        self.members = [EtcdServer(f"pushkv-test-{i}") for i in range(size)]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster

    @property
    def urls(self) -> str:
        return ",".join(m.url for m in self.members)

    def start(self, deadline_s: float = 30.0) -> EtcdCluster:
        try:
            for attempt in range(PORT_ATTEMPTS):
                try:
                    for m in self.members:
                        m.launch()
                    for m in self.members:
                        m.wait_healthy(deadline_s)
                    return self
                except PortTaken:
                    if attempt == PORT_ATTEMPTS - 1:
                        raise
                    for m in self.members:  # all again, on new ports
                        m.kill()
                        m.new_ports()
                    cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
                    for m in self.members:
                        m.initial_cluster = cluster
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")

    def live(self) -> list[EtcdServer]:
        return [m for m in self.members if m.proc is not None and m.proc.poll() is None]

    def raft_leader(self) -> EtcdServer:
        live = self.live()
        leader_id = live[0].status()[1]
        for m in live:
            if m.status()[0] == leader_id:
                return m
        raise RuntimeError("no etcd raft leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()
