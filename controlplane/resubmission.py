"""Resubmitted sides after a failover: which a new leader accepts. Plain
Python, no gRPC; the rendezvous state machine (rendezvous.py) applies the
verdict (docs/reliability.md, "Scheduler resubmission").

A connector's scheduler client sends a new leader again each side (decode
registration, prefill report) an earlier leader accepted and that is still
open at the engine, flagged `resubmitted`. The rules:
- Accepted (applied as a fresh report) for a transfer one of the engine's
  agents re-sent in its hello (adoption.py: the engine is in
  `Transfer.adopted_from`), or one that already ended here (the answer is
  its terminal state, as for any late side).
- Otherwise, while some agent of the engine has not said hello to this
  leader yet (within the rebuild window after it started leading), its
  hello may still re-send the transfer: UNAVAILABLE (nothing recorded, the
  client retries).
- A prefill side also waits, within the window, until the transfer's decode
  engine is known and all its agents are back: only their hellos say whether
  the transfer was written in full before the failover (HeldTransfer.ready:
  COMPLETE, adoption.py), and a prefill report does not name the decode
  engine. Without this, a prefill engine that freed its blocks after its
  WRITE would fail a transfer that had completed.
- Otherwise (every agent of the engine is back without it, or the window is
  over) no agent of the engine holds the transfer: it may have completed at
  the old leader, and the decode engine may have reused its blocks, so it is
  never ordered: FAILED, and the transfer ends here, so the other side
  learns it too.
- Within the same window any side (resubmitted or new) naming an engine none
  of whose agents has said hello yet is UNAVAILABLE too (FAILED_PRECONDITION
  after it, as always): the agents are reconnecting, and the client retries.
"""

from __future__ import annotations

import enum

from pushkv.controlplane import validation
from pushkv.controlplane.domain import Effect, EngineId, Reason, State
from pushkv.controlplane.errors import Unavailable
from pushkv.controlplane.inflight import InFlight
from pushkv.controlplane.transfer import Transfer

WHY_FAILED = (
    "resubmitted after a failover, but no agent of engine {engine} re-sent the "
    "transfer to this leader: it may have ended at the previous leader, so it is "
    "never ordered again"
)
WHY_WAIT = (
    "resubmitted after a failover before the agents of engine {engine} are back: "
    "this leader waits for their hellos for {left:.1f} s more; retry"
)
WHY_WAIT_DECODE = (
    "resubmitted after a failover before the agents of the transfer's decode engine "
    "are back (their hellos say whether it was written before the failover): this "
    "leader waits for them for {left:.1f} s more; retry"
)

# Any side (resubmitted or new) naming an engine none of whose agents said
# hello yet, within the rebuild window: they are reconnecting after the
# failover (after the window: FAILED_PRECONDITION, as on any leader).
WHY_NO_AGENTS = (
    "engine {engine} has no registered agents yet: this leader was just elected "
    "and the agents are reconnecting; retry"
)


class Verdict(enum.Enum):
    ACCEPT = "accept"  # apply the side as usual
    WAIT = "wait"  # UNAVAILABLE: the rebuild window is open
    FAIL = "fail"  # the transfer ends FAILED, never ordered

    __hash__ = object.__hash__


def verdict(
    t: Transfer | None,
    engine: EngineId,
    engine_back: bool,
    now: float,
    rebuild_until: float,
    decode_back: bool = True,
) -> Verdict:
    """What a resubmitted side of engine `engine` for transfer `t` (None:
    unknown here) gets at monotonic time `now`; `engine_back`: every agent of
    the engine has said hello to this leader; `decode_back` (a prefill side):
    the transfer's decode engine is known and every agent of it has too."""
    if t is not None and (t.state.terminal or engine in t.adopted_from):
        return Verdict.ACCEPT
    if now < rebuild_until and not (engine_back and decode_back):
        return Verdict.WAIT
    return Verdict.FAIL


def resubmitted_side(
    book: InFlight, transfer_id: str, engine: str, prefill: bool, now: float, rebuild_until: float
) -> tuple[Transfer, list[Effect]] | None:
    """A resubmitted side (`prefill`: a prefill report) at monotonic `now`:
    None if accepted (the rendezvous applies it as usual), else the transfer
    ended FAILED; raises Unavailable within the rebuild window."""
    s, registry = book.settings, book.registry
    eid = validation.engine_id(engine, field="engine_id", max_len=s.max_id_len)
    t = book.transfers.get(transfer_id)
    eng = registry.engine(eid)
    decode_back = True
    if prefill:  # only the decode engine's hellos say whether it was written
        de = registry.engine(t.decode_engine) if t and t.decode_engine else None
        decode_back = de is not None and de.ready
    back = eng is not None and eng.ready
    v = verdict(t, eid, back, now, rebuild_until, decode_back)
    if v is Verdict.ACCEPT:
        return None
    if v is Verdict.WAIT:
        left = rebuild_until - now
        if back:
            raise Unavailable(WHY_WAIT_DECODE.format(left=left))
        raise Unavailable(WHY_WAIT.format(engine=eid, left=left))
    why = WHY_FAILED.format(engine=eid)
    if t is None:  # a tombstone: the other side's report learns it ended
        tid = validation.transfer_id(transfer_id, s.max_id_len)
        return book.tombstone(tid, Reason.AGENT_LOST, why)
    return t, book.finish(t, State.FAILED, Reason.AGENT_LOST, why)
