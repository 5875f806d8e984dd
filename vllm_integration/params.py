"""The `kv_transfer_params` contract between the router and the engines.

Prefill leg: {"do_remote_decode": true, "transfer_id": T}
Decode leg:  {"do_remote_prefill": true, "transfer_id": T}
The transfer id is the only key the two legs share. Anything else (no
transfer id, both flags or neither) is not a pushkv request.
"""

from __future__ import annotations

from typing import Any


# Both run on vLLM's engine thread for every request: they build nothing.
def decode_tid(raw: Any) -> str | None:
    """The transfer id if `raw` is a decode leg's params, else None."""
    if not isinstance(raw, dict) or raw.get("do_remote_prefill") is not True:
        return None
    tid = raw.get("transfer_id")
    if not isinstance(tid, str) or not tid or raw.get("do_remote_decode") is True:
        return None
    return tid


def prefill_tid(raw: Any) -> str | None:
    """The transfer id if `raw` is a prefill leg's params, else None."""
    if not isinstance(raw, dict) or raw.get("do_remote_decode") is not True:
        return None
    tid = raw.get("transfer_id")
    if not isinstance(tid, str) or not tid or raw.get("do_remote_prefill") is True:
        return None
    return tid
