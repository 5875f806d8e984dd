"""Which replica may order transfers: the gate in front of the write services.

A coordinator started without ``--etcd`` is the single in-memory coordinator:
its gate is always open (role SINGLE). With ``--etcd`` (controlplane/election.py)
the gate opens only while this replica holds the election key in etcd, and a
standby refuses every write RPC with ``NotLeader`` (UNAVAILABLE, naming the
leader: controlplane/status_map.py). Read RPCs (StatusService) always pass.

Plain Python, no etcd and no gRPC: the election at the edge drives it, the
interceptor and the health service read it.
"""

from __future__ import annotations

import enum
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

# Trailing metadata key of a refusal: the leader's advertised HOST:PORT (empty
# while no leader is known). Clients read it (pushkv/net/leader.py) to move there.
LEADER_METADATA_KEY = "pushkv-leader"

# The services only the leader serves (every RPC in them orders, records or
# streams orders). StatusService is served by every replica.
WRITE_SERVICES = ("/pushkv.v1.AgentService/", "/pushkv.v1.TransferService/")


class Role(enum.Enum):
    SINGLE = "single"  # no election: always serving (the embedded default)
    LEADER = "leader"
    STANDBY = "standby"


class NotLeader(Exception):
    """A write RPC reached a replica that does not lead (or no longer does).

    Not a PushKVError: those live in the compiled core, and this one belongs to
    the edge (status_map.py maps it on its own)."""

    def __init__(self, leader: str, term: int) -> None:
        where = f"the leader is {leader} (term {term})" if leader else "no leader is elected yet"
        super().__init__(f"this coordinator replica is a standby: {where}")
        self.leader = leader
        self.term = term


class StaleTerm(NotLeader):
    """An agent has seen a newer leader than this one (its hello's term is
    higher): this replica's leadership is over even if it does not know yet."""

    def __init__(self, term: int, agent_term: int) -> None:
        super().__init__("", term)
        self.args = (
            f"this coordinator leads term {term}, but the agent has seen term "
            f"{agent_term}: a newer leader exists",
        )


@dataclass(frozen=True, slots=True)
class View:
    role: Role
    leader: str = ""  # the leader's advertised address ("" = unknown)
    term: int = 0  # the leader's etcd create revision of the election key
    advertise: str = ""
    etcd: str = ""


class Leadership:
    """The replica's current view; `on_change` callbacks run on every change."""

    def __init__(self, view: View | None = None) -> None:
        self._view = view or View(Role.SINGLE)
        # Monotonic time after which this replica must not send an order (its
        # etcd lease could be near its end); infinite for the single coordinator.
        self._order_deadline = math.inf if self._view.role is Role.SINGLE else 0.0
        self.on_change: list[Callable[[View], None]] = []

    @property
    def view(self) -> View:
        return self._view

    @property
    def serving_writes(self) -> bool:
        return self._view.role is not Role.STANDBY

    def may_order(self) -> bool:
        """Whether an order may go out now: leading, and within the lease."""
        return self._view.role is not Role.STANDBY and time.monotonic() < self._order_deadline

    def extend(self, order_deadline: float) -> None:
        """A renewed lease: orders may go out until `order_deadline` (monotonic)."""
        if self._view.role is Role.LEADER:
            self._order_deadline = max(self._order_deadline, order_deadline)

    def update(self, view: View, *, order_deadline: float = 0.0) -> None:
        self._order_deadline = math.inf if view.role is Role.SINGLE else order_deadline
        if view == self._view:
            return
        self._view = view
        for cb in list(self.on_change):
            cb(view)

    def check_write(self, method: str) -> None:
        """Raise NotLeader if `method` is a write RPC and this replica is a standby."""
        if self._view.role is Role.STANDBY and method.startswith(WRITE_SERVICES):
            raise NotLeader(self._view.leader, self._view.term)


# The election key of the replicas started without --cell (one cell per etcd).
DEFAULT_KEY = "/pushkv/coordinator/leader"
# A cell's name (--cell): a DNS label (lower-case letters, digits and inner
# dashes, at most 63), so that it reads the same in its key, a log line and
# a pod's name, and no name can reach into another cell's key.
_CELL_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def election_key(cell: str = "") -> str:
    """The etcd key the replicas of `cell` campaign on: /pushkv/cells/CELL/leader,
    or DEFAULT_KEY without a cell. Cells on one etcd share nothing else: each
    has its own leader, term and engines (docs/operations.md, "Coordinator
    cells")."""
    if not cell:
        return DEFAULT_KEY
    if not _CELL_NAME.fullmatch(cell):
        raise ValueError(
            f"--cell {cell!r}: a cell's name is a DNS label (a-z, 0-9 and '-', "
            "at most 63, starting and ending with a letter or digit)"
        )
    return f"/pushkv/cells/{cell}/leader"


# A loop whose pulse is older than this gets no more renewals from the lease
# keeper (lease_keeper.py); the default of --loop-stall-limit-s.
LOOP_STALL_LIMIT_S = 5.0


@dataclass(frozen=True, slots=True)
class ElectionSettings:
    # etcd client URLs (http://HOST:PORT), comma-separated: tried in turn.
    etcd: str
    # This replica's address as clients dial it (HOST:PORT); standbys name it.
    advertise: str
    # Requested TTL of the replica's etcd lease (whole seconds; etcd may grant
    # more: its minimum is 1.5 election timeouts). Failover takes about one TTL.
    lease_s: int = 2
    # How often a standby tries to take the election key.
    poll_s: float = 0.1
    key: str = DEFAULT_KEY
    # TLS to etcd (https:// endpoints): the CA that signs etcd's certificate,
    # and this replica's client certificate and key where etcd requires one
    # (--client-cert-auth). PEM file paths; all empty for http://.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # etcd user/password authentication (etcd `auth enable`): the user, and a
    # file holding its password (a mounted secret, never a command-line
    # argument); both empty where etcd's auth is off.
    user: str = ""
    password_file: str = ""
    # A leader's lease is renewed from a thread of its own while its event
    # loop has run within this long (controlplane/lease_keeper.py); a loop
    # stalled longer lets the lease expire, and a standby leads.
    loop_stall_limit_s: float = LOOP_STALL_LIMIT_S

    def __post_init__(self) -> None:
        if self.lease_s < 1:
            raise ValueError(f"lease_s must be >= 1, got {self.lease_s}")
        if self.loop_stall_limit_s <= 0:
            raise ValueError(f"loop_stall_limit_s must be > 0, got {self.loop_stall_limit_s}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")
        if not self.advertise or ":" not in self.advertise:
            raise ValueError(f"advertise must be HOST:PORT, got {self.advertise!r}")
        secure = etcd_tls(self.etcd)  # raises on a bad URL
        if secure and not self.tls_ca:
            raise ValueError(
                "https:// etcd endpoints need --etcd-ca (the CA of etcd's certificate)"
            )
        if not secure and (self.tls_ca or self.tls_cert or self.tls_key):
            raise ValueError("--etcd-ca/--etcd-cert/--etcd-key need https:// etcd endpoints")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--etcd-cert and --etcd-key go together")
        if bool(self.user) != bool(self.password_file):
            raise ValueError("--etcd-user and --etcd-password-file go together")


def _urls(text: str) -> list[tuple[str, str, int]]:
    out = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        url = urlsplit(part if "://" in part else "http://" + part)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"etcd endpoint {part!r}: expected http://HOST:PORT or https://")
        out.append((url.scheme, url.hostname, url.port or 2379))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def endpoints(text: str) -> list[tuple[str, int]]:
    """``http://h:2379,http://h2:2379`` (or https://) as [(host, port), ...]."""
    return [(host, port) for _, host, port in _urls(text)]


def etcd_tls(text: str) -> bool:
    """Whether the endpoints are https:// (all of them: a mix is refused)."""
    schemes = {scheme for scheme, _, _ in _urls(text)}
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints mix http:// and https://: {text!r}")
    return schemes == {"https"}
