"""What an agent's link logs while its coordinator cannot be reached: one
INFO line when the outage begins and one when a coordinator welcomes it
back, whatever the number of attempts between (they are DEBUG), so a
failover across a large cluster does not flood the engines' logs."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pushkv.agent.link import CoordinatorLink
from pushkv.agent.messages import Inbound
from pushkv.controlplane.server import Coordinator
from tests.support.netcut import CuttableProxy
from tests.support.sim_agent import hello

WAIT_S = 10.0
LOGGER = "pushkv.agent"


def _lines(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(LOGGER) and r.levelno == level and text in r.getMessage()
    ]


async def test_an_outage_is_two_info_lines_however_many_attempts(
    coord: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    proxy = CuttableProxy("127.0.0.1", coord.port)
    inbound: list[Inbound] = []
    link = CoordinatorLink(
        proxy.address,
        hello("p0", "prefill").hello,
        inbound.append,
        backoff_min_s=0.01,
        backoff_max_s=0.05,
    )
    try:
        link.start()
        assert await asyncio.to_thread(link.registered.wait, WAIT_S)
        proxy.cut()  # the stream ends, and every attempt is refused until restored
        deadline = time.monotonic() + WAIT_S
        while link.failed_attempts < 4:
            assert time.monotonic() < deadline, f"{link.failed_attempts} attempts"
            await asyncio.sleep(0.02)  # polling a counter under a deadline
        attempts = link.failed_attempts
        assert not link.registered.is_set()
        proxy.restore()
        assert await asyncio.to_thread(link.registered.wait, WAIT_S)
    finally:
        await asyncio.to_thread(link.stop)
        proxy.close()
    assert len(_lines(caplog, logging.INFO, "reconnecting")) == 1
    assert len(_lines(caplog, logging.DEBUG, "reconnecting")) >= attempts - 1
    [back] = _lines(caplog, logging.INFO, "welcomed by coordinator")
    n = int(back.split(" after ")[1].split(" ")[0])
    assert n >= attempts and link.failed_attempts == 0
