"""What the agent tells its host (the vLLM worker), and the host's commands."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventKind(enum.Enum):
    # Decode: every expected prefill rank's WRITE has landed.
    KV_READY = "kv_ready"
    # Decode: the transfer failed, was cancelled or expired, and no WRITE can
    # land any more, so the blocks may be reused (recompute, fail or free).
    KV_FAILED = "kv_failed"
    # Prefill: this rank will never read these blocks again; free them.
    BLOCKS_FREE = "blocks_free"


@dataclass(frozen=True, slots=True)
class HostEvent:
    kind: EventKind
    transfer_id: str
    detail: str = ""
