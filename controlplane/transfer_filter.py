"""Which transfers a status query or a watch asks for. Plain Python, no gRPC."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pushkv.controlplane.domain import State
from pushkv.controlplane.transfer import Transfer


@dataclass(frozen=True, slots=True)
class TransferFilter:
    states: frozenset[State] = frozenset()
    engine_id: str = ""
    min_age_s: float = 0.0
    max_age_s: float = 0.0

    def matches(self, t: Transfer, now_wall: float) -> bool:
        if self.states and t.state not in self.states:
            return False
        if self.engine_id and self.engine_id not in (t.prefill_engine, t.decode_engine):
            return False
        age = now_wall - t.created_wall
        if age < self.min_age_s:
            return False
        return not (self.max_age_s and age > self.max_age_s)

    def newest(
        self, transfers: Iterable[Transfer], now_wall: float, limit: int
    ) -> tuple[list[Transfer], int]:
        """The matching transfers, newest first, at most `limit`; and how many match."""
        matching = [t for t in transfers if self.matches(t, now_wall)]
        matching.sort(key=lambda t: t.created_wall, reverse=True)
        return matching[:limit], len(matching)
