"""Fixtures shared by the test modules: an in-process coordinator (real gRPC
server, default settings) and a node relay in front of it. A module that
needs another coordinator (a child process, TLS, other settings) defines its
own `coord`, which takes precedence over this one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from controlplane.server import Coordinator, ServerSettings, start
from controlplane.settings import CoreSettings
from relay.server import Relay, RelaySettings


@pytest.fixture
async def coord() -> AsyncIterator[Coordinator]:
    c = await start(ServerSettings(port=0, core=CoreSettings()))
    yield c
    await c.stop(0)


@pytest.fixture
async def relay(coord: Coordinator) -> AsyncIterator[Relay]:
    r = await Relay(RelaySettings(coordinators=coord.address, listen="127.0.0.1:0")).start()
    yield r
    await r.stop()
