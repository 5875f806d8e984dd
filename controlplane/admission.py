"""What the rendezvous state machine checks before it takes an agent's hello or
one side's report. Plain Python, no gRPC: each check raises the core's errors
and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pushkv.controlplane import validation
from pushkv.controlplane.domain import (
    AgentRegistration,
    Effect,
    Reason,
    Role,
    State,
    TransferId,
)
from pushkv.controlplane.errors import InvalidArgument
from pushkv.controlplane.inflight import InFlight
from pushkv.controlplane.registry import EngineRecord
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Side
from pushkv.rules.block_groups import BlockGroups


def check_hello(reg: AgentRegistration, s: CoreSettings) -> None:
    """An agent's identity, NIXL name and KV layout are well formed."""
    validation.engine_id(reg.engine_id, field="identity.engine_id", max_len=s.max_id_len)
    validation.check_id(reg.incarnation, field="identity.incarnation", max_len=s.max_id_len)
    if not reg.nixl_agent_name:
        raise InvalidArgument("must not be empty", field="nixl_agent_name")
    if len(reg.nixl_agent_name) > s.max_id_len or len(reg.api_url) > 2048:
        raise InvalidArgument("too long", field="nixl_agent_name/api_url")
    check_api_url(reg)
    if reg.layout.tokens_per_block <= 0:
        raise InvalidArgument("must be > 0", field="layout.tokens_per_block")
    if not reg.layout.regions:
        raise InvalidArgument("needs at least one KV region", field="layout.regions")
    if len(reg.layout.compat) > 64 or any(
        len(k) > 64 or len(v) > 1024 for k, v in reg.layout.compat
    ):
        raise InvalidArgument(
            "at most 64 entries, names <= 64 and values <= 1024 chars", field="layout.compat"
        )
    for i, r in enumerate(reg.layout.regions):
        if r.block_len <= 0 or r.num_blocks <= 0 or r.base_addr <= 0:
            raise InvalidArgument(
                "base_addr, block_len and num_blocks must be > 0", field=f"layout.regions[{i}]"
            )


def check_api_url(reg: AgentRegistration) -> None:
    """A routable engine (a vLLM server with the connector) names the URL
    routers send its requests to: without one, ListEngines would list an
    engine no router can use, and requests would meet a 503 with no hint."""
    if reg.routable and not reg.api_url:
        raise InvalidArgument(
            f"engine {reg.engine_id!r} is routable but gave no api_url: set api_url "
            "(its OpenAI API base URL, http://HOST:PORT) in kv_connector_extra_config",
            field="api_url",
        )
    if reg.api_url and not reg.api_url.startswith(("http://", "https://")):
        raise InvalidArgument(
            f"{reg.api_url[:100]!r} is not an http:// or https:// URL", field="api_url"
        )


def side_blocks(
    role: Role,
    eng: EngineRecord,
    blocks: Sequence[Sequence[int]],
    num_tokens: int,
    s: CoreSettings,
) -> BlockGroups:
    """One side's block ids, checked against its engine's layout and its token
    count: decode registers at most the blocks the prompt needs in each KV group,
    prefill at least that many in its longest group (a sliding-window group of
    a hybrid model holds only its window's tail; `orders.mismatch` checks each
    group against the decode side's)."""
    layout = eng.ranks[min(eng.ranks)].reg.layout
    checked = validation.blocks(
        blocks,
        field="block_ids",
        max_groups=s.max_groups,
        max_per_group=s.max_blocks_per_group,
        max_total=s.max_blocks_per_side,
        num_groups=layout.num_groups,
        num_blocks=layout.num_blocks,
    )
    validation.num_tokens(num_tokens)
    need = math.ceil(num_tokens / eng.tokens_per_block)
    if role is Role.DECODE:
        plain: tuple[tuple[int, ...], ...] = checked  # mypyc iterates no NewType
        for g, ids in enumerate(plain):
            if len(ids) > need:
                raise InvalidArgument(
                    f"{len(ids)} blocks for {num_tokens} tokens (at most {need})",
                    field=f"block_ids[{g}]",
                )
    else:
        longest = max(range(len(checked)), key=lambda g: len(checked[g]))
        if len(checked[longest]) < need:
            raise InvalidArgument(
                f"{len(checked[longest])} blocks cannot hold {num_tokens} tokens (need {need})",
                field=f"block_ids[{longest}]",
            )
    return checked


def differing_field(current: Side, side: Side, engine_field: str) -> str:
    """The request field in which a repeated side's report differs from the one
    held (the first of engine, blocks, token count); `current != side`."""
    if current.engine_id != side.engine_id:
        return engine_field
    if current.blocks != side.blocks:
        return "block_ids"
    return "num_tokens"


def refused_side(
    book: InFlight, transfer_id: str, role: Role, engine: str, why: str
) -> list[Effect]:
    """A side refused for good (NoAgents: its engine has no registered
    agents, and its blocks are freed on that answer): its transfer ends
    FAILED, so the other side learns now rather than at the rendezvous
    deadline. An unknown id is recorded ended, for the side still to come.
    A transfer that has that side, or names another engine for it, is not
    this engine's to end (its report would be a Conflict)."""
    t = book.transfers.get(transfer_id)
    if t is None:
        if not validation.valid_transfer_id(transfer_id, book.settings.max_id_len):
            return []
        return book.tombstone(TransferId(transfer_id), Reason.AGENT_LOST, why)[1]
    decode = role is Role.DECODE
    named = t.announced_decode if decode else t.announced_prefill
    if (t.decode if decode else t.prefill) is not None or (named and named != engine):
        return []
    if t.state.terminal:
        return []
    return book.finish(t, State.FAILED, Reason.AGENT_LOST, why)
