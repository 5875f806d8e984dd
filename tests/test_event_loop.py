"""`--event-loop`: `pushkv coordinator` and `pushkv relay` run on uvloop by
default and on asyncio's own loop when asked. Real processes: each says which
loop it runs in its start log line, answers over gRPC on it, and stops on
SIGTERM with exit status 0 (its signal handler runs on that loop)."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

DEADLINE_S = 20.0


def _started(c: CoordinatorProcess, found: str) -> str:
    """The first log line containing `found`, waited for under a deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for line in c.log_text().splitlines():
            if found in line:
                return line
        time.sleep(0.05)  # polling another process's log file
    raise AssertionError(f"no {found!r} in the log within {DEADLINE_S} s:\n{c.log_text()}")


@pytest.mark.parametrize("flags", [(), ("--event-loop", "asyncio"), ("--event-loop", "uvloop")])
def test_coordinator_and_relay_run_on_the_chosen_event_loop(flags: tuple[str, ...]) -> None:
    loop = flags[1] if flags else "uvloop"
    coord = CoordinatorProcess(*flags).start()
    relay: RelayProcess | None = None
    try:
        started = json.loads(_started(coord, '"coordinator_started"'))
        assert started["event_loop"] == loop
        with grpc.insecure_channel(coord.address) as ch:
            reply = pbg.TransferServiceStub(ch).Submit(pb.SubmitRequest(), timeout=DEADLINE_S)
        assert list(reply.results) == [] and reply.term == 0  # an empty probe, answered
        relay = RelayProcess(coord.address, *flags).start()
        listening = json.loads(_started(relay, '"relay_listening"'))
        assert listening["event_loop"] == loop
    finally:
        for proc in (relay, coord):
            if proc is not None:
                proc.stop()
    assert coord.proc is not None and coord.proc.returncode == 0, coord.log_text()[-2000:]
    assert relay is not None and relay.proc is not None and relay.proc.returncode == 0


def test_an_unknown_event_loop_is_refused() -> None:
    with pytest.raises(RuntimeError, match="invalid choice: 'trio'"):
        CoordinatorProcess("--event-loop", "trio").start()
