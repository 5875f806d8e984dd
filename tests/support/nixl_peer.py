"""Child-process side of the real-NIXL tests (spawned with multiprocessing "spawn").

The target owns a NixlEndpoint with a canary-filled KV cache, publishes its
metadata and region addresses (plain bytes and ints) over a Pipe, forwards every
notification it receives to the parent, and verifies its buffers on request.

Protocol (parent -> child):
    ("verify", [(remote_block, src_block), ...])  -> ("verified", [error, ...]); canary restored
    ("exit",)                                      -> child closes its endpoint and returns
Child -> parent:
    ("ready", pid, metadata_bytes, [(base_addr, block_len, num_blocks), ...])
    ("notif", sender_agent_name, message_bytes)
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np

from pushkv.agent.nixl_adapter import NixlEndpoint, quiet_nixl_env
from pushkv.agent.nixl_types import KVRegion

CANARY = 0xA5


def block_pattern(region: int, block: int, block_len: int) -> np.ndarray:
    """Deterministic, per-(region, block) distinct content of a source block."""
    idx = np.arange(block_len, dtype=np.uint32)
    return ((idx * (2 * region + 3) + block * 7 + region * 13 + 1) % 251).astype(np.uint8)


def alloc_regions(block_lens: Sequence[int], num_blocks: int, fill: int) -> list[np.ndarray]:
    """One (num_blocks, block_len) uint8 array per region, filled (so pre-touched)."""
    return [np.full((num_blocks, bl), fill, dtype=np.uint8) for bl in block_lens]


def regions_of(arrays: Sequence[np.ndarray]) -> list[KVRegion]:
    return [KVRegion(a.ctypes.data, a.shape[1], a.shape[0]) for a in arrays]


def _verify(arrays: Sequence[np.ndarray], mapping: Sequence[tuple[int, int]]) -> list[str]:
    written = dict(mapping)
    errors: list[str] = []
    for r, arr in enumerate(arrays):
        for b in range(arr.shape[0]):
            src = written.get(b)
            if src is None:
                if not np.all(arr[b] == CANARY):
                    errors.append(f"region {r} block {b}: canary overwritten")
            elif not np.array_equal(arr[b], block_pattern(r, src, arr.shape[1])):
                errors.append(f"region {r} block {b}: does not hold source block {src}")
    return errors


def run_target(
    conn: Connection, name: str, block_lens: list[int], num_blocks: int, lifetime_s: float = 60.0
) -> None:
    """Entry point of the target process; every wait is bounded by ``lifetime_s``."""
    os.environ.update(quiet_nixl_env(loopback=True))
    arrays = alloc_regions(block_lens, num_blocks, CANARY)
    with NixlEndpoint(name) as ep:
        ep.register_kv(regions_of(arrays))
        layout = [(r.base_addr, r.block_len, r.num_blocks) for r in ep.regions]
        conn.send(("ready", os.getpid(), ep.metadata(), layout))
        deadline = time.monotonic() + lifetime_s
        while time.monotonic() < deadline:
            for sender, msg in ep.get_notifications():
                conn.send(("notif", sender, msg))
            if not conn.poll(0.0005):
                continue
            try:
                cmd = conn.recv()
            except EOFError:  # parent went away
                return
            if cmd[0] == "verify":
                errors = _verify(arrays, cmd[1])
                # Refilled before the answer: once it has the answer, the
                # parent may post the next WRITE, which the refill must not
                # overwrite.
                for arr in arrays:
                    arr.fill(CANARY)
                conn.send(("verified", errors))
            elif cmd[0] == "exit":
                return
