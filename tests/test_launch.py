"""pushkv.harness.vllm_server.free_port: ports for servers that tests and benchmarks start."""

from __future__ import annotations

import random
import socket

import pytest

from pushkv.harness import vllm_server as launch
from pushkv.harness.vllm_server import free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    lo, _hi = launch._ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < lo  # no bind(0) or outgoing connection is given it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # A port free now (bound and let go: never connected, so not in
        # TIME_WAIT); not taken + 1, which another process may hold.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        low, high = min(taken, free), max(taken, free)
        # The only candidates are the taken port and the free one.
        monkeypatch.setattr(launch, "_ephemeral_range", lambda: (high + 1000, 65535))
        # launch draws its candidates with the random module's sample.
        monkeypatch.setattr(random, "sample", lambda _r, _k: [taken, free])
        assert free_port(low=low) == free


def test_without_room_below_the_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_lo, real_hi = launch._ephemeral_range()
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (10500, 60999))
    port = free_port()  # 10000-10499: too few to draw from
    assert real_lo <= port <= real_hi  # the kernel's own choice
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
