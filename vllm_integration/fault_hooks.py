"""Test-only fault hooks: the one place where pushkv misbehaves on purpose.

Imported only through vllm_integration/faults.armed(), in a process whose
environment arms a hook: never on a production code path.

Every hook is disarmed unless the environment variable ``PUSHKV_TEST_FAULT``
names its fault; only tests set it (on the engine they start). Disarmed, a hook
is one call that returns at once. Faults:

``corrupt_kv:blocks=<n>``
    On a decode worker, every transfer into exactly ``n`` blocks arrives
    corrupted: once its KV has landed, and before the worker reports the request
    to vLLM, the bytes of those blocks in every KV region (every layer, K and V)
    are XORed with ``0x80`` at every odd byte offset. That is what a WRITE
    carrying wrong bytes would leave. On little-endian float32 it flips the sign
    bit (and one mantissa bit) of every element, on 16-bit dtypes just the sign,
    so the values stay finite but the attention over them changes. The test
    controls which request is hit through its prompt length (the number of
    blocks), so one armed engine serves every other request untouched. DRAM
    (CPU) KV caches only.

``kv_digest``
    Not a fault, an observation: each prefill worker logs a SHA-256 of the KV
    it holds for every transfer it reports done (the blocks of the prompt, every
    region, in block order), and each decode worker the same digest of the
    blocks a transfer landed in (after ``corrupt_kv``, when both are armed), one
    line each: ``kv_digest side=<prefill|decode> transfer=<id> blocks=<n>
    sha256=<hex>``. Equal digests prove a transfer byte-exact, whatever the
    engines then compute from it. Whole blocks only (equal TP, or an MLA
    latent replicated to every decode rank: one line per rank), DRAM only.

``hold_fire:<path>``
    A stall, not a fault of pushkv's: while a file exists at ``<path>``, a
    prefill worker whose step completed prompts waits before it fires their
    armed orders (polling every 50 ms, at most ``HOLD_FIRE_MAX_S``), and the
    engine's step with it, so the prefills are not reported done either. Their
    transfers stay short of their end at the coordinator until the test
    removes the file: a test can act on them (kill the leader) knowing they are
    in flight, instead of sampling for them.

Several hooks are armed together with commas (``corrupt_kv:blocks=25,kv_digest``).

The negative control in ``tests/test_e2e_vllm.py`` uses ``corrupt_kv`` to prove
that the end-to-end comparison with an independent engine detects wrong KV.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pushkv.agent.runtime import Agent

from pushkv.vllm_integration.faults import ENV

log = logging.getLogger("pushkv.fault_hooks")


KNOWN = ("corrupt_kv", "kv_digest", "hold_fire")
HOLD_FIRE_MAX_S = 120.0


def parse_hooks(value: str | None) -> dict[str, str]:
    """``kind[:arg]`` items, comma-separated, by kind; an unknown kind is an error."""
    hooks: dict[str, str] = {}
    for item in filter(None, (value or "").split(",")):
        kind, _, arg = item.strip().partition(":")
        if kind not in KNOWN:
            raise ValueError(f"{ENV}={value!r}: unknown hook {kind!r} (known: {', '.join(KNOWN)})")
        hooks[kind] = arg
    return hooks


def parse_corrupt_kv(value: str | None) -> int | None:
    """The block count of ``corrupt_kv:blocks=<n>``; None when that fault is not named."""
    arg = parse_hooks(value).get("corrupt_kv")
    if arg is None:
        return None
    key, _, n = arg.partition("=")
    if key != "blocks" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{ENV}={value!r}: expected corrupt_kv:blocks=<n>, n >= 1")
    return int(n)


_HOOKS = parse_hooks(os.environ.get(ENV))
_CORRUPT_BLOCKS = parse_corrupt_kv(os.environ.get(ENV))
DIGEST = "kv_digest" in _HOOKS
HOLD_FIRE = _HOOKS.get("hold_fire")
if _CORRUPT_BLOCKS is not None:
    log.warning("%s: every transfer into %d blocks is corrupted on arrival", ENV, _CORRUPT_BLOCKS)


def corrupt_blocks(base_addrs: Sequence[int], block_len: int, block_ids: Sequence[int]) -> int:
    """XOR 0x80 into every odd byte of each block of each region; bytes changed."""
    mask = int.from_bytes(b"\x00\x80" * (block_len // 2) + b"\x00" * (block_len % 2), "little")
    changed = 0
    for base in base_addrs:
        for b in block_ids:
            addr = base + b * block_len
            data = int.from_bytes(ctypes.string_at(addr, block_len), "little") ^ mask
            ctypes.memmove(addr, data.to_bytes(block_len, "little"), block_len)
            changed += block_len // 2
    return changed


def blocks_digest(base_addrs: Sequence[int], block_len: int, block_ids: Sequence[int]) -> str:
    """SHA-256 of each block, region by region in ``base_addrs`` order."""
    h = hashlib.sha256()
    for b in block_ids:
        for base in base_addrs:
            h.update(ctypes.string_at(base + b * block_len, block_len))
    return h.hexdigest()


def kv_digest(agent: Agent | None, side: str, transfer_id: str, block_ids: Sequence[int]) -> None:
    """Log the digest of a transfer's blocks (``kv_digest`` armed, DRAM only)."""
    if not DIGEST or agent is None or agent.config.memory.name != "DRAM":
        return
    regions = agent.config.regions
    if len({r.block_len for r in regions}) != 1:
        log.error("%s: kv_digest needs one block length across regions; skipped", ENV)
        return
    sha = blocks_digest([r.base_addr for r in regions], regions[0].block_len, block_ids)
    log.warning(
        "kv_digest side=%s transfer=%s blocks=%d sha256=%s", side, transfer_id, len(block_ids), sha
    )


def kv_sent(agent: Agent | None, transfer_id: str, block_ids: Sequence[int]) -> None:
    """Prefill worker: a transfer's prompt KV is final in ``block_ids`` (held)."""
    kv_digest(agent, "prefill", transfer_id, block_ids)


def kv_arrived(agent: Agent | None, transfer_id: str, block_ids: Sequence[int]) -> None:
    """Decode worker: a transfer's KV has landed in ``block_ids`` (not yet reported)."""
    _corrupt(agent, block_ids)
    kv_digest(agent, "decode", transfer_id, block_ids)


def hold_fire(path: str | None = HOLD_FIRE, limit_s: float = HOLD_FIRE_MAX_S) -> float:
    """Prefill worker, before firing armed orders: wait while ``path`` exists
    (``hold_fire`` armed), at most ``limit_s``; seconds waited."""
    if not path:
        return 0.0
    start = time.monotonic()
    if os.path.exists(path):
        log.warning("%s: holding armed orders while %s exists", ENV, path)
    while os.path.exists(path) and time.monotonic() - start < limit_s:
        time.sleep(0.05)  # the test's file is the only signal across processes
    waited = time.monotonic() - start
    if os.path.exists(path):
        log.error("%s: %s still there after %.0f s; firing anyway", ENV, path, waited)
    return waited


def _corrupt(agent: Agent | None, block_ids: Sequence[int]) -> None:
    if _CORRUPT_BLOCKS is None or len(block_ids) != _CORRUPT_BLOCKS or agent is None:
        return
    cfg = agent.config
    if cfg.memory.name != "DRAM":  # host memory, reachable by address
        log.error("%s: corrupt_kv supports DRAM KV caches only; left intact", ENV)
        return
    by_len: dict[int, list[int]] = {}
    for r in cfg.regions:
        by_len.setdefault(r.block_len, []).append(r.base_addr)
    changed = sum(corrupt_blocks(bases, n, block_ids) for n, bases in by_len.items())
    log.warning(
        "%s: corrupted %d bytes of blocks %s in %d regions",
        ENV,
        changed,
        list(block_ids),
        len(cfg.regions),
    )
