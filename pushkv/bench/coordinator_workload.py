"""What every coordinator benchmark drives: one engine pair, the coordinator's
settings, and the two requests of a rendezvous.

`pushkv bench coordinator` (over gRPC) and `pushkv bench core` (in-process)
share these, so the two describe the same work: a 1-prefill + 1-decode engine
pair at TP 1, 40 tokens in 3 blocks of 16 on each side.
"""

from __future__ import annotations

from typing import Any

PREFILL, DECODE = "bench-p", "bench-d"
TOKENS = 40  # 3 blocks of 16 tokens on both sides
DECODE_BLOCKS = (7, 8, 9)
PREFILL_BLOCKS = (1, 2, 3)
COMPLETE = 6  # pb.TRANSFER_STATE_COMPLETE (kept free of protobuf for the controller)
CORE_SETTINGS: dict[str, Any] = {
    "max_inflight": 1_000_000,
    "max_inflight_per_engine": 1_000_000,
    "rendezvous_timeout_s": 600.0,
    "write_timeout_s": 600.0,
    "retention_s": 30.0,
}
RPC_TIMEOUT_S = 60.0


def agent_hello(engine: str, role: Any, *, batched: bool, rank: int = 0, tp: int = 1) -> Any:
    """The hello of the benchmark's simulated agent `rank` of `engine` (TP `tp`)."""
    from pushkv.protocol import PROTOCOL_VERSION
    from pushkv.v1 import pushkv_pb2 as pb

    region = pb.KVRegion(base_addr=0x1000_0000, block_len=4096, num_blocks=4096)
    return pb.AgentHello(
        protocol_version=PROTOCOL_VERSION,
        identity=pb.AgentIdentity(
            engine_id=engine, role=role, tp_rank=rank, tp_size=tp, incarnation="b1"
        ),
        nixl_agent_name=f"{engine}-{rank}",
        nixl_metadata=b"x" * 256,
        layout=pb.KVLayout(tokens_per_block=16, regions=[region]),
        accepts_batches=batched,
    )


def decode_request(tid: str, engine: str = DECODE) -> Any:
    """The decode engine's RegisterDecodeBlocksRequest for transfer `tid`."""
    from pushkv.v1 import pushkv_pb2 as pb

    return pb.RegisterDecodeBlocksRequest(
        transfer_id=tid,
        decode_engine_id=engine,
        block_ids=[pb.BlockIds(ids=DECODE_BLOCKS)],
        num_tokens=TOKENS,
    )


def prefill_request(tid: str, engine: str = PREFILL) -> Any:
    """The prefill engine's ReportPrefillDoneRequest for transfer `tid`."""
    from pushkv.v1 import pushkv_pb2 as pb

    return pb.ReportPrefillDoneRequest(
        transfer_id=tid,
        prefill_engine_id=engine,
        block_ids=[pb.BlockIds(ids=PREFILL_BLOCKS)],
        num_tokens=TOKENS,
    )


def core_label(build: str) -> str:
    """The `core:` line for a build name of `pushkv.controlplane.core_build`."""
    return "core: compiled (mypyc)" if build == "compiled" else "core: pure Python"


def core_build() -> str:
    """The `core:` line of the build of the core that THIS process imports."""
    from pushkv.controlplane.core_build import core_build as build

    return core_label(build())
