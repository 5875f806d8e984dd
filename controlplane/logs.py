"""structlog setup for processes pushkv owns (coordinator, router, demo).

Agents run inside vLLM workers and must not call this: vLLM owns logging there.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from pushkv.controlplane.transfer import Transfer


class _Levels:
    # Until configure() says otherwise (structlog's default logs everything).
    debug = True
    info = True


def debug_enabled() -> bool:
    """Whether configure() lets debug lines through: hot paths skip building
    a debug call (structlog's lazy proxy costs a few calls even when filtered)."""
    return _Levels.debug


def configure(level: str = "INFO", *, json: bool | None = None) -> None:
    as_json = (not sys.stderr.isatty()) if json is None else json
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    _Levels.debug = lvl <= logging.DEBUG
    _Levels.info = lvl <= logging.INFO
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # One write per line (the line and its newline together): with
        # PYTHONUNBUFFERED (as in many container images) print() writes the
        # newline on its own, so another process sharing the stderr (a
        # supervisor's pipe) could land a line between the two.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


class TransferLog:
    """One log line per transfer outcome (and per late release), with its ids."""

    _STAGES = frozenset({"complete", "failed", "cancelled", "expired", "released"})

    def __init__(self, alive: Callable[[str], bool]) -> None:
        from pushkv.controlplane.timeline import TimelineCursor

        self._cursor = TimelineCursor(alive)
        self._log = structlog.get_logger("pushkv.coordinator")

    def on_transfer_changed(self, t: Transfer) -> None:
        if not t.state.terminal or not _Levels.info:
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
