"""The `kv_transfer_params` contract between the router and the engines.

Prefill leg: {"do_remote_decode": true, "transfer_id": T}
Decode leg:  {"do_remote_prefill": true, "transfer_id": T}
The transfer id is the only key the two legs share.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class TransferParams(NamedTuple):  # a tuple: cheap to build on the engine thread
    transfer_id: str
    prefill_side: bool  # this engine computes the KV and pushes it
    decode_side: bool  # this engine receives the KV

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> TransferParams | None:
        """None for requests that are not part of a pushkv transfer."""
        if not isinstance(raw, dict):
            return None
        tid = raw.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            return None
        prefill = raw.get("do_remote_decode") is True
        decode = raw.get("do_remote_prefill") is True
        if prefill == decode:
            return None
        return cls(tid, prefill, decode)
