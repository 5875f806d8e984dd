"""The gate to the test-only fault hooks (vllm_integration/fault_hooks.py).

Production code paths never import the hooks: `armed()` imports them only in
a process whose environment names a fault (`PUSHKV_TEST_FAULT`, set by tests
on the engines they start), and otherwise returns None, so a call site is
`if faults is not None: faults.kv_sent(...)`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pushkv.agent.runtime import Agent

ENV = "PUSHKV_TEST_FAULT"


class FaultHooks(Protocol):
    """What the connector calls of the hooks module (a module implements it)."""

    DIGEST: bool

    def kv_sent(self, agent: Agent | None, transfer_id: str, block_ids: Sequence[int]) -> None: ...

    def kv_arrived(
        self, agent: Agent | None, transfer_id: str, block_ids: Sequence[int]
    ) -> None: ...

    def hold_fire(self) -> None: ...


def armed() -> FaultHooks | None:
    """The hooks where a test armed one in this process's environment, else None."""
    if not os.environ.get(ENV):
        return None
    hooks: FaultHooks = importlib.import_module("pushkv.vllm_integration.fault_hooks")
    return hooks
