"""Per-step metadata from the scheduler half to the worker half."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm_integration.compat import KVConnectorMetadata


class RecvSpec(NamedTuple):
    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]


class FireSpec(NamedTuple):
    """Prefill: a request's prompt is computed by this step's forward (or,
    late, it finished without such a step being seen): its agent fires the
    transfer's armed order, if it holds one (pushkv.proto, TransferOrder.armed)."""

    transfer_id: str
    # Per KV group, the blocks the engine holds of the prompt (a tail ending
    # at the prompt's last block).
    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    # Progressive push: a chunk's fire (final False) and the prompt tokens
    # computed through this step; a final fire after a preemption (restart).
    computed_tokens: int = 0
    final: bool = True
    restart: bool = False


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
    # Prefill: fire these transfers' armed orders once this step's forward is done.
    fire: list[FireSpec] = field(default_factory=list)
    # Prefill: held transfers whose request was aborted after it fired: the
    # agent drops an order not yet posted and frees the blocks once no WRITE
    # of them is in flight.
    abort: list[str] = field(default_factory=list)
    # Nothing was scheduled this step: the worker may wait briefly for events.
    idle: bool = False
