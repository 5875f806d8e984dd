"""The connector's log routing (vllm_integration/logs.py): pushkv's lines get a
handler in vLLM's format once per process, unless the operator configured
logging. The engine-side check is tests/test_tp_vllm.py
(test_each_worker_rank_logs_in_the_engine_log)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from pushkv.vllm_integration import logs


@pytest.fixture
def pushkv_logger() -> Iterator[logging.Logger]:
    """The process's `pushkv` logger, bare, restored afterwards."""
    logger = logging.getLogger("pushkv")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    logger.handlers.clear()
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_lines_get_vllms_format_with_the_logger_name_once(
    pushkv_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # not used: a level is given
    logs.route_to_engine_log("info")
    logs.route_to_engine_log("debug")  # a second connector in the process: no second handler
    assert len(pushkv_logger.handlers) == 1
    assert pushkv_logger.level == logging.INFO and not pushkv_logger.propagate
    out = io.StringIO()
    handler = pushkv_logger.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(out)
    logging.getLogger("pushkv.agent").info("coordinator stream to %s ended", "h:1")
    logging.getLogger("pushkv.agent").debug("not at INFO")
    line = out.getvalue()
    assert line.count("\n") == 1
    assert " INFO " in line and "[pushkv.agent test_connector_logs.py:" in line
    assert line.startswith("(") and " pid=" in line  # the process, as vLLM's lines
    assert line.rstrip().endswith("coordinator stream to h:1 ended")


def test_without_a_level_vllms_own_is_taken(
    pushkv_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    logs.route_to_engine_log("")
    assert pushkv_logger.level == logging.WARNING


def test_an_operators_logging_is_left_alone(
    pushkv_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = logging.NullHandler()
    pushkv_logger.addHandler(theirs)
    logs.route_to_engine_log("INFO")
    assert pushkv_logger.handlers == [theirs]
    pushkv_logger.removeHandler(theirs)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    logs.route_to_engine_log("INFO")
    assert pushkv_logger.handlers == []
