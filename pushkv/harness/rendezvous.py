"""Both arrivals of one transfer's rendezvous, sent from outside the engines.

The data-plane demo and `pushkv bench order` drive KV hosts (pushkv/harness/kvhost.py)
this way: the decode side registers the blocks it will receive into, the
prefill side reports the blocks it filled, in the order asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg


def rendezvous(
    stub: pbg.TransferServiceStub,
    transfer_id: str,
    *,
    prefill: str,
    decode: str,
    src: Sequence[int],
    dst: Sequence[int],
    num_tokens: int,
    decode_first: bool,
    timeout: float = 10.0,
) -> None:
    """RegisterDecodeBlocks (engine ``decode``, blocks ``dst``) and ReportPrefillDone
    (engine ``prefill``, blocks ``src``), the decode side's first if ``decode_first``."""
    register = pb.RegisterDecodeBlocksRequest(
        transfer_id=transfer_id,
        decode_engine_id=decode,
        block_ids=[pb.BlockIds(ids=dst)],
        num_tokens=num_tokens,
    )
    done = pb.ReportPrefillDoneRequest(
        transfer_id=transfer_id,
        prefill_engine_id=prefill,
        block_ids=[pb.BlockIds(ids=src)],
        num_tokens=num_tokens,
    )
    if decode_first:
        stub.RegisterDecodeBlocks(register, timeout=timeout)
        stub.ReportPrefillDone(done, timeout=timeout)
    else:
        stub.ReportPrefillDone(done, timeout=timeout)
        stub.RegisterDecodeBlocks(register, timeout=timeout)
