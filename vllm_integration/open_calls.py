"""The scheduler client's open calls: what it resubmits to a new leader.

A registration (decode) or prefill report the coordinator accepted stays open
until the engine is done with the transfer: decode loaded it or gave up
(vLLM's finished_recving), prefill freed its blocks (finished_sending). The
scheduler half says so (`CoordinatorClient.settle`); a terminal answer or a
cancel closes it too. Each open call remembers the leader term that accepted
it; when the client sees a newer term (a failover), the calls accepted under
an older one are sent again with `resubmitted` set (docs/reliability.md,
"Scheduler resubmission"). Plain Python; used on the client thread only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pushkv.vllm_integration.client import Call

SIDES = ("register", "prefill_done")


class OpenCalls:
    def __init__(self) -> None:
        # (kind, transfer id) -> (the call, the term of the leader that accepted it)
        self._open: dict[tuple[str, str], tuple[Call, int]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def accepted(self, call: Call, term: int, ended: bool) -> None:
        """The coordinator of `term` accepted `call`; `ended`: the transfer is
        over (a terminal answer), so nothing is left to resubmit."""
        key = (call.kind, call.transfer_id)
        if ended:
            self._open.pop(key, None)
        else:
            self._open[key] = (call, term)

    def close(self, transfer_id: str) -> None:
        """The engine is done with the transfer (settled or cancelled)."""
        for kind in SIDES:
            self._open.pop((kind, transfer_id), None)

    def older_than(self, term: int) -> list[Call]:
        """Open calls a leader before `term` accepted: to resubmit."""
        return [c for c, t in self._open.values() if t < term]

    def drop(self, calls: Iterable[Call]) -> None:
        for c in calls:
            self._open.pop((c.kind, c.transfer_id), None)

    def transfer_ids(self) -> set[str]:
        return {tid for _, tid in self._open}
