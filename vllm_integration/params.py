"""The `kv_transfer_params` contract between the router and the engines.

Prefill leg: {"do_remote_decode": true, "transfer_id": T}
Decode leg:  {"do_remote_prefill": true, "transfer_id": T}
The transfer id is the only key the two legs share. Anything else (no
transfer id, both flags or neither) is not a pushkv request.
"""

from __future__ import annotations

from typing import Any

DECODE_LEG = "do_remote_prefill"  # the flag a decode leg carries
PREFILL_LEG = "do_remote_decode"  # the flag a prefill leg carries


def leg_tid(raw: Any, flag: str, other: str) -> str | None:
    """The transfer id if `raw` carries `flag` (and not `other`), else None.

    Runs on vLLM's engine thread for every request: it builds nothing."""
    if not isinstance(raw, dict) or raw.get(flag) is not True:
        return None
    tid = raw.get("transfer_id")
    if not isinstance(tid, str) or not tid or raw.get(other) is True:
        return None
    return tid
