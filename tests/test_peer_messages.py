"""The PeerInfo message of a write target: built once per incarnation, shared
by the sessions that learn of it, replaced when the rank registers again, and
forgotten once the rank is gone (controlplane/peer_messages.py)."""

from __future__ import annotations

from pushkv.controlplane import peer_messages
from pushkv.controlplane.domain import AgentRegistration, EngineId, KVLayout, KVRegion, Role
from pushkv.controlplane.peer_messages import PeerMessages
from pushkv.controlplane.registry import AgentRecord, Registry
from pushkv.v1 import pushkv_pb2 as pb

LAYOUT = KVLayout(16, tuple(KVRegion(0x1000 * (i + 1), 4096, 64, layer=i) for i in range(8)))


def hello(registry: Registry, engine: str, inc: str, now: float = 0.0) -> AgentRecord:
    reg = AgentRegistration(
        EngineId(engine), Role.DECODE, 0, 1, inc, f"{engine}-{inc}", f"md-{inc}".encode(), LAYOUT
    )
    registry.hello(reg, now)
    rec = registry.agent(reg.key)
    assert rec is not None
    return rec


def test_one_message_per_incarnation() -> None:
    registry = Registry(lease_s=5)
    msgs = PeerMessages(registry)
    first = msgs.get(hello(registry, "d0", "i1"))
    assert first.WhichOneof("kind") == "peer"
    assert (first.peer.identity.incarnation, first.peer.nixl_metadata) == ("i1", b"md-i1")
    assert [r.layer for r in first.peer.layout.regions] == list(range(8))
    # The same incarnation again (a reconnect): the same message, not rebuilt.
    assert msgs.get(hello(registry, "d0", "i1")) is first

    # Registered again: the new incarnation's message, never the old one.
    second = msgs.get(hello(registry, "d0", "i2"))
    assert second is not first
    assert (second.peer.identity.incarnation, second.peer.nixl_metadata) == ("i2", b"md-i2")
    assert len(msgs) == 1

    # Copied into a batch, the shared message stays as built.
    batch = pb.CoordinatorMessage()
    batch.batch.messages.append(second)
    batch.batch.messages[0].peer.nixl_metadata = b"changed"
    assert second.peer.nixl_metadata == b"md-i2"


def test_entries_of_ranks_gone_are_pruned() -> None:
    registry = Registry(lease_s=5)
    msgs = PeerMessages(registry)
    n = peer_messages.MIN_PRUNE_AT
    for i in range(n):  # engines that then leave (their leases end)
        msgs.get(hello(registry, f"gone-{i}", "i1", now=0.0))
    registry.expire(now=10.0)
    live = [hello(registry, f"live-{i}", "i1", now=10.0) for i in range(3)]
    for rec in live:
        msgs.get(rec)
    # Past the bound: only the three registered ranks stay.
    assert len(msgs) == 3
    assert all(msgs.get(rec).peer.identity.engine_id.startswith("live-") for rec in live)


def test_the_bench_line() -> None:
    from pushkv.bench.peer_messages import _one

    line = _one(2)
    assert line.startswith("regions=2 bytes=") and "alone_us=" in line and "batched_us=" in line
