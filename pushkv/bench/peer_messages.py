"""``python -m pushkv.bench.peer_messages``: what introducing a decode rank to one more
prefill session costs the coordinator, with the PeerInfo message built for
each session (before) against built once per incarnation and shared
(controlplane/peer_messages.py), for a small layout and a 64-layer one.

Each figure is the median of 5 repetitions of 2,000, and includes the
serialization the message then gets: alone on an agent's stream, or copied
into a batch (a batching agent, or a relay's NodeStream)."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable

from pushkv.controlplane import convert
from pushkv.controlplane.domain import AgentRegistration, EngineId, KVLayout, KVRegion, Role
from pushkv.controlplane.peer_messages import PeerMessages
from pushkv.controlplane.registry import Registry
from pushkv.v1 import pushkv_pb2 as pb

REGIONS = (2, 128)  # one K and one V region; two per layer of a 64-layer model
METADATA_BYTES = 6000  # about a UCX agent's NIXL metadata


def _median_us(f: Callable[[], object], n: int = 2000) -> float:
    return statistics.median(timeit.repeat(f, number=n, repeat=5)) / n * 1e6


def _one(regions: int) -> str:
    layout = KVLayout(
        16,
        tuple(KVRegion((i + 1) << 20, 16384, 1000, layer=i // 2) for i in range(regions)),
        compat=(("dtype", "bfloat16"),),
        kv_heads=8,
    )
    metadata = b"x" * METADATA_BYTES
    reg = AgentRegistration(EngineId("d7"), Role.DECODE, 3, 8, "i1", "d7-3", metadata, layout)
    registry = Registry(lease_s=5)
    registry.hello(reg, 0.0)
    rec = registry.agent(reg.key)
    assert rec is not None
    cache = PeerMessages(registry)

    def built() -> pb.CoordinatorMessage:
        return pb.CoordinatorMessage(peer=convert.peer_to_pb(reg))

    def batched(msg: pb.CoordinatorMessage) -> bytes:
        out = pb.CoordinatorMessage()
        out.batch.messages.append(msg)
        return out.SerializeToString()

    a0 = _median_us(lambda: built().SerializeToString())
    a1 = _median_us(lambda: cache.get(rec).SerializeToString())
    b0 = _median_us(lambda: batched(built()))
    b1 = _median_us(lambda: batched(cache.get(rec)))
    return (
        f"regions={regions} bytes={cache.get(rec).ByteSize()} "
        f"alone_us={a0:.1f}->{a1:.1f} ({a1 / a0:.2f}x) "
        f"batched_us={b0:.1f}->{b1:.1f} ({b1 / b0:.2f}x)"
    )


def main() -> None:
    for regions in REGIONS:
        print(_one(regions))


if __name__ == "__main__":
    main()
