"""pushkv's log lines in the vLLM engine's log.

vLLM configures only its own `vllm` logger, so inside an engine (the
scheduler process and every worker) the `pushkv.*` loggers had no handler:
INFO lines (a stream to the coordinator lost and reconnecting, a term
followed) were dropped and warnings came out bare, without level, time or
source. The connector gives the `pushkv` logger a handler in vLLM's format,
with the logger's name so that `grep pushkv` finds every line, at the level
of `kv_connector_extra_config.log_level`, else vLLM's own.

Left alone: a `pushkv` logger that already has a handler (a logging config
the operator gave, e.g. through VLLM_LOGGING_CONFIG_PATH), and engines started
with VLLM_CONFIGURE_LOGGING=0 (the operator configures logging themselves).
"""

from __future__ import annotations

import logging
import os
import sys

# vLLM's format (vllm/logger.py: the process, e.g. "Worker_TP1", and its pid
# first), with the logger's name before the source.
FORMAT = (
    "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
    "[%(name)s %(filename)s:%(lineno)d] %(message)s"
)
DATE_FORMAT = "%m-%d %H:%M:%S"


def check_level(level: str) -> str:
    """The level name, upper-cased; ValueError for a name logging lacks."""
    name = str(level).strip().upper()
    if name not in logging.getLevelNamesMapping():
        known = [n for n in logging.getLevelNamesMapping() if n not in ("WARN", "FATAL")]
        raise ValueError(f"log_level {level!r} is not one of {sorted(known)}")
    return name


def _name_process(record: logging.LogRecord) -> bool:
    """vLLM's record factory names the process (Worker_TP1, EngineCore); the
    process's own name where it has not."""
    if not hasattr(record, "vllm_process_name"):
        record.vllm_process_name = record.processName
    return True


def route_to_engine_log(level: str = "") -> None:
    """Give the `pushkv` logger a handler on stdout (vLLM's log) at `level`
    (empty: VLLM_LOGGING_LEVEL's, INFO by default), once per process, unless
    the operator configured logging."""
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("pushkv")
    if logger.handlers:
        return  # ours from an earlier connector in this process, or the operator's
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    handler.addFilter(_name_process)
    logger.addHandler(handler)
    logger.setLevel(check_level(level or os.environ.get("VLLM_LOGGING_LEVEL", "INFO")))
    logger.propagate = False  # once, not again through a root handler
