"""Tests of agent.nixl_adapter: pure helpers, then real NIXL WRITEs between two processes.

The target side runs in a spawned child (tests/support/nixl_peer.py); the initiator runs
in the test process.  Every wait is bounded: pipe polls and handle polls have
deadlines, and child processes are killed if they do not exit in time.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from agent import nixl_adapter
from agent.nixl_adapter import (
    _VECTOR_MIN_BLOCKS,
    FailureReason,
    KVRegion,
    NixlEndpoint,
    NixlError,
    PeerKey,
    TransferState,
    WriteHandle,
    _Layout,
    _plan_write,
    merge_runs,
    quiet_nixl_env,
)
from tests.support.nixl_peer import alloc_regions, block_pattern, regions_of, run_target

pytestmark = pytest.mark.timeout(60)

BLOCK_LENS = [4096, 8192]  # two regions (think: one layer's K and V), paired by index
TARGET_BLOCKS = 32
INIT_BLOCKS = 24
WAIT_S = 10.0  # generous bound for anything that normally takes milliseconds


# --------------------------------------------------------------------------- pure helpers


def test_merge_runs_contiguous() -> None:
    assert merge_runs([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]


def test_merge_runs_scattered() -> None:
    assert merge_runs([1, 5, 3], [9, 2, 7]) == [(1, 9, 1), (5, 2, 1), (3, 7, 1)]


def test_merge_runs_mixed() -> None:
    local = [0, 1, 2, 5, 9, 10, 11]
    remote = [3, 4, 5, 20, 7, 8, 12]  # last pair is consecutive locally only
    assert merge_runs(local, remote) == [(0, 3, 3), (5, 20, 1), (9, 7, 2), (11, 12, 1)]


def test_merge_runs_consecutive_on_one_side_only_splits() -> None:
    assert merge_runs([0, 1, 2], [5, 7, 8]) == [(0, 5, 1), (1, 7, 2)]
    assert merge_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]


def test_merge_runs_empty() -> None:
    assert merge_runs([], []) == []


def test_merge_runs_length_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        merge_runs([1, 2], [1])


def _rows(rows: object) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in row) for row in rows]  # type: ignore[attr-defined]


def _shuffled_chunks(n: int, base: int, chunk: int, rng: np.random.Generator) -> list[int]:
    """ids base..base+n-1, cut into consecutive chunks, chunks in random order."""
    chunks = [range(base + i, base + min(i + chunk, n)) for i in range(0, n, chunk)]
    return [b for i in rng.permutation(len(chunks)) for b in chunks[i]]


def test_plan_vectorized_path_matches_python_path() -> None:
    local = _Layout.of([KVRegion(1 << 20, 4096, 64), KVRegion(1 << 30, 512, 70)], "local")
    remote = _Layout.of([KVRegion(1 << 21, 4096, 100), KVRegion(1 << 31, 512, 90)], "remote")
    rng = np.random.default_rng(7)
    for n in (1, 3, 17, 40, 64):
        lb = _shuffled_chunks(n, 0, 4, rng)  # different chunking on each side:
        rb = _shuffled_chunks(n, 3, 3, rng)  # runs merge only partially
        py = _plan_write(local, remote, lb, rb, "peer", vector_min=10**9)
        vec = _plan_write(local, remote, lb, rb, "peer", vector_min=1)
        runs = merge_runs(lb, rb)
        assert py.num_descriptors == vec.num_descriptors == 2 * len(runs)
        assert py.nbytes == vec.nbytes == n * (4096 + 512)
        assert _rows(py.local_rows) == _rows(vec.local_rows)
        assert _rows(py.remote_rows) == _rows(vec.remote_rows)
        first = runs[0]
        assert _rows(py.local_rows)[0] == ((1 << 20) + first[0] * 4096, first[2] * 4096, 0)
        assert _rows(py.remote_rows)[len(runs)] == ((1 << 31) + first[1] * 512, first[2] * 512, 0)


@pytest.mark.parametrize("vector_min", [1, 10**9])
def test_plan_rejects_bad_ids_on_both_paths(vector_min: int) -> None:
    layout = _Layout.of([KVRegion(4096, 64, 32)], "x")
    n = 20
    ok = list(range(n))
    cases = [
        (ok, ok[:-1], "vs"),
        ([*ok[:-1], 32], ok, "local block id 32 out of range"),
        (ok, [-1, *ok[1:]], "peer block id -1 out of range"),
        (ok, [0, *ok[:-1]], "duplicate remote block ids"),
        # one run on both sides (the contiguous fast path), running off either end
        (list(range(13, 13 + n)), ok, "local block id 32 out of range"),
        (ok, list(range(-1, n - 1)), "peer block id -1 out of range"),
    ]
    for lb, rb, match in cases:
        with pytest.raises(NixlError, match=match) as info:
            _plan_write(layout, layout, lb, rb, "peer", vector_min=vector_min)
        assert info.value.reason is FailureReason.INVALID_REQUEST
    assert _plan_write(layout, layout, [], [], "peer").num_descriptors == 0


@pytest.mark.parametrize("kind", ["list", "tuple", "ndarray", "range"])
def test_plan_contiguous_fast_path_accepts_any_sequence(kind: str) -> None:
    convert: dict[str, Callable[[Sequence[int]], Any]] = {
        "list": list,
        "tuple": tuple,
        "ndarray": np.array,
        "range": lambda ids: ids if isinstance(ids, range) else list(ids),
    }
    as_kind = convert[kind]
    local = _Layout.of([KVRegion(1 << 20, 4096, 300), KVRegion(1 << 30, 512, 300)], "local")
    remote = _Layout.of([KVRegion(1 << 21, 4096, 300), KVRegion(1 << 31, 512, 300)], "remote")
    for n in (1, 2, 64, 256):
        plan = _plan_write(
            local, remote, as_kind(range(5, 5 + n)), as_kind(range(40, 40 + n)), "peer"
        )
        assert plan.num_descriptors == 2 and plan.nbytes == n * (4096 + 512)
        assert _rows(plan.local_rows) == [
            ((1 << 20) + 5 * 4096, n * 4096, 0),
            ((1 << 30) + 5 * 512, n * 512, 0),
        ]
        assert _rows(plan.remote_rows)[1] == ((1 << 31) + 40 * 512, n * 512, 0)
    # consecutive on one side only: no merge, one descriptor per block and region
    plan = _plan_write(local, remote, as_kind(range(64)), as_kind(range(63, -1, -1)), "peer")
    assert plan.num_descriptors == 128
    scattered = np.random.default_rng(3).permutation(256).tolist()
    for vector_min in (1, 10**9):
        plan = _plan_write(
            local, remote, as_kind(scattered), as_kind(range(256)), "peer", vector_min=vector_min
        )
        assert plan.num_descriptors == 2 * len(merge_runs(scattered, range(256)))


def test_nixl_error_carries_reason_and_pickles() -> None:
    err = NixlError(FailureReason.PEER_DISCONNECTED, "peer gone")
    assert err.reason is FailureReason.PEER_DISCONNECTED
    assert "PEER_DISCONNECTED" in str(err) and "peer gone" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert back.reason is err.reason and back.message == err.message


def test_quiet_env() -> None:
    assert quiet_nixl_env(loopback=True)["UCX_NET_DEVICES"] == "lo"
    assert "UCX_NET_DEVICES" not in quiet_nixl_env(loopback=False)
    assert quiet_nixl_env(loopback=False)["NIXL_LOG_LEVEL"] == "WARN"


# --------------------------------------------------------------------------- process helpers


class Target:
    """Parent-side handle on a spawned tests.support.nixl_peer.run_target process."""

    def __init__(self, name: str, num_blocks: int = TARGET_BLOCKS) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=run_target, args=(child_conn, name, BLOCK_LENS, num_blocks), daemon=True
        )
        self.proc.start()
        child_conn.close()
        self._ready: tuple[int, bytes, list[KVRegion]] | None = None
        self.notifs: list[tuple[str, bytes]] = []

    def _recv(self, timeout: float) -> tuple[object, ...]:
        if not self.conn.poll(timeout):
            pytest.fail(f"target {self.name}: no message within {timeout} s")
        msg: tuple[object, ...] = self.conn.recv()
        return msg

    def ready(self) -> tuple[int, bytes, list[KVRegion]]:
        if self._ready is None:
            tag, pid, md, layout = self._recv(30.0)  # cold spawn + nixl import + UCX init
            assert tag == "ready"
            assert isinstance(pid, int) and isinstance(md, bytes) and isinstance(layout, list)
            self._ready = (pid, md, [KVRegion(a, bl, nb) for a, bl, nb in layout])
        return self._ready

    def add_to(self, ep: NixlEndpoint, incarnation: str = "1") -> PeerKey:
        _, md, regions = self.ready()
        key = PeerKey(self.name, incarnation)
        ep.add_peer(key, md, regions)
        return key

    def wait_notif(self, timeout: float = WAIT_S) -> tuple[str, bytes]:
        deadline = time.monotonic() + timeout
        while not self.notifs:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            self.notifs.append(_as_notif(msg))
        return self.notifs.pop(0)

    def verify(self, mapping: Sequence[tuple[int, int]]) -> list[str]:
        """Ask the target to check its buffers; notifications seen meanwhile are kept."""
        self.conn.send(("verify", list(mapping)))
        deadline = time.monotonic() + WAIT_S
        while True:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if msg[0] == "verified":
                errors = msg[1]
                assert isinstance(errors, list)
                return errors
            self.notifs.append(_as_notif(msg))

    def kill(self) -> None:
        pid = self.ready()[0]
        os.kill(pid, signal.SIGKILL)
        self.proc.join(WAIT_S)
        assert not self.proc.is_alive()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(WAIT_S)
        self.conn.close()


def _as_notif(msg: tuple[object, ...]) -> tuple[str, bytes]:
    tag, sender, body = msg
    assert tag == "notif" and isinstance(sender, str) and isinstance(body, bytes), msg
    return sender, body


def wait_done(ep: NixlEndpoint, handle: WriteHandle, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while (state := ep.poll(handle)) is TransferState.IN_PROGRESS:
        if time.monotonic() > deadline:
            pytest.fail(f"WRITE still in progress after {timeout} s: {handle}")
    assert state is TransferState.DONE, handle


def make_initiator(name: str) -> tuple[NixlEndpoint, list[np.ndarray]]:
    """Endpoint whose block b of region r holds block_pattern(r, b)."""
    arrays = alloc_regions(BLOCK_LENS, INIT_BLOCKS, 0)
    for r, arr in enumerate(arrays):
        for b in range(INIT_BLOCKS):
            arr[b] = block_pattern(r, b, arr.shape[1])
    ep = NixlEndpoint(name)
    ep.register_kv(regions_of(arrays))
    return ep, arrays


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def nixl_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mpatch:
        for key, value in quiet_nixl_env(loopback=True).items():
            mpatch.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def target(nixl_env: None) -> Iterator[Target]:
    t = Target(uniq("target"))
    yield t
    t.stop()


@pytest.fixture(scope="module")
def pair(target: Target) -> Iterator[tuple[NixlEndpoint, PeerKey, Target]]:
    ep, arrays = make_initiator(uniq("init"))  # created while the target starts up
    try:
        key = target.add_to(ep)
        yield ep, key, target
    finally:
        ep.close()
        del arrays  # buffers must outlive the endpoint


# --------------------------------------------------------------------------- real NIXL


def test_scattered_write_across_regions_lands_exactly(
    pair: tuple[NixlEndpoint, PeerKey, Target],
) -> None:
    ep, key, target = pair
    local = [0, 1, 2, 5, 9, 10, 15]
    remote = [3, 4, 5, 20, 7, 8, 31]  # 4 runs: (0,3,3) (5,20,1) (9,7,2) (15,31,1)
    handle = ep.post_write(key, local, remote, b"req-1:done")
    assert handle.num_blocks == 7
    assert handle.num_descriptors == 4 * len(BLOCK_LENS)
    assert handle.nbytes == 7 * sum(BLOCK_LENS)
    wait_done(ep, handle)
    assert handle.latency_s is not None and handle.latency_s >= 0

    sender, msg = target.wait_notif()
    assert msg == b"req-1:done"
    assert sender == ep.name

    assert target.verify(list(zip(remote, local, strict=True))) == []
    ep.release(handle)
    ep.release(handle)  # idempotent
    assert handle.released and ep.live_handles == 0


def test_contiguous_write_is_one_descriptor_per_region(
    pair: tuple[NixlEndpoint, PeerKey, Target],
) -> None:
    ep, key, target = pair
    local, remote = list(range(4, 12)), list(range(20, 28))
    handle = ep.post_write(key, local, remote, b"req-2")
    assert handle.num_descriptors == len(BLOCK_LENS)
    wait_done(ep, handle)
    assert target.wait_notif() == (ep.name, b"req-2")
    assert target.verify(list(zip(remote, local, strict=True))) == []
    ep.release(handle)


@pytest.mark.parametrize("vectorized", [False, True])
def test_large_mixed_write_lands_exactly(
    pair: tuple[NixlEndpoint, PeerKey, Target], monkeypatch: pytest.MonkeyPatch, vectorized: bool
) -> None:
    ep, key, target = pair
    local = [*range(10), 12, 14, 15, 16, 20, 21, 22, 23, 11, 13]
    remote = [*range(10, 20), 0, 2, 3, 4, 25, 26, 27, 28, 31, 30]
    if vectorized:  # numpy planner and Nx3 descriptor arrays, as for big writes
        monkeypatch.setattr(nixl_adapter, "_VECTOR_MIN_BLOCKS", 16)
        monkeypatch.setattr(nixl_adapter, "_PY_ROWS_MAX", 0)
    else:
        assert len(local) < _VECTOR_MIN_BLOCKS  # one Python pass, tuple rows
    handle = ep.post_write(key, local, remote, b"req-big")
    assert handle.num_descriptors == len(merge_runs(local, remote)) * len(BLOCK_LENS)
    wait_done(ep, handle)
    assert target.wait_notif() == (ep.name, b"req-big")
    assert target.verify(list(zip(remote, local, strict=True))) == []
    ep.release(handle)


def test_zero_blocks_still_notifies(pair: tuple[NixlEndpoint, PeerKey, Target]) -> None:
    ep, key, target = pair
    handle = ep.post_write(key, [], [], b"req-3:nothing-to-send")
    assert handle.state is TransferState.DONE and handle.nbytes == 0
    assert ep.poll(handle) is TransferState.DONE
    assert target.wait_notif() == (ep.name, b"req-3:nothing-to-send")
    ep.release(handle)


def test_standalone_notification(pair: tuple[NixlEndpoint, PeerKey, Target]) -> None:
    ep, key, target = pair
    ep.send_notif(key, b"hello")
    assert target.wait_notif() == (ep.name, b"hello")


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([0, 1], [0], "2 local blocks vs 1 remote"),
        ([INIT_BLOCKS], [0], f"local block id {INIT_BLOCKS} out of range"),
        ([0], [TARGET_BLOCKS], f"block id {TARGET_BLOCKS} out of range"),
        ([-1], [0], "local block id -1 out of range"),
        ([0, 1], [3, 3], "duplicate remote block ids"),
    ],
)
def test_bad_input_rejected_before_posting(
    pair: tuple[NixlEndpoint, PeerKey, Target], local: list[int], remote: list[int], match: str
) -> None:
    ep, key, target = pair
    with pytest.raises(NixlError, match=match) as info:
        ep.post_write(key, local, remote, b"must-not-arrive")
    assert info.value.reason is FailureReason.INVALID_REQUEST
    assert ep.live_handles == 0
    assert target.verify([]) == []  # target memory untouched
    assert target.notifs == []


def test_unknown_peer_rejected(pair: tuple[NixlEndpoint, PeerKey, Target]) -> None:
    ep, key, _ = pair
    for bad in (PeerKey("nobody", "1"), PeerKey(key.agent_name, "stale-incarnation")):
        with pytest.raises(NixlError) as info:
            ep.post_write(bad, [0], [0], b"x")
        assert info.value.reason is FailureReason.PEER_UNKNOWN
        with pytest.raises(NixlError):
            ep.send_notif(bad, b"x")
    assert ep.has_peer(key)


def test_add_peer_validation(pair: tuple[NixlEndpoint, PeerKey, Target]) -> None:
    ep, key, target = pair
    _, md, regions = target.ready()
    ep.add_peer(key, md, regions)  # same key again: no-op
    assert ep.has_peer(key) and ep.peers == (key,)

    with pytest.raises(NixlError, match="different regions") as info:
        ep.add_peer(key, md, [KVRegion(r.base_addr, r.block_len, 8) for r in regions])
    assert info.value.reason is FailureReason.INVALID_REQUEST

    other = PeerKey("layout-mismatch", "1")
    with pytest.raises(NixlError, match="1 KV regions, local has 2"):
        ep.add_peer(other, md, regions[:1])
    bad_len = [regions[0], KVRegion(regions[1].base_addr, 4096, TARGET_BLOCKS)]
    with pytest.raises(NixlError, match="region 1 has block_len 4096"):
        ep.add_peer(other, md, bad_len)

    with pytest.raises(NixlError) as info:
        ep.add_peer(PeerKey("garbage", "1"), b"not metadata", regions)
    assert info.value.reason is FailureReason.METADATA_MISMATCH
    assert not ep.has_peer(other) and ep.has_peer(key)


def test_killed_peer_reports_disconnect_quickly(nixl_env: None) -> None:
    victim = Target(uniq("victim"))
    try:
        with NixlEndpoint(uniq("init-kill")) as ep:
            ep.register_kv(regions_of(alloc_regions(BLOCK_LENS, INIT_BLOCKS, 1)))
            key = victim.add_to(ep)
            handle = ep.post_write(key, [0, 1], [2, 3], b"before")
            wait_done(ep, handle)
            assert victim.wait_notif()[1] == b"before"

            victim.kill()
            t0 = time.monotonic()
            deadline = t0 + 1.0
            reason: FailureReason | None = None
            while reason is None and time.monotonic() < deadline:
                try:
                    h = ep.post_write(key, [0, 1], [2, 3], b"after")
                    while ep.poll(h) is TransferState.IN_PROGRESS:
                        if time.monotonic() > deadline:
                            break
                    reason = h.failure
                except NixlError as exc:
                    reason = exc.reason
            elapsed = time.monotonic() - t0
            assert reason is FailureReason.PEER_DISCONNECTED, (reason, elapsed)
            assert elapsed < 1.0

            with pytest.raises(NixlError) as info:
                ep.send_notif(key, b"anyone?")
            assert info.value.reason is FailureReason.PEER_DISCONNECTED
            ep.remove_peer(key)
            ep.remove_peer(key)  # idempotent
            assert not ep.has_peer(key) and ep.live_handles == 0
        ep.close()  # idempotent
        with pytest.raises(NixlError, match="closed"):
            ep.post_write(key, [0], [0], b"")
    finally:
        victim.stop()


def test_new_incarnation_replaces_dead_peer(nixl_env: None) -> None:
    name = uniq("phoenix")
    first = Target(name)
    second: Target | None = None
    try:
        ep, arrays = make_initiator(uniq("init-restart"))
        with ep:
            key1 = first.add_to(ep, incarnation="1")
            h1 = ep.post_write(key1, [3], [4], b"one")
            wait_done(ep, h1)
            first.kill()

            second = Target(name)  # same agent name, new process and memory
            key2 = second.add_to(ep, incarnation="2")
            assert ep.has_peer(key2) and not ep.has_peer(key1)
            assert h1.released  # handles to the replaced incarnation are released

            h2 = ep.post_write(key2, [6, 7, 1], [10, 11, 0], b"two")
            wait_done(ep, h2)
            assert second.wait_notif() == (ep.name, b"two")
            assert second.verify([(10, 6), (11, 7), (0, 1)]) == []
            with pytest.raises(NixlError) as info:
                ep.post_write(key1, [0], [0], b"stale")
            assert info.value.reason is FailureReason.PEER_UNKNOWN

            # Metadata of one agent offered under another name is refused; the agent
            # it belongs to is dropped too (its NIXL metadata was just reloaded).
            with pytest.raises(NixlError) as info:
                ep.add_peer(PeerKey("impostor", "1"), second.ready()[1], second.ready()[2])
            assert info.value.reason is FailureReason.METADATA_MISMATCH
            assert ep.peers == ()
        del arrays
    finally:
        first.stop()
        if second is not None:
            second.stop()
