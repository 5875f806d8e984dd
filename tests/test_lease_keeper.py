"""A leader's etcd lease outlives a stalled event loop, and a wedged loop still
hands over (controlplane/lease_keeper.py).

A real etcd (1 s leases, tests/support/etcd.py), the real election on an event
loop of its own thread, and a real stall: a callback that blocks that loop
until the test releases it, as a saturated or paused loop runs nothing else.
The key is read from etcd itself; waits are polls under deadlines.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pushkv.controlplane.election import EtcdElection
from pushkv.controlplane.leadership import ElectionSettings, Leadership, Role
from tests.support.etcd import EtcdServer, etcd, require_etcd  # noqa: F401  (the fixture)

pytestmark = pytest.mark.faults

KEY = "/pushkv/test/lease-keeper"
DEADLINE_S = 20.0


def key_lease(server: EtcdServer) -> int:
    """The lease the election key is bound to in etcd (0: no key)."""
    doc = server.call("/v3/kv/range", {"key": base64.b64encode(KEY.encode()).decode()})
    kvs = doc.get("kvs") or []
    assert isinstance(kvs, list)
    return int(kvs[0].get("lease", 0)) if kvs else 0


def poll(cond: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(0.02)  # polling etcd and another thread under a deadline


class Replica:
    """One election on an event loop in its own thread."""

    def __init__(self, url: str, stall_limit_s: float) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.leadership = Leadership()
        self.lost: list[str] = []
        settings = ElectionSettings(
            etcd=url, advertise="127.0.0.1:1", lease_s=1, key=KEY, loop_stall_limit_s=stall_limit_s
        )
        self.election = EtcdElection(settings, self.leadership, self.lost.append)
        self._run: asyncio.Task[None] = asyncio.run_coroutine_threadsafe(
            self._start(), self.loop
        ).result(DEADLINE_S)

    async def _start(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.election.run())

    async def _stop(self) -> None:
        self._run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._run

    def on_loop(self, fn: Callable[[], object]) -> object:
        """`fn` run on the loop: returns once the loop runs again."""

        async def call() -> object:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(DEADLINE_S)

    def block(self, release: threading.Event) -> None:
        """The loop runs nothing else until `release` is set (or the deadline)."""
        self.loop.call_soon_threadsafe(release.wait, DEADLINE_S * 2)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.election.resign(), self.loop).result(5)
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@contextlib.contextmanager
def leader(server: EtcdServer, stall_limit_s: float) -> Iterator[Replica]:
    r = Replica(server.url, stall_limit_s)
    try:
        poll(lambda: r.leadership.view.role is Role.LEADER, "the replica leads")
        yield r
    finally:
        r.close()


def test_a_stalled_loop_keeps_its_lease_and_its_leadership(etcd: EtcdServer) -> None:  # noqa: F811
    with leader(etcd, stall_limit_s=30.0) as r:
        lease = key_lease(etcd)
        assert lease != 0
        ttl = r.election._ttl
        term = r.leadership.view.term
        keeper = r.election._keeper
        assert keeper is not None
        release = threading.Event()
        r.block(release)
        renewed = keeper.renewals
        # Three TTLs of a loop that runs nothing: no keep-alive of its own.
        end = time.monotonic() + 3 * ttl + 0.5
        try:
            while time.monotonic() < end:
                assert key_lease(etcd) == lease, "the lease lapsed while the loop stalled"
                time.sleep(0.05)  # watching etcd across the stall
            assert keeper.renewals > renewed
        finally:
            release.set()
        view = r.on_loop(lambda: (r.leadership.view, r.leadership.may_order()))
        assert view == (r.leadership.view, True)
        assert r.leadership.view.role is Role.LEADER and r.leadership.view.term == term
        assert not r.election.lost and r.lost == []


def test_a_wedged_loop_lets_its_lease_lapse_and_steps_down(etcd: EtcdServer) -> None:  # noqa: F811
    with leader(etcd, stall_limit_s=1.0) as r:
        assert key_lease(etcd) != 0
        keeper = r.election._keeper
        assert keeper is not None
        release = threading.Event()
        r.block(release)
        blocked = time.monotonic()
        try:
            # Past the stall limit the keeper stops; the lease ends in etcd,
            # and a standby could take the key.
            poll(lambda: key_lease(etcd) == 0, "the wedged leader's key is gone")
            print(f"wedged loop: key gone {time.monotonic() - blocked:.2f} s after it stalled")
            assert keeper.skipped > 0
        finally:
            release.set()
        poll(lambda: r.election.lost, "the leader steps down once its loop runs")
        assert r.leadership.view.role is Role.STANDBY and not r.leadership.may_order()
        assert r.lost, "on_lost was called"
