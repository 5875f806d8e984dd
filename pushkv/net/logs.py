"""structlog setup shared by the processes pushkv owns: the coordinator, the
router and the node relay.

Every line is one JSON object on stderr (when stderr is not a terminal; a
terminal gets structlog's console lines) with the same keys in every process:
`event` (what happened, a snake_case name), `level`, `timestamp` (ISO 8601,
UTC), and where they apply `transfer_id`, `engine_id` and `rank`. Lines of
libraries that log through the standard library (aiohttp's access log,
asyncio, gRPC's Python layer, warnings) are rendered the same way, with their
`logger`, and so is an uncaught exception.

Agents run inside vLLM workers and must not call this: vLLM owns logging there.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType

import structlog


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


def info_enabled() -> bool:
    """Whether configure() lets info lines through."""
    return _Levels.info


def configure(level: str = "INFO", *, json: bool | None = None) -> None:
    as_json = (not sys.stderr.isatty()) if json is None else json
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    _Levels.debug = lvl <= logging.DEBUG
    _Levels.info = lvl <= logging.INFO
    _Levels.name = logging.getLevelName(lvl)
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
    _route_stdlib(lvl, renderer)


def _route_stdlib(lvl: int, renderer: structlog.typing.Processor) -> None:
    """The standard library's records (libraries' loggers, warnings) rendered
    like structlog's own lines, on the same stderr; StreamHandler writes each
    line with its newline in one write."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(lvl)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An exception that ends the process: one line like the others, not a
    bare traceback among them."""
    structlog.get_logger("pushkv").critical("uncaught_exception", exc_info=(kind, exc, tb))
