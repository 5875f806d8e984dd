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
    name = "INFO"  # as configure() was given it (a child process is given the same)


def level_name() -> str:
    """The level configure() set ("INFO" before it ran)."""
    return _Levels.name


def debug_enabled() -> bool:
    """Whether configure() lets debug lines through: hot paths skip building
    a debug call (structlog's lazy proxy costs a few calls even when filtered)."""
    return _Levels.debug


def configure(level: str = "INFO", *, json: bool | None = None, process: str = "") -> None:
    """`process` names a helper process of the coordinator on each of its
    lines ("partition-1", "front-2"), so merged logs say whose line it is."""
    as_json = (not sys.stderr.isatty()) if json is None else json
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    _Levels.debug = lvl <= logging.DEBUG
    _Levels.info = lvl <= logging.INFO
    _Levels.name = logging.getLevelName(lvl)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    named: list[structlog.typing.Processor] = [_Named(process)] if process else []
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *named,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # One write per line (the line and its newline together): the
        # coordinator's partition and front processes share its stderr, and
        # with PYTHONUNBUFFERED (as in many container images) print() writes
        # the newline on its own, so another process's line could land
        # between the two.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


class _Named:
    """A structlog processor: the process's name on each line."""

    def __init__(self, process: str) -> None:
        self._process = process

    def __call__(
        self, _logger: object, _method: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event.setdefault("process", self._process)
        return event


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
