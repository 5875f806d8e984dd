"""Prepared block lists (agent/prepped.py) on real NIXL: a WRITE names blocks
by index into lists made once per side and byte range, the bytes land where
the planned path put them, and every list is released by its owner (the peer's
with the peer, ours before the memory is deregistered).

Both endpoints live in this process (two NIXL agents, UCX between them) so
that the test can watch one agent's list calls; tests/test_nixl_adapter.py
and tests/test_bench_dataplane.py write between processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pushkv.agent.nixl_adapter import NixlEndpoint, quiet_nixl_env
from pushkv.agent.nixl_types import (
    BlockSlice,
    FailureReason,
    KVRegion,
    NixlError,
    PeerKey,
    TransferState,
    WriteHandle,
)
from pushkv.agent.prepped import PreppedWrite
from pushkv.agent.write_plan import Layout

BLOCKS = 16
BIG = 4096  # bytes per block, two regions
HALF = BIG // 2


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in quiet_nixl_env(loopback=True).items():
        monkeypatch.setenv(key, value)


def _pools(block_len: int, fill: int) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    return [np.full((BLOCKS, block_len), fill, np.uint8) for _ in range(2)]


def _regions(pools: list[np.ndarray[Any, np.dtype[np.uint8]]]) -> list[KVRegion]:
    return [KVRegion(p.ctypes.data, p.shape[1], BLOCKS) for p in pools]


def _done(ep: NixlEndpoint, handle: WriteHandle) -> None:
    deadline = time.monotonic() + 30.0
    while (state := ep.poll(handle)) is TransferState.IN_PROGRESS:
        assert time.monotonic() < deadline, f"WRITE not done within 30 s: {handle}"
    assert state is TransferState.DONE
    ep.release(handle)


class _Spy:
    """Counts the real agent's list calls (and passes them through)."""

    def __init__(self, agent: Any) -> None:
        self.prepped: list[Any] = []
        self.released: list[Any] = []
        prep, release = agent.prep_xfer_dlist, agent.release_dlist_handle

        def prep_spy(*args: Any, **kwargs: Any) -> Any:
            handle = prep(*args, **kwargs)
            self.prepped.append(handle)
            return handle

        def release_spy(handle: Any) -> None:
            self.released.append(handle)
            release(handle)

        agent.prep_xfer_dlist = prep_spy
        agent.release_dlist_handle = release_spy


@pytest.fixture
def sides() -> Iterator[dict[str, Any]]:
    src = _pools(BIG, 0)
    for r, pool in enumerate(src):
        pool[:] = (np.arange(BLOCKS, dtype=np.uint8) + 16 * r)[:, None]
    whole, half = _pools(BIG, 0xEE), _pools(HALF, 0xEE)
    ep = NixlEndpoint("prepped-src")
    ep_whole, ep_half = NixlEndpoint("prepped-whole"), NixlEndpoint("prepped-half")
    try:
        ep.register_kv(_regions(src))
        ep_whole.register_kv(_regions(whole))
        ep_half.register_kv(_regions(half))
        spy = _Spy(ep._agent)
        to_whole, to_half = PeerKey("prepped-whole", "1"), PeerKey("prepped-half", "1")
        ep.add_peer(to_whole, ep_whole.metadata(), _regions(whole))
        ep.add_peer(to_half, ep_half.metadata(), _regions(half))
        yield {
            "ep": ep,
            "spy": spy,
            "src": src,
            "whole": (to_whole, whole),
            "half": (to_half, half),
            "ep_half": ep_half,
            "ep_whole": ep_whole,
        }
    finally:
        for e in (ep, ep_whole, ep_half):
            e.close()


def test_whole_and_sliced_writes_land_and_lists_are_made_once(sides: dict[str, Any]) -> None:
    ep, spy, src = sides["ep"], sides["spy"], sides["src"]
    to_whole, whole = sides["whole"]
    to_half, half = sides["half"]
    for local, remote in (([1, 2, 3], [7, 8, 9]), ([5, 0], [2, 11])):
        h = ep.post_write(to_whole, local, remote)
        assert h.num_descriptors == (1 if local == [1, 2, 3] else 2) * 2  # runs x regions
        _done(ep, h)
        for r in range(2):
            for lb, rb in zip(local, remote, strict=True):
                assert (whole[r][rb] == src[r][lb]).all()
    assert len(spy.prepped) == 2  # our whole blocks and the peer's, once each

    cut = BlockSlice(HALF, HALF)  # rank 1's heads of our blocks into whole smaller blocks
    h = ep.post_write(to_half, [4, 6, 7], [0, 15, 3], block_slice=cut)
    assert h.num_descriptors == 3 * 2 and h.nbytes == 3 * 2 * HALF
    _done(ep, h)
    for r in range(2):
        for lb, rb in ((4, 0), (6, 15), (7, 3)):
            assert (half[r][rb] == src[r][lb, HALF:]).all()
        untouched = [b for b in range(BLOCKS) if b not in (0, 15, 3)]
        assert (half[r][untouched] == 0xEE).all()
    assert len(spy.prepped) == 4  # our slices and the peer's whole blocks added


def test_slices_of_consecutive_blocks_are_not_merged(sides: dict[str, Any]) -> None:
    """Smaller blocks into the second half of larger ones (prefill TP2 rank 1 into
    decode TP1): runs of consecutive blocks on both sides, adjacent on the
    writer's side only, must stay one descriptor per block (merging them
    would spill each slice over the next block's first half)."""
    to_whole, whole = sides["whole"]
    _, half = sides["half"]
    writer, reader = sides["ep_half"], sides["ep_whole"]
    for r, pool in enumerate(half):
        pool[:] = (np.arange(BLOCKS, dtype=np.uint8) + 100 + 16 * r)[:, None]
    writer.add_peer(to_whole, reader.metadata(), _regions(whole))
    local, remote = [2, 3, 4, 9], [5, 6, 7, 12]
    h = writer.post_write(to_whole, local, remote, block_slice=BlockSlice(HALF, HALF))
    assert h.num_descriptors == 4 * 2
    _done(writer, h)
    for r in range(2):
        for lb, rb in zip(local, remote, strict=True):
            assert (whole[r][rb, HALF:] == half[r][lb]).all()
            assert (whole[r][rb, :HALF] == 0xEE).all()  # the other rank's heads untouched
        untouched = [b for b in range(BLOCKS) if b not in remote]
        assert (whole[r][untouched] == 0xEE).all()


def test_every_list_is_released_by_its_owner(sides: dict[str, Any]) -> None:
    ep, spy = sides["ep"], sides["spy"]
    to_whole, _ = sides["whole"]
    to_half, _ = sides["half"]
    _done(ep, ep.post_write(to_whole, [1], [2]))
    _done(ep, ep.post_write(to_half, [1], [2], block_slice=BlockSlice(0, HALF)))
    assert len(spy.prepped) == 4
    ep.remove_peer(to_whole)  # its list goes with it
    assert len(spy.released) == 1 and spy.released[0] is spy.prepped[1]
    ep.close()  # the other peer's, then ours, before the memory
    assert sorted(map(id, spy.released)) == sorted(map(id, spy.prepped))


def test_bad_writes_are_refused_before_any_list_is_made(sides: dict[str, Any]) -> None:
    ep, spy = sides["ep"], sides["spy"]
    to_whole, _ = sides["whole"]
    to_half, _ = sides["half"]
    cases: list[tuple[PeerKey, list[int], list[int], BlockSlice | None, str]] = [
        (to_whole, [0, 1], [3, 3], None, "duplicate remote block ids"),
        (to_whole, [BLOCKS], [0], None, f"local block id {BLOCKS} out of range"),
        (to_half, [0], [0], None, "block lengths differ"),
        (to_half, [0], [0], BlockSlice(HALF + 1, HALF), "does not fit"),
    ]
    for key, local, remote, cut, match in cases:
        with pytest.raises(NixlError, match=match) as info:
            ep.post_write(key, local, remote, block_slice=cut)
        assert info.value.reason is FailureReason.INVALID_REQUEST
    assert spy.prepped == [] and ep.live_handles == 0


def test_descriptor_counts_follow_runs_on_both_sides() -> None:
    lay = Layout.of([KVRegion(4096, 64, 8)], "t")
    for local, remote, runs in (
        ([], [], 0),
        ([3], [5], 1),
        ([0, 1, 2], [4, 5, 6], 1),
        ([0, 1, 2], [4, 6, 7], 2),  # the remote side breaks the run
        ([0, 2, 3], [4, 5, 6], 2),  # the local side does
        ([5, 4], [1, 0], 2),  # descending is not a run
    ):
        assert PreppedWrite(lay, lay, local, remote, "t", None).num_descriptors == runs
