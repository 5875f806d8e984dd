"""Start a real etcd server as a child process (tests, benchmarks).

Debian's etcd-server (``/usr/bin/etcd``, 3.4; ``scripts/setup.sh`` installs
it). One member on loopback, on free ports, with its data in a temporary
directory. Raft timings are shortened (heartbeat 50 ms, election 500 ms) so
that etcd grants leases as short as 1 s (its minimum TTL is 1.5 election
timeouts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EtcdServer:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pushkv-etcd-"))
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.dir / "etcd.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, deadline_s: float = 20.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            ETCD,
            "--name=pushkv-test",
            f"--data-dir={self.dir / 'data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pushkv-test={peer}",
            "--initial-cluster-state=new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
            "--logger=zap",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + deadline_s
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"etcd not healthy within {deadline_s} s")
            time.sleep(0.05)  # polling another process's HTTP endpoint
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
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
