"""The target process of ``pushkv bench dataplane``: a registered pool that
WRITEs land in, and the byte-for-byte checks of what landed (see
:mod:`pushkv.bench.dataplane`)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from pushkv.agent.nixl_adapter import NixlEndpoint, quiet_nixl_env
from pushkv.agent.nixl_types import KVRegion
from pushkv.bench.dataplane_memory import Memory, Pool, memory_for

WAIT_S = 30.0
FILL = 0xEE

_U8 = npt.NDArray[np.uint8]


# --------------------------------------------------------------------------- target process


def _target_main(conn: Connection, poll_s: float = 0.0) -> None:
    """Target: (re)creates a registered pool on "setup", verifies on "verify".

    With ``poll_s`` > 0 it progresses its NIXL agent every ``poll_s`` while it
    waits for a command, as the decode agent's NIXL thread does while arrivals
    are expected.  Over CMA that is not needed (the copy is one-sided); over
    UCX's TCP transport a WRITE lands only while the target progresses.
    """
    for key, value in quiet_nixl_env(loopback=True).items():
        os.environ.setdefault(key, value)
    ep: NixlEndpoint | None = None
    pools: list[Pool] = []
    mem: Memory | None = None
    seen: list[tuple[str, bytes]] = []
    try:
        while _wait_command(conn, ep, poll_s, seen):
            try:
                cmd: tuple[Any, ...] = conn.recv()
            except EOFError:
                return
            if cmd[0] == "setup":
                _, name, block_len, num_blocks, num_regions = cmd[:5]
                kind = cmd[5] if len(cmd) > 5 else "dram"  # --memory
                if mem is None or mem.kind.value.lower() != kind:
                    mem = memory_for(kind)
                if ep is not None:
                    ep.close()
                pools = [mem.pool(num_blocks, block_len, FILL) for _ in range(num_regions)]
                ep = NixlEndpoint(name, memory=mem.kind)
                ep.register_kv(
                    [KVRegion(mem.addr(p), block_len, num_blocks, mem.device_id) for p in pools]
                )
                seen.clear()
                layout = [(r.base_addr, r.block_len, r.num_blocks) for r in ep.regions]
                conn.send(("ready", ep.metadata(), layout, os.getpid()))
            elif cmd[0] == "verify" and ep is not None and mem is not None:
                pairs, notif = cmd[1], cmd[2]
                span = cmd[3] if len(cmd) > 3 else None  # --sliced: (offset, length)
                on_host = (
                    [mem.host(p) for p in pools] if _await_notification(ep, notif, seen) else []
                )
                conn.send(("verified", _verify_target(on_host, pairs, notif, span)))
            elif cmd[0] == "verify_digests" and ep is not None:  # --resized (host memory)
                _, blocks, digests, notif = cmd
                conn.send(("verified", _verify_digests(ep, pools, blocks, digests, notif, seen)))
            elif cmd[0] == "exit":
                return
    finally:
        if ep is not None:
            ep.close()


def _wait_command(
    conn: Connection, ep: NixlEndpoint | None, poll_s: float, seen: list[tuple[str, bytes]]
) -> bool:
    """Wait up to 600 s for the next command, progressing ``ep`` every ``poll_s``."""
    if ep is None or poll_s <= 0:
        return conn.poll(600.0)
    deadline = time.monotonic() + 600.0
    while not conn.poll(poll_s):
        seen += ep.get_notifications()  # drives the UCX worker: TCP receives land here
        if time.monotonic() > deadline:
            return False
    return True


def _await_notification(ep: NixlEndpoint, notif: bytes, seen: list[tuple[str, bytes]]) -> bool:
    """Progress ``ep`` until ``notif`` is among its notifications (then forget
    them all), at most WAIT_S; whether it came."""
    deadline = time.monotonic() + WAIT_S
    while not any(msg == notif for _, msg in seen):
        if time.monotonic() > deadline:
            return False
        seen += ep.get_notifications()
    seen.clear()
    return True


def _verify_target(
    pools: Sequence[_U8],
    pairs: Sequence[tuple[int, int]],
    notif: bytes,
    span: tuple[int, int] | None = None,
) -> str:
    """Each remote block holds its local block's byte (local % 251); with
    ``span`` only bytes [offset, offset + length) do, the rest the fill.
    ``pools`` are host copies taken after the notification came (none: it did not)."""
    if not pools:
        return f"notification {notif!r} not received within {WAIT_S} s"
    lo, hi = (span[0], span[0] + span[1]) if span else (0, pools[0].shape[1])
    for pool in pools:
        for remote, local in pairs:
            if not np.all(pool[remote, lo:hi] == local % 251):
                return f"remote block {remote} does not hold local block {local}"
            if not (np.all(pool[remote, :lo] == FILL) and np.all(pool[remote, hi:] == FILL)):
                return f"remote block {remote} was written outside [{lo}, {hi})"
    return "ok"


def _verify_digests(
    ep: NixlEndpoint,
    pools: Sequence[_U8],
    blocks: Sequence[int],
    digests: Sequence[Sequence[str]],
    notif: bytes,
    seen: list[tuple[str, bytes]],
) -> str:
    """Block blocks[i] of region r hashes (SHA-256) to digests[r][i]."""
    if not _await_notification(ep, notif, seen):
        return f"notification {notif!r} not received within {WAIT_S} s"
    for r, (pool, want) in enumerate(zip(pools, digests, strict=True)):
        for b, digest in zip(blocks, want, strict=True):
            if hashlib.sha256(pool[b].tobytes()).hexdigest() != digest:
                return f"region {r} block {b} does not hold the expected tokens"
    return "ok"
