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
- Otherwise no agent of the engine holds the transfer: it may have completed
  at the old leader, and the decode engine may have reused its blocks, so it
  is never ordered. Within the rebuild window after this replica started
  leading the agents' hellos may still be on their way: UNAVAILABLE (nothing
  recorded, the client retries). After it: FAILED, and the transfer ends
  here, so the other side learns it too.
"""

from __future__ import annotations

import enum

from controlplane.domain import EngineId
from controlplane.transfer import Transfer

WHY_FAILED = (
    "resubmitted after a failover, but no agent of engine {engine} re-sent the "
    "transfer to this leader: it may have ended at the previous leader, so it is "
    "never ordered again"
)
WHY_WAIT = (
    "resubmitted after a failover before any agent of engine {engine} re-sent "
    "the transfer: this leader is rebuilding its state for {left:.1f} s more; retry"
)


class Verdict(enum.Enum):
    ACCEPT = "accept"  # apply the side as usual
    WAIT = "wait"  # UNAVAILABLE: the rebuild window is open
    FAIL = "fail"  # the transfer ends FAILED, never ordered

    __hash__ = object.__hash__


def verdict(t: Transfer | None, engine: EngineId, now: float, rebuild_until: float) -> Verdict:
    """What a resubmitted side of engine `engine` for transfer `t` (None:
    unknown here) gets at monotonic time `now`."""
    if t is not None and (t.state.terminal or engine in t.adopted_from):
        return Verdict.ACCEPT
    return Verdict.WAIT if now < rebuild_until else Verdict.FAIL
