"""Translation between protobuf messages and domain values. No logic lives here."""

from __future__ import annotations

from pushkv.controlplane.domain import (
    AgentRegistration,
    EngineId,
    FailurePolicy,
    HeldTransfer,
    KVLayout,
    KVRegion,
    Notice,
    Order,
    RankState,
    Reason,
    Role,
    State,
    WriteStatus,
)
from pushkv.controlplane.errors import InvalidArgument
from pushkv.controlplane.registry import AgentRecord, EngineRecord
from pushkv.controlplane.transfer import Transfer
from pushkv.rules import block_groups
from pushkv.rules.pairing import KVShape
from pushkv.v1 import pushkv_pb2 as pb

ROLE_TO_PB = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}
POLICY_TO_PB = {
    FailurePolicy.UNSTATED: pb.ON_TRANSFER_FAILURE_UNSPECIFIED,
    FailurePolicy.RECOMPUTE: pb.ON_TRANSFER_FAILURE_RECOMPUTE,
    FailurePolicy.FAIL: pb.ON_TRANSFER_FAILURE_FAIL,
}
POLICY_FROM_PB = {v: k for k, v in POLICY_TO_PB.items()}

STATE_TO_PB = {
    State.AWAITING: pb.TRANSFER_STATE_AWAITING,
    State.REGISTERED: pb.TRANSFER_STATE_REGISTERED,
    State.PREFILL_DONE: pb.TRANSFER_STATE_PREFILL_DONE,
    State.ARMED: pb.TRANSFER_STATE_ARMED,
    State.ORDERED: pb.TRANSFER_STATE_ORDERED,
    State.WRITING: pb.TRANSFER_STATE_WRITING,
    State.COMPLETE: pb.TRANSFER_STATE_COMPLETE,
    State.FAILED: pb.TRANSFER_STATE_FAILED,
    State.CANCELLED: pb.TRANSFER_STATE_CANCELLED,
    State.EXPIRED: pb.TRANSFER_STATE_EXPIRED,
}
STATE_FROM_PB = {v: k for k, v in STATE_TO_PB.items()}

REASON_TO_PB = {
    Reason.NONE: pb.REASON_UNSPECIFIED,
    Reason.CANCELLED: pb.REASON_CANCELLED,
    Reason.DEADLINE: pb.REASON_DEADLINE,
    Reason.WRITE_FAILED: pb.REASON_WRITE_FAILED,
    Reason.AGENT_LOST: pb.REASON_AGENT_LOST,
    Reason.AGENT_FENCED: pb.REASON_AGENT_FENCED,
    Reason.MISMATCH: pb.REASON_MISMATCH,
    Reason.NOTHING_TO_WRITE: pb.REASON_NOTHING_TO_WRITE,
    Reason.PREFILL_ABORTED: pb.REASON_PREFILL_ABORTED,
    Reason.TOO_LARGE: pb.REASON_TOO_LARGE,
}
REASON_FROM_PB = {v: k for k, v in REASON_TO_PB.items()}

RANK_TO_PB = {
    RankState.ORDERED: pb.RANK_STATE_ORDERED,
    RankState.POSTED: pb.RANK_STATE_POSTED,
    RankState.DONE: pb.RANK_STATE_DONE,
    RankState.FAILED: pb.RANK_STATE_FAILED,
    RankState.DROPPED: pb.RANK_STATE_DROPPED,
}

WRITE_FROM_PB = {
    pb.WRITE_STATUS_POSTED: WriteStatus.POSTED,
    pb.WRITE_STATUS_DONE: WriteStatus.DONE,
    pb.WRITE_STATUS_FAILED: WriteStatus.FAILED,
    pb.WRITE_STATUS_DROPPED: WriteStatus.DROPPED,
}
WRITE_TO_PB = {v: k for k, v in WRITE_FROM_PB.items()}


def _us(seconds: float) -> int:
    return int(seconds * 1_000_000)


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(
        tokens_per_block=msg.tokens_per_block,
        regions=tuple(
            KVRegion(
                r.base_addr,
                r.block_len,
                r.num_blocks,
                r.device_id,
                r.group,
                r.name,
                r.layer if r.HasField("layer") else -1,
            )
            for r in msg.regions
        ),
        memory_kind=msg.memory_kind or "DRAM",
        compat_hash=msg.compat_hash,
        compat=tuple(sorted(msg.compat.items())),
        kv_heads=msg.kv_heads,
        head_major=msg.head_major,
    )


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        tokens_per_block=layout.tokens_per_block,
        regions=[
            pb.KVRegion(
                base_addr=r.base_addr,
                block_len=r.block_len,
                num_blocks=r.num_blocks,
                device_id=r.device_id,
                group=r.group,
                name=r.name,
                layer=r.layer if r.layer >= 0 else None,
            )
            for r in layout.regions
        ],
        memory_kind=layout.memory_kind,
        compat_hash=layout.compat_hash,
        compat=dict(layout.compat),
        kv_heads=layout.kv_heads,
        head_major=layout.head_major,
    )


def registration_from_pb(hello: pb.AgentHello) -> AgentRegistration:
    ident = hello.identity
    role = ROLE_FROM_PB.get(ident.role)
    if role is None:
        raise InvalidArgument("must be ROLE_PREFILL or ROLE_DECODE", field="identity.role")
    policy = POLICY_FROM_PB.get(hello.on_transfer_failure)
    if policy is None:
        raise InvalidArgument(
            f"{hello.on_transfer_failure} is not an OnTransferFailure value",
            field="on_transfer_failure",
        )
    return AgentRegistration(
        engine_id=EngineId(ident.engine_id),
        role=role,
        tp_rank=ident.tp_rank,
        tp_size=ident.tp_size,
        incarnation=ident.incarnation,
        nixl_agent_name=hello.nixl_agent_name,
        nixl_metadata=hello.nixl_metadata,
        layout=layout_from_pb(hello.layout),
        api_url=hello.api_url,
        pp_rank=ident.pp_rank,
        pp_size=max(1, ident.pp_size),
        routable=hello.routable,
        on_transfer_failure=policy,
    )


def held_from_pb(hello: pb.AgentHello) -> list[HeldTransfer]:
    """The live transfers the agent re-sent (AgentHello.held)."""
    return [
        HeldTransfer(
            h.transfer_id,
            tuple(h.posted_order_ids),
            tuple(h.unposted_order_ids),
            tuple(h.counted_prefill_ranks),
            h.ready,
        )
        for h in hello.held
    ]


def identity_to_pb(reg: AgentRegistration) -> pb.AgentIdentity:
    return pb.AgentIdentity(
        engine_id=reg.engine_id,
        role=ROLE_TO_PB[reg.role],
        tp_rank=reg.tp_rank,
        tp_size=reg.tp_size,
        incarnation=reg.incarnation,
        pp_rank=reg.pp_rank,
        pp_size=reg.pp_size,
    )


def peer_to_pb(reg: AgentRegistration) -> pb.PeerInfo:
    return pb.PeerInfo(
        identity=identity_to_pb(reg),
        nixl_agent_name=reg.nixl_agent_name,
        nixl_metadata=reg.nixl_metadata,
        layout=layout_to_pb(reg.layout),
    )


def fill_order(m: pb.TransferOrder, order: Order) -> None:
    # Filled in place: passing sub-messages as constructor arguments copies each one.
    m.order_id = order.order_id
    m.transfer_id = order.transfer_id
    m.prefill_rank = order.prefill_rank
    m.prefill_incarnation = order.prefill_incarnation
    m.deadline_unix_ms = int(order.deadline_unix * 1000)
    m.num_tokens = order.num_tokens
    if order.armed:
        m.armed = True
    for t in order.targets:
        w = m.targets.add(
            decode_engine_id=t.decode_engine_id,
            decode_rank=t.decode_rank,
            decode_incarnation=t.decode_incarnation,
            slice_offset=t.slice_offset,
            slice_len=t.slice_len,
            expected_writers=t.expected_writers,
        )
        if t.resize_tokens:  # different block sizes; unset (0) otherwise
            w.src_tokens_per_block = t.src_tokens_per_block
            w.dst_tokens_per_block = t.dst_tokens_per_block
            w.first_token = t.first_token
            w.resize_tokens = t.resize_tokens
            w.kv_heads = t.kv_heads
            w.head_span_units.extend(t.head_span_units)
        if t.dst_regions:  # pipeline-parallel prefill; empty = region i into region i
            w.dst_regions.extend(t.dst_regions)
        # Plain-typed: mypyc iterates no NewType (BlockGroups).
        src: tuple[tuple[int, ...], ...] = t.src_blocks
        dst: tuple[tuple[int, ...], ...] = t.dst_blocks
        add = w.src_blocks.add
        for g in src:
            add().ids.extend(g)
        add = w.dst_blocks.add
        for g in dst:
            add().ids.extend(g)


def order_message(order: Order) -> pb.CoordinatorMessage:
    """The order as a CoordinatorMessage, filled in place (no sub-message copy)."""
    msg = pb.CoordinatorMessage()
    fill_order(msg.order, order)
    return msg


def notice_to_pb(n: Notice) -> pb.TransferNotice:
    return pb.TransferNotice(
        transfer_id=n.transfer_id,
        state=STATE_TO_PB[n.state],
        reason=REASON_TO_PB[n.reason],
        detail=n.detail,
        write_may_land=n.write_may_land,
    )


def _num_tokens(t: Transfer) -> int:
    side = t.decode or t.prefill
    return side.num_tokens if side else 0


def transfer_to_pb(t: Transfer, *, deadline_wall: float) -> pb.TransferStatus:
    arrived = t.arrived_ranks()
    return pb.TransferStatus(
        transfer_id=t.transfer_id,
        state=STATE_TO_PB[t.state],
        reason=REASON_TO_PB[t.reason],
        detail=t.detail,
        prefill_engine_id=t.prefill_engine or "",
        decode_engine_id=t.decode_engine or "",
        num_tokens=_num_tokens(t),
        decode_blocks=block_groups.to_pb(t.decode.blocks) if t.decode else [],
        prefill_blocks=block_groups.to_pb(t.prefill.blocks) if t.prefill else [],
        ranks=[
            pb.RankStatus(
                prefill_rank=r,
                order_id=o.order.order_id,
                state=RANK_TO_PB[o.state],
                arrived=r in arrived,
                detail=o.detail,
                posts=o.posts,
            )
            for r, o in sorted(t.orders.items())
        ],
        outstanding_ranks=t.outstanding_ranks(),
        write_may_land=t.write_may_land,
        created_unix_us=_us(t.created_wall),
        updated_unix_us=_us(t.updated_wall),
        deadline_unix_us=0 if t.state.terminal else _us(deadline_wall),
        timeline=[pb.TimelineEvent(stage=s, unix_us=_us(w), rank=r) for s, w, r in t.timeline],
    )


def engine_to_pb(
    eng: EngineRecord,
    *,
    inflight: int,
    open_orders: dict[int, int],
    wall_offset: float,
    relays: dict[int, str] | None = None,
) -> pb.EngineStatus:
    def lease(rec: AgentRecord) -> pb.RankLease:
        return pb.RankLease(
            tp_rank=rec.key.rank,
            pp_rank=rec.reg.pp_rank,
            incarnation=rec.incarnation,
            nixl_agent_name=rec.reg.nixl_agent_name,
            connected=rec.connected,
            returning=rec.returning and not rec.connected,
            lease_expires_unix_us=_us(rec.lease_deadline + wall_offset),
            last_seen_unix_us=_us(rec.last_seen + wall_offset),
            inflight_orders=open_orders.get(rec.key.rank, 0),
            relay=(relays or {}).get(rec.key.rank, ""),
        )

    # An engine's ranks share one configuration: rank 0's policy is the engine's.
    first = eng.ranks[min(eng.ranks)].reg if eng.ranks else None
    policy = first.on_transfer_failure if first is not None else FailurePolicy.UNSTATED
    return pb.EngineStatus(
        engine_id=eng.engine_id,
        role=ROLE_TO_PB[eng.role],
        tp_size=eng.tp_size,
        pp_size=eng.pp_size,
        ranks=[lease(r) for _, r in sorted(eng.ranks.items())],
        ready=eng.ready,
        inflight_transfers=inflight,
        tokens_per_block=eng.tokens_per_block,
        api_url=next((r.reg.api_url for r in eng.ranks.values() if r.reg.api_url), ""),
        kv=shape_to_pb(eng.shape) if eng.ranks else None,
        on_transfer_failure=POLICY_TO_PB[policy],
    )


def shape_to_pb(shape: KVShape) -> pb.KVShape:
    return pb.KVShape(
        compat=dict(shape.compat),
        compat_hash=shape.compat_hash,
        kv_heads=shape.kv_heads,
        head_major=shape.head_major,
        regions=[
            pb.RegionShape(group=g, block_len=n, layer=layer if layer >= 0 else None)
            for (g, n), layer in zip(shape.regions, _layers(shape), strict=True)
        ],
        pp_size=shape.pp_size,
    )


def _layers(shape: KVShape) -> tuple[int, ...]:
    return shape.layers if len(shape.layers) == len(shape.regions) else (-1,) * len(shape.regions)
