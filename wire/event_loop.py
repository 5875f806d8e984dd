"""Which asyncio event loop a server runs on (`--event-loop`), for its start log."""

from __future__ import annotations

import asyncio


def event_loop_name() -> str:
    """The running event loop's package: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
