"""The agent link's conversions between the contract's messages
(pushkv.v1) and the agent's own (agent/messages.py): orders, peers and
reports, and the hello's held list within its byte budget."""

from __future__ import annotations

from pushkv.agent.messages import (
    ArrivalMsg,
    OrderMsg,
    Outbound,
    PeerMsg,
    ReportStatus,
    Target,
)
from pushkv.agent.nixl_types import BlockResize, KVRegion, MemoryKind
from pushkv.agent.snapshot import HeldItem
from pushkv.rules import block_groups
from pushkv.v1 import pushkv_pb2 as pb

_STATUS = {
    ReportStatus.POSTED: pb.WRITE_STATUS_POSTED,
    ReportStatus.DONE: pb.WRITE_STATUS_DONE,
    ReportStatus.FAILED: pb.WRITE_STATUS_FAILED,
    ReportStatus.DROPPED: pb.WRITE_STATUS_DROPPED,
}
# A hello's held list stops at about this many bytes: the coordinator
# receives at most its --max-message-bytes (4 MiB), and a hello over it would
# be refused at every reconnect. Those left out are not adopted: their
# resubmissions fail cleanly once the new leader's rebuild window ends.
HELLO_HELD_BYTES = 1 << 20


def held_entries(
    items: tuple[HeldItem, ...], budget: int = HELLO_HELD_BYTES
) -> tuple[list[pb.HeldTransfer], list[str]]:
    """The hello's held list within `budget` bytes, and the transfers it
    leaves out. Those whose WRITEs may land (posted) or that a decode rank
    counted go first: a new leader must know them to never write twice."""
    ranked = sorted(items, key=lambda h: (not h.posted, not (h.counted or h.ready)))
    out: list[pb.HeldTransfer] = []
    left: list[str] = []
    size = 0
    for h in ranked:
        entry = pb.HeldTransfer(
            transfer_id=h.transfer_id,
            posted_order_ids=h.posted,
            unposted_order_ids=h.unposted,
            counted_prefill_ranks=h.counted,
            ready=h.ready,
        )
        n = entry.ByteSize() + 4  # its tag and length in the hello
        if size + n > budget:
            left.append(h.transfer_id)
            continue
        size += n
        out.append(entry)
    return out, left


def order_from_pb(o: pb.TransferOrder) -> OrderMsg:
    targets = []
    error = ""
    for t in o.targets:
        if o.armed:
            # Armed: the fire fills src (agent/armed.py) from each group's length.
            if any(g.ids for g in t.src_blocks):
                error = "an armed order names src_blocks"
            elif t.resize_tokens:
                error = "an armed order with a token range (different block sizes)"
        elif len(t.src_blocks) != len(t.dst_blocks):
            error = "src_blocks and dst_blocks name different numbers of KV groups"
        if t.slice_offset and not t.slice_len:
            error = "slice_offset without slice_len"
        # Several KV groups (vLLM's hybrid KV cache manager): one block pool,
        # each block id in one group, every group's block b in every region
        # (AgentConfig.kv_groups); a WRITE pairs the groups position by
        # position within each group (agent/posting.py).
        src = block_groups.from_pb(t.src_blocks)  # armed: empty, the fire fills it
        dst = block_groups.from_pb(t.dst_blocks)
        if (
            not o.armed
            and len(src) > 1
            and any(len(s) != len(d) for s, d in zip(src, dst, strict=False))
        ):
            error = "a KV group's src_blocks and dst_blocks differ in length"
        resize = resize_from_pb(t)
        if resize is not None and t.slice_len:
            error = "a token range (different block sizes) with a head slice is not supported"
        if resize is not None and len(t.src_blocks) > 1:
            error = "a token range (different block sizes) with several KV groups is not supported"
        targets.append(
            Target(
                t.decode_engine_id,
                t.decode_rank,
                t.decode_incarnation,
                src,
                dst,
                max(1, t.expected_writers),
                t.slice_offset,
                t.slice_len,
                resize,
                tuple(t.dst_regions),
            )
        )
    return OrderMsg(
        o.order_id,
        o.transfer_id,
        o.prefill_rank,
        tuple(targets),
        o.deadline_unix_ms / 1000,
        error,
        o.term,
        o.num_tokens,
        o.armed,
    )


def resize_from_pb(t: pb.WriteTarget) -> BlockResize | None:
    """The target's token range between blocks of different sizes, or None."""
    if not t.resize_tokens:
        return None
    return BlockResize(
        t.src_tokens_per_block,
        t.dst_tokens_per_block,
        t.kv_heads,
        t.first_token,
        t.resize_tokens,
        tuple(t.head_span_units),
    )


def peer_from_pb(p: pb.PeerInfo) -> PeerMsg:
    # A peer with several KV groups lists its regions once per group (the same
    # memory: AgentConfig.kv_groups); NIXL pairs group 0's by index.
    regions = tuple(
        KVRegion(r.base_addr, r.block_len, r.num_blocks, r.device_id)
        for r in p.layout.regions
        if r.group == 0
    )
    memory = MemoryKind.VRAM if p.layout.memory_kind == "VRAM" else MemoryKind.DRAM
    return PeerMsg(
        p.identity.engine_id,
        p.identity.pp_rank * p.identity.tp_size + p.identity.tp_rank,
        p.identity.incarnation,
        p.nixl_agent_name,
        p.nixl_metadata,
        regions,
        memory,
    )


def report_to_pb(r: Outbound) -> pb.AgentMessage:
    if isinstance(r, ArrivalMsg):
        return pb.AgentMessage(
            arrival=pb.ArrivalReport(
                transfer_id=r.transfer_id,
                prefill_ranks=r.prefill_ranks,
                at_unix_us=int(r.at_unix * 1e6),
            )
        )
    return pb.AgentMessage(
        write=pb.WriteReport(
            order_id=r.order_id,
            transfer_id=r.transfer_id,
            status=_STATUS[r.status],
            detail=r.detail,
            bytes=r.nbytes,
            descriptors=r.descriptors,
            posts=r.posts,
            at_unix_us=int(r.at_unix * 1e6),
        )
    )
