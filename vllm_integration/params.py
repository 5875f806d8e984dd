"""The `kv_transfer_params` contract between the router and the engines.

Prefill leg: {"do_remote_decode": true, "transfer_id": T}
Decode leg:  {"do_remote_prefill": true, "transfer_id": T}
             and, when it is seeded with the prefill's first token (the
             router's first token from the prefill), "prefill_tokens": N, the
             prefill's prompt length: the decode leg's prompt is those N
             tokens plus the tokens the prefill sampled, the transfer carries
             the first N, and the decode engine computes the rest itself.
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


def pushed_tokens(raw: dict[str, Any], num_prompt_tokens: int) -> int:
    """How many of a decode leg's prompt tokens the transfer carries: its
    `prefill_tokens` (1 to num_prompt_tokens - 1), else the whole prompt. A
    value out of range is ignored: the coordinator then refuses the pairing
    (the two sides' token counts differ) and the decode engine computes the
    prompt itself, never serving KV for the wrong positions."""
    n = raw.get("prefill_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and 0 < n < num_prompt_tokens:
        return n
    return num_prompt_tokens
