"""A leader's etcd lease, also kept alive from a thread of its own (election.py).

The event loop that leads also serves every agent stream. Saturated, it runs
its timers late, a second or more under a profiler here; a keep-alive that
waits on it lets the lease lapse, the leader steps down, a standby takes the
same load, and the leadership flaps. The keeper renews the lease on a
synchronous channel from its own thread, so a busy loop keeps its lease.

It renews only while the loop is alive: `LoopPulse` is stamped by a task on
the loop, and a pulse older than `stall_limit_s` stops the renewals, so a
wedged loop still loses the lease and a standby takes over (after the limit
plus the TTL).

It is a second renewer, not the owner of the session: the loop's own
keep-alive (election._lead) stays, with the endpoint switching, the token
renewal and the check that the election key is still ours. The keeper reads
the current endpoint and token from the election at each renewal, reports a
renewal through `on_renewed(valid_until)` (a float kept under the GIL) and a
lease etcd no longer has through `on_expired` (called on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from aetcd import rpc

from pushkv.controlplane.leadership import LOOP_STALL_LIMIT_S

log = structlog.get_logger("pushkv.coordinator")

# How often the loop stamps its pulse.
PULSE_S = 0.1

# (target HOST:PORT, metadata) of the election's current connection.
Where = Callable[[], tuple[str, tuple[tuple[str, str], ...]]]


class LoopPulse:
    """When the loop last ran a timer on time (monotonic seconds)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    async def run(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(PULSE_S)


class LeaseKeeper:
    """Renews one lease every `interval_s` until stopped (one thread, its owner)."""

    def __init__(
        self,
        lease_id: int,
        where: Where,
        creds: grpc.ChannelCredentials | None,
        pulse: LoopPulse,
        *,
        interval_s: float,
        call_timeout_s: float,
        on_renewed: Callable[[float], None],
        on_expired: Callable[[], None],
        stall_limit_s: float = LOOP_STALL_LIMIT_S,
    ) -> None:
        self._lease_id = lease_id
        self._where = where
        self._creds = creds
        self._pulse = pulse
        self._interval_s = interval_s
        self._call_timeout_s = call_timeout_s
        self._on_renewed = on_renewed
        self._on_expired = on_expired
        self.stall_limit_s = stall_limit_s
        self._stop = threading.Event()
        self._call: Any = None  # the keep-alive in flight, cancelled by stop()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None  # the LeaseStub on _channel
        self._target = ""
        self.renewals = 0  # counted for the tests and the log
        self.skipped = 0  # renewals not made: the loop was stalled
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-lease-{lease_id:x}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Returns at once; the thread ends within a call's deadline, closing
        its channel itself."""
        self._stop.set()
        call = self._call
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        stalled = False
        try:
            while not self._stop.wait(self._interval_s):
                lag = time.monotonic() - self._pulse.last
                if lag > self.stall_limit_s:
                    self.skipped += 1
                    if not stalled:
                        log.error(
                            "event_loop_stalled",
                            lag_s=round(lag, 2),
                            detail="the lease is left to lapse: a standby takes over",
                        )
                    stalled = True
                    continue
                stalled = False
                if not self._renew():
                    return
        finally:
            self._close()

    def _renew(self) -> bool:
        """One keep-alive; False once etcd says the lease is gone."""
        target, metadata = self._where()
        stub = self._stub_to(target)
        sent = time.monotonic()
        try:
            self._call = call = stub.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=self._lease_id)]),
                timeout=self._call_timeout_s,
                metadata=metadata,
            )
            reply = next(call, None)
            call.cancel()
        except grpc.RpcError:
            return True  # transient: the loop's own keep-alive handles errors
        finally:
            self._call = None
        if self._stop.is_set() or reply is None:
            return True
        if reply.TTL <= 0:
            self._on_expired()
            return False
        self.renewals += 1
        self._on_renewed(sent + float(reply.TTL))
        return True

    def _stub_to(self, target: str) -> Any:
        if self._channel is None or target != self._target:
            self._close()
            self._target = target
            self._channel = (
                grpc.secure_channel(target, self._creds)
                if self._creds
                else grpc.insecure_channel(target)
            )
            self._stub = rpc.LeaseStub(self._channel)
        return self._stub

    def _close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
