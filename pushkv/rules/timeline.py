"""Per-transfer timelines: the waits between stages, from a TransferStatus
(the coordinator applies the same rules to its own Transfer, controlplane/timeline.py).

The coordinator records one timeline event per stage (`Transfer.mark` in
controlplane/rendezvous.py): begun, decode_registered, prefill_finished,
prefill_done, ordered, write_posted / write_done / write_failed / write_dropped
(per prefill rank), arrived (per prefill rank), complete / failed / cancelled /
expired, released. Every time is the coordinator's clock at recording, but
prefill_finished: the prefill engine's own time for when it finished the
request (ReportPrefillDoneRequest.finished_unix_us; absent when not sent).
The status API returns them as `TransferStatus.timeline`; everything here is
derived from them, so no proto field is needed.

Waits, in seconds (None while the stages it spans have not both happened):

rendezvous_wait  prefill_done - decode_registered. Signed: > 0 means the
                 decode side registered first and waited for the prefill (the
                 case push-based transfer is built for); < 0 means the prefill
                 finished first and its KV waited for the decode registration.
order_latency    from the second of (decode_registered, prefill_done) to ordered.
write_time       from ordered to the last write_done reported.
arrival_lag      last arrived - last write_done. Signed: < 0 means the decode
                 side counted the last notification before the coordinator
                 heard the matching prefill rank's done report.
total            from the transfer's creation to its terminal state.

Everything here is pure: no clock reads, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pushkv.v1 import pushkv_pb2 as pb

# (stage, unix seconds, rank or -1)
Event = tuple[str, float, int]

WAITS = ("rendezvous_wait", "order_latency", "write_time", "arrival_lag", "total")
# The terminal states' stage names (controlplane.domain.State; a test keeps
# the two equal).
TERMINAL_STAGES = frozenset({"complete", "failed", "cancelled", "expired"})


def events_of(x: pb.TransferStatus) -> list[Event]:
    """The timeline as (stage, unix seconds, rank), in recording order."""
    return [(e.stage, e.unix_us / 1e6, e.rank) for e in x.timeline]


def created_of(x: pb.TransferStatus) -> float:
    """Creation time in unix seconds."""
    return x.created_unix_us / 1e6


def first(events: Sequence[Event], stage: str, rank: int | None = None) -> float | None:
    """Time of the first `stage` event (of `rank`, if given)."""
    for s, at, r in events:
        if s == stage and (rank is None or r == rank):
            return at
    return None


def last(events: Sequence[Event], stage: str) -> float | None:
    """Time of the latest `stage` event, any rank."""
    times = [at for s, at, _ in events if s == stage]
    return max(times) if times else None


def terminal_at(events: Sequence[Event]) -> tuple[str, float] | None:
    """(terminal stage, time), if the transfer reached one."""
    for s, at, _ in events:
        if s in TERMINAL_STAGES:
            return s, at
    return None


def per_rank(events: Sequence[Event]) -> dict[int, dict[str, float]]:
    """prefill rank -> {stage: first time} for the rank-specific stages."""
    out: dict[int, dict[str, float]] = {}
    for s, at, r in events:
        if r >= 0:
            out.setdefault(r, {}).setdefault(s, at)
    return out


@dataclass(frozen=True, slots=True)
class Waits:
    rendezvous_wait: float | None = None
    order_latency: float | None = None
    write_time: float | None = None
    arrival_lag: float | None = None
    total: float | None = None

    def get(self, name: str) -> float | None:
        if name not in WAITS:
            raise ValueError(f"unknown wait {name!r}; known: {', '.join(WAITS)}")
        value: float | None = getattr(self, name)
        return value

    def as_dict(self) -> dict[str, float | None]:
        return {n: self.get(n) for n in WAITS}


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


def waits(x: pb.TransferStatus) -> Waits:
    return waits_of(events_of(x), created_of(x))


def waits_of(ev: Sequence[Event], created: float) -> Waits:
    """The waits of a timeline whose transfer was created at `created`."""
    registered = first(ev, "decode_registered")
    prefilled = first(ev, "prefill_done")
    ordered = first(ev, "ordered")
    second = (
        max(registered, prefilled) if registered is not None and prefilled is not None else None
    )
    done = last(ev, "write_done")
    end = terminal_at(ev)
    # An armed order (no "ordered" stage) is timed from its first post: it
    # fired with the prefill's last forward, not on an order from here.
    started = ordered if ordered is not None else first(ev, "write_posted")
    return Waits(
        rendezvous_wait=_diff(prefilled, registered),
        order_latency=_diff(ordered, second),
        write_time=_diff(done, started),
        arrival_lag=_diff(last(ev, "arrived"), done),
        total=_diff(end[1], created) if end else None,
    )


def sort_by_wait(
    transfers: Sequence[pb.TransferStatus], wait: str, *, descending: bool = True
) -> list[pb.TransferStatus]:
    """Sorted by one wait (largest first by default); transfers without it go last."""
    if wait not in WAITS:
        raise ValueError(f"unknown wait {wait!r}; known: {', '.join(WAITS)}")
    keyed = [(waits(t).get(wait), t) for t in transfers]
    have = [(v, t) for v, t in keyed if v is not None]
    missing = [t for v, t in keyed if v is None]
    have.sort(key=lambda vt: vt[0], reverse=descending)
    return [t for _, t in have] + missing
