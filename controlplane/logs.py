"""The coordinator's log lines: the structlog setup it shares with the router
and the relay (pushkv/net/logs.py, re-exported here), and one line per
transfer outcome.

Agents run inside vLLM workers and must not call configure: vLLM owns logging there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from pushkv.net.logs import configure, debug_enabled, info_enabled, level_name

__all__ = ["TransferLog", "configure", "debug_enabled", "level_name"]

if TYPE_CHECKING:
    from pushkv.controlplane.transfer import Transfer


class TransferLog:
    """One log line per transfer outcome (and per late release), with its ids."""

    _STAGES = frozenset({"complete", "failed", "cancelled", "expired", "released"})

    def __init__(self, alive: Callable[[str], bool]) -> None:
        from pushkv.controlplane.timeline import TimelineCursor

        self._cursor = TimelineCursor(alive)
        self._log = structlog.get_logger("pushkv.coordinator")

    def on_transfer_changed(self, t: Transfer) -> None:
        if not t.state.terminal or not info_enabled():
            return  # every logged stage is terminal (the cursor catches up later)
        _, events = self._cursor.new_events(t)
        for stage, _wall, _rank in events:
            if stage not in self._STAGES:
                continue
            self._log.info(
                "transfer_" + stage,
                transfer_id=t.transfer_id,
                state=t.state.value,
                reason=t.reason.value,
                detail=t.detail,
                prefill_engine=t.prefill_engine,
                decode_engine=t.decode_engine,
                write_may_land=t.write_may_land,
            )
