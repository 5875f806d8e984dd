"""A two-node link emulation: two network namespaces, a rate-capped veth pair
between them, and an uncapped management link from each to the host.

Topology (``tag`` is random per link, so parallel runs never collide)::

      host (root namespace)                          coordinator, router, test
       | pm<tag>a 10.78.K.1            pm<tag>b 10.78.K+1.1 |    (management:
       |                                                    |     uncapped)
   [ns pkv-<tag>-a]  pn<tag>a 10.78.K.2      [ns pkv-<tag>-b]  pn<tag>b 10.78.K+1.2
       pk<tag>a 10.77.0.1/24  ===== veth, tc tbf =====  pk<tag>b 10.77.0.2/24
                               (the KV link, capped both ways)

* The KV link carries NIXL/UCX over TCP only: processes in the namespaces set
  ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` to their end of it
  (:meth:`TwoNodeLink.ucx_env`).  Its rate is capped on the egress of each end
  by a token-bucket filter, so each direction gets ``rate`` on its own.
* Control traffic (gRPC to the coordinator, the host's pipes) stays off the
  capped link: the coordinator listens on the host end of namespace A's
  management link (:attr:`TwoNodeLink.coordinator_host`), and each namespace
  has a /32 route to that one address and to nothing else on the host.  Real
  clusters carry KV over a dedicated RDMA NIC; the control plane's few bytes
  should not queue behind KV in the emulated NIC's token bucket.
* No address is reachable beyond the host: the host does not forward
  (``net.ipv4.ip_forward`` is not touched), and the namespaces have no default
  route.

Processes run inside a namespace through ``ip netns exec``, which also mounts
that namespace's ``/sys`` (UCX's TCP transport lists its devices from
``/sys/class/net``).  :class:`NetnsKVHost` is a :class:`~harness.kvhost.KVHost`
whose process runs in a namespace, driven over an inherited socket.

Needs root and iproute2 (``ip``, ``tc``); :func:`check_available` says why not.
Everything is torn down on exit, on failure included (:meth:`TwoNodeLink.close`
deletes the namespaces, which deletes their veth ends and qdiscs with them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pushkv.harness.kvhost import HostSpec, KVHost

NS_PREFIX = "pkv-"
KV_NET = "10.77.0"
MGMT_NET = "10.78"
#: The default rate of the KV link: see docs/benchmarks.md, "The emulated two-node link".
DEFAULT_RATE_BIT = 1_000_000_000
#: tbf: the bucket holds at least one 64 KiB GSO packet (veth hands the qdisc
#: whole TSO/GSO segments) and at least 1 ms of the rate.
MIN_BURST_B = 64 * 1024 + 2 * 1514
#: tbf: the longest a packet waits in the queue; the queue limit is
#: rate x latency + burst.  5 ms: enough to keep TCP busy over a veth's few-µs
#: RTT, without a long standing queue in front of the last notification.
DEFAULT_TBF_LATENCY_MS = 5.0


class LinkUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, ...)."""


def check_available() -> None:
    """Raise :class:`LinkUnavailable` with the reason if namespaces cannot be made."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(
            f"the two-node link needs iproute2: {', '.join(missing)} not found on PATH"
        )
    if os.geteuid() != 0:
        raise LinkUnavailable(
            "the two-node link needs root (it creates network namespaces, veth pairs and "
            f"tc qdiscs); running as uid {os.geteuid()}"
        )


def _run(*cmd: str, netns: str = "") -> str:
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    res = subprocess.run(full, capture_output=True, text=True, timeout=30, check=False)
    if res.returncode != 0:
        raise LinkUnavailable(
            f"{' '.join(full)} failed ({res.returncode}): {res.stderr.strip() or res.stdout}"
        )
    return res.stdout


def parse_rate(text: str) -> int:
    """'1gbit', '500mbit', '2.5gbit', '1000000000' -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(?:bit)?(?:/s)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (e.g. 1gbit, 500mbit)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]
    bits = int(float(m.group(1)) * scale)
    if bits <= 0:
        raise ValueError(f"rate must be positive: {text!r}")
    return bits


def format_rate(bits: int) -> str:
    if bits % 10**9 == 0:
        return f"{bits // 10**9}gbit"
    if bits % 10**6 == 0:
        return f"{bits // 10**6}mbit"
    return f"{bits}bit"


@dataclass(frozen=True, slots=True)
class QdiscStats:
    """tc's counters of a KV link end's qdisc (its egress)."""

    bytes: int
    packets: int
    drops: int
    overlimits: int


@dataclass(frozen=True, slots=True)
class Side:
    netns: str
    kv_dev: str
    kv_addr: str
    mgmt_dev: str  # inside the namespace
    mgmt_addr: str
    host_dev: str  # the management link's host end
    host_addr: str


class TwoNodeLink:
    """Context manager: the namespaces, links and qdiscs exist inside ``with``."""

    def __init__(
        self,
        rate_bit: int = DEFAULT_RATE_BIT,
        *,
        latency_ms: float = DEFAULT_TBF_LATENCY_MS,
        tag: str = "",
    ) -> None:
        if rate_bit <= 0:
            raise ValueError("rate_bit must be positive")
        self.rate_bit = rate_bit
        self.burst_b = max(MIN_BURST_B, rate_bit // 8 // 1000)  # >= 1 ms of the rate
        self.latency_ms = latency_ms
        self.tag = tag or secrets.token_hex(3)
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.tag):
            raise ValueError("tag: 1-8 of [0-9a-z] (interface names are at most 15 bytes)")
        self.a: Side | None = None
        self.b: Side | None = None
        self._created_ns: list[str] = []
        self._created_dev: list[str] = []

    # ------------------------------------------------------------ set up / tear down
    def open(self) -> Self:
        check_available()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _mgmt_subnets(self) -> tuple[int, int]:
        """Two free third octets of 10.78.x.0 for the management links' host ends."""
        used = {
            int(m.group(1))
            for m in re.finditer(rf"inet {re.escape(MGMT_NET)}\.(\d+)\.", _run("ip", "-o", "addr"))
        }
        free = [k for k in range(0, 254, 2) if k not in used and k + 1 not in used]
        if not free:
            raise LinkUnavailable(f"no free {MGMT_NET}.x.0 subnet for the management links")
        k = free[secrets.randbelow(len(free))]
        return k, k + 1

    def _build(self) -> None:
        t = self.tag
        ka, kb = self._mgmt_subnets()
        self.a = Side(
            f"{NS_PREFIX}{t}-a",
            f"pk{t}a",
            f"{KV_NET}.1",
            f"pn{t}a",
            f"{MGMT_NET}.{ka}.2",
            f"pm{t}a",
            f"{MGMT_NET}.{ka}.1",
        )
        self.b = Side(
            f"{NS_PREFIX}{t}-b",
            f"pk{t}b",
            f"{KV_NET}.2",
            f"pn{t}b",
            f"{MGMT_NET}.{kb}.2",
            f"pm{t}b",
            f"{MGMT_NET}.{kb}.1",
        )
        for side in (self.a, self.b):
            _run("ip", "netns", "add", side.netns)
            self._created_ns.append(side.netns)
            _run("ip", "link", "set", "lo", "up", netns=side.netns)
        # The KV link: both ends straight into their namespaces.
        _run(
            "ip",
            "link",
            "add",
            self.a.kv_dev,
            "netns",
            self.a.netns,
            "type",
            "veth",
            "peer",
            "name",
            self.b.kv_dev,
            "netns",
            self.b.netns,
        )
        for side in (self.a, self.b):
            _run("ip", "addr", "add", f"{side.kv_addr}/24", "dev", side.kv_dev, netns=side.netns)
            _run("ip", "link", "set", side.kv_dev, "up", netns=side.netns)
            _run(
                "tc",
                "qdisc",
                "add",
                "dev",
                side.kv_dev,
                "root",
                "tbf",
                "rate",
                f"{self.rate_bit}bit",
                "burst",
                str(self.burst_b),
                "latency",
                f"{self.latency_ms}ms",
                netns=side.netns,
            )
        # The management links: host end in the root namespace.
        coord = self.coordinator_host
        for side in (self.a, self.b):
            _run(
                "ip",
                "link",
                "add",
                side.host_dev,
                "type",
                "veth",
                "peer",
                "name",
                side.mgmt_dev,
                "netns",
                side.netns,
            )
            self._created_dev.append(side.host_dev)
            _run("ip", "addr", "add", side.host_addr, "peer", side.mgmt_addr, "dev", side.host_dev)
            _run("ip", "link", "set", side.host_dev, "up")
            _run(
                "ip",
                "addr",
                "add",
                side.mgmt_addr,
                "peer",
                side.host_addr,
                "dev",
                side.mgmt_dev,
                netns=side.netns,
            )
            _run("ip", "link", "set", side.mgmt_dev, "up", netns=side.netns)
            if coord != side.host_addr:
                _run(
                    "ip",
                    "route",
                    "add",
                    f"{coord}/32",
                    "via",
                    side.host_addr,
                    "dev",
                    side.mgmt_dev,
                    netns=side.netns,
                )

    def close(self) -> None:
        """Delete everything this link made; safe to call twice and after a failed open."""
        errors: list[str] = []
        for ns in reversed(self._created_ns):
            # Kill what still runs inside (its processes keep the namespace alive).
            with contextlib.suppress(Exception):
                pids = _run("ip", "netns", "pids", ns).split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), 9)
            res = subprocess.run(
                ["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30, check=False
            )
            if res.returncode != 0 and ns in namespaces():
                errors.append(f"ip netns del {ns}: {res.stderr.strip()}")
        self._created_ns.clear()
        for dev in self._created_dev:  # gone with its peer's namespace, normally
            if Path(f"/sys/class/net/{dev}").exists():
                subprocess.run(
                    ["ip", "link", "del", dev], capture_output=True, timeout=30, check=False
                )
        self._created_dev.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------ use
    def _sides(self) -> tuple[Side, Side]:
        if self.a is None or self.b is None:
            raise RuntimeError("the link is not open")
        return self.a, self.b

    @property
    def coordinator_host(self) -> str:
        """The host address that both namespaces reach the coordinator at."""
        return self._sides()[0].host_addr

    def side(self, name: str) -> Side:
        a, b = self._sides()
        return {"a": a, "b": b}[name]

    def ucx_env(self, name: str) -> dict[str, str]:
        """UCX over TCP on the KV link's end in namespace ``name`` ("a" or "b")."""
        s = self.side(name)
        return {
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": s.kv_dev,
            "NIXL_LOG_LEVEL": "WARN",
            "UCX_LOG_LEVEL": "error",
        }

    def line_time_s(self, nbytes: int) -> float:
        """Seconds that ``nbytes`` of payload take at the link's rate."""
        return nbytes * 8 / self.rate_bit

    def qdisc_stats(self, name: str) -> QdiscStats:
        """tc's counters of the tbf on the KV end in namespace ``name`` (its egress)."""
        s = self.side(name)
        raw = json.loads(_run("tc", "-s", "-j", "qdisc", "show", "dev", s.kv_dev, netns=s.netns))
        tbf = [q for q in raw if q.get("kind") == "tbf"]
        if not tbf:
            raise RuntimeError(f"no tbf qdisc on {s.kv_dev} in {s.netns}: {raw}")
        q = tbf[0]
        return QdiscStats(int(q["bytes"]), int(q["packets"]), int(q["drops"]), int(q["overlimits"]))

    def popen(
        self, name: str, cmd: Sequence[str], *, env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` inside namespace ``name`` (through ``ip netns exec``)."""
        s = self.side(name)
        full_env = {**os.environ, **self.ucx_env(name), **(env or {})}
        return subprocess.Popen(["ip", "netns", "exec", s.netns, *cmd], env=full_env, **kw)


def namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows."""
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# --------------------------------------------------------------------------- processes


class NetnsProcess:
    """A Python function run in a namespace, given a :class:`Connection` to its parent.

    The child runs ``python -m pushkv.harness.netns_entry FD``, receives
    ``(module, function, args)`` and calls ``module.function(conn, *args)``.
    Quacks like the bits of :class:`multiprocessing.Process` that KVHost uses.
    """

    def __init__(
        self,
        link: TwoNodeLink,
        side: str,
        target: str,
        args: tuple[Any, ...] = (),
        *,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
    ) -> None:
        self._link = link
        self._side = side
        self._target = target
        self._args = args
        self._env = env
        self._log_path = log_path
        parent, child = socket.socketpair()
        self.conn = Connection(parent.detach())
        self._child_sock = child
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        fd = self._child_sock.fileno()
        module, _, func = self._target.partition(":")
        log = open(self._log_path, "ab") if self._log_path else None  # noqa: SIM115
        try:
            self._proc = self._link.popen(
                self._side,
                [sys.executable, "-m", "pushkv.harness.netns_entry", str(fd)],
                env=self._env,
                pass_fds=(fd,),
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
            )
        finally:
            if log is not None:
                log.close()
            self._child_sock.close()
        self.conn.send((module, func, self._args))

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)

    def kill(self) -> None:
        if self.is_alive():
            assert self._proc is not None
            self._proc.kill()

    @property
    def exitcode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()


def kvhost_main(conn: Connection, spec: HostSpec, env: dict[str, str]) -> None:
    """The KV host child, entered in a namespace."""
    from pushkv.harness.kvhost import _child

    _child(spec, conn, env)


class NetnsKVHost(KVHost):
    """A :class:`KVHost` whose process runs in one of the link's namespaces.

    Its agent speaks UCX over TCP on the KV link; its gRPC goes to
    ``spec.coordinator``, which should be ``link.coordinator_host:port``.
    """

    def __init__(
        self,
        spec: HostSpec,
        link: TwoNodeLink,
        side: str,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(spec, env)
        self._conn.close()  # the pipe of the multiprocessing child is not used
        full_env = link.ucx_env(side) | (env or {})
        proc = NetnsProcess(link, side, "pushkv.harness.netlink:kvhost_main", (spec, full_env))
        self._conn = proc.conn
        self.process = proc  # type: ignore[assignment]


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        time.sleep(0.01)  # polling state owned by another process
