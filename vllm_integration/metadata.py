"""Per-step metadata from the scheduler half to the worker half."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pushkv.agent.messages import FireMsg
from pushkv.rules.block_groups import BlockGroups
from pushkv.vllm_integration.compat import KVConnectorMetadata


class RecvSpec(NamedTuple):
    request_id: str
    transfer_id: str
    blocks: BlockGroups  # per KV group, the blocks registered for the KV


@dataclass
class PushKVMetadata(KVConnectorMetadata):  # type: ignore[misc]
    # Decode: requests whose blocks were registered and now wait for KV.
    recv: list[RecvSpec] = field(default_factory=list)
    # Decode: requests to fail at once (registration refused or impossible).
    fail: list[RecvSpec] = field(default_factory=list)
    # Prefill: requests whose blocks are held until the agent frees them.
    send: list[tuple[str, str]] = field(default_factory=list)  # (request id, transfer id)
    # Prefill: the held prompt blocks by transfer id, only while the test hook
    # kv_digest is armed (vllm_integration/fault_hooks.py).
    send_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Prefill: held requests whose blocks no WRITE will ever read (the coordinator
    # refused or had already ended the transfer): free them without waiting for
    # the agent, which is never told about such a transfer.
    free: list[tuple[str, str]] = field(default_factory=list)  # (request id, transfer id)
    # Prefill: requests whose prompt (or a chunk of it) this step's forward
    # computes: after it, the worker hands each to its agent, which fires the
    # transfer's armed order if it holds one (pushkv.proto, TransferOrder.armed).
    fire: list[FireMsg] = field(default_factory=list)
    # Prefill: held transfers whose request was aborted after it fired: the
    # agent drops an order not yet posted and frees the blocks once no WRITE
    # of them is in flight.
    abort: list[str] = field(default_factory=list)
    # Nothing was scheduled this step: the worker may wait briefly for events.
    idle: bool = False
