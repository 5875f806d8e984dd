"""Start a coordinator as a child process (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Self

import grpc

from pushkv.harness.live import Live
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

# Tests only (tests/conftest.py sets it): the coordinators started here get
# --hang-dump-s from it, so a stalled one leaves its threads' stacks in its log.
COORD_HANG_DUMP_ENV = "PUSHKV_TEST_COORD_HANG_DUMP_S"


class CoordinatorProcess:
    def __init__(
        self, *flags: str, port: int = 0, log_path: str | None = None, host: str = "127.0.0.1"
    ) -> None:
        self._flags = flags
        self.host = host
        keep = os.environ.get("PUSHKV_KEEP_LOGS", "")  # kept for a post-mortem
        self._dir = Path(tempfile.mkdtemp(prefix="pushkv-coord-", dir=keep or None))
        # The object owns its folder (port file, default log): freed with it,
        # or at exit, not at stop, since a test reads the log after stopping.
        if not keep:
            weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        self._port_file = self._dir / "port"
        self._log_path = Path(log_path) if log_path else self._dir / "coordinator.log"
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        host, port = ["--host", self.host], ["--port", str(self.port)]
        dump = os.environ.get(COORD_HANG_DUMP_ENV)
        hang = ["--hang-dump-s", dump] if dump else []
        return ["coordinator", *host, *port, "--port-file", str(self._port_file), *hang]

    def start(self, timeout: float = 30.0) -> Self:
        self._port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pushkv.cli.main", *self._argv(), *self._flags]
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout
        while not self._port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[3]} exited: {self._log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{cmd[3]} did not start within {timeout} s")
            time.sleep(0.02)  # polling a file written by another process
        self.port = int(self._port_file.read_text())
        _LIVE.add(self)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: a process that stops running while its sockets stay open
        (a long pause, a frozen VM): peers see silence, not a reset."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after `freeze`."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        _LIVE.discard(self)
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen one, too
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_text(self) -> str:
        return self._log_path.read_text() if self._log_path.exists() else ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Coordinators started and not stopped (alive or exited on their own), for a
# failed test's report (tests/support/failure_report.py).
_LIVE: Live[CoordinatorProcess] = Live()


def live_coordinators() -> list[CoordinatorProcess]:
    """The coordinators started and not stopped yet, oldest first."""
    return _LIVE.items()


class RelayProcess(CoordinatorProcess):
    """`pushkv relay` as a child process: agents dial `address`, it dials `coordinators`."""

    def __init__(self, coordinators: str, *flags: str, **kw: Any) -> None:
        super().__init__("--coordinator", coordinators, *flags, **kw)

    def _argv(self) -> list[str]:
        listen = ["--listen", f"{self.host}:{self.port}"]
        return ["relay", *listen, "--port-file", str(self._port_file)]


def leadership(address: str, timeout: float = 2.0) -> pb.Leadership | None:
    """A replica's GetLeadership answer, or None while it does not answer."""
    with grpc.insecure_channel(address) as ch:
        try:
            view: pb.Leadership = pbg.StatusServiceStub(ch).GetLeadership(
                pb.GetLeadershipRequest(), timeout=timeout
            )
            return view
        except grpc.RpcError:
            return None
