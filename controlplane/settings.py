"""Coordinator settings: one frozen, validated object, filled by flags or environment."""

from __future__ import annotations

from dataclasses import dataclass, fields

# Settings whose 0 means "none" (every other number must be > 0).
_MAY_BE_ZERO = ("reconnect_grace_s",)


@dataclass(frozen=True, slots=True)
class CoreSettings:
    # How long one side may wait for the other (registered / prefill-done / awaiting).
    rendezvous_timeout_s: float = 60.0
    # How long an ordered transfer may take to be written and reported.
    write_timeout_s: float = 15.0
    # Agent lease; renewed by every message on the agent stream. An agent
    # posts WRITEs only within the lease of its last answered heartbeat.
    lease_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    # An agent whose stream stays open but sends nothing (its process keeps
    # its threads from running: oversubscribed cores, a C call holding the
    # GIL) is lost only after this long. Its lease still runs out at lease_s
    # (it posts nothing until a heartbeat is answered again), but its
    # transfers wait instead of failing. The stream stays open only while the
    # agent's process answers HTTP/2 keepalive pings, which gRPC's own threads
    # do without Python: a frozen or dead process is cut off, and lost, within
    # the lease (docs/reliability.md, "An agent in a process that starves it").
    # Below lease_s it counts as lease_s.
    silent_agent_s: float = 30.0
    # Terminal transfers stay queryable this long (and at most max_terminal of them).
    retention_s: float = 300.0
    max_terminal: int = 100_000
    # In-flight (non-terminal) transfers: in total and per engine.
    max_inflight: int = 20_000
    max_inflight_per_engine: int = 10_000
    # Input bounds.
    max_id_len: int = 256
    max_groups: int = 16
    max_blocks_per_group: int = 65_536
    # Block ids of one side in all its KV groups: a transfer's status, which
    # holds both sides', then fits gRPC's 4 MiB message (2 x 262,144 ids of
    # at most 5 bytes), and so do its orders between equal TPs (order_size.py).
    max_blocks_per_side: int = 262_144
    # Fail ordered transfers when an involved agent's stream closes and the
    # agent does not say hello again within reconnect_grace_s.
    fail_on_disconnect: bool = True
    # How long an agent whose stream closed may take to come back (the same
    # incarnation; its open orders are sent again). Meanwhile its engine stays
    # ready (new transfers are ordered; their orders wait for the hello); past
    # it the engine is not ready and, with fail_on_disconnect, its moving
    # transfers fail. A stream that blips (a connection reset, a proxy's idle
    # timeout, a node relay's stream) then loses nothing; a dead agent fails
    # them this much later. 0: at once. Past the lease (lease_s) the agent is
    # lost anyway.
    reconnect_grace_s: float = 1.0
    # Arm orders: when decode registers before prefill is done, send the
    # announced prefill engine's agents their orders at once; each fires its
    # own at the request's last prefill forward, with no round trip here
    # (docs/architecture.md, "Armed orders"). Off: order when both sides are in.
    arm_orders: bool = True
    # After a failover, at most how long a new leader waits for an engine's
    # agents to come back (their hellos re-send its transfers): meanwhile a
    # resubmitted side it cannot accept yet, or any side naming an engine with
    # no agent back, is answered UNAVAILABLE (retried); after it, or once the
    # engine's agents are all back, FAILED (docs/reliability.md, "Scheduler
    # resubmission"). Agents reconnect within a few seconds.
    rebuild_window_s: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            zero_ok = f.name in _MAY_BE_ZERO
            if value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"{f.name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
        if self.heartbeat_interval_s >= self.lease_s:
            raise ValueError("heartbeat_interval_s must be shorter than lease_s")
