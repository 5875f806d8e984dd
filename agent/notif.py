"""The NIXL notification a prefill rank attaches to each WRITE.

Format (ASCII): ``pkv1|<transfer_id>|<prefill_rank>|<expected_writers>``.
Transfer ids never contain '|' (the coordinator validates them). Changing
this format is a protocol break (proto/pushkv/protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = b"pkv1"


@dataclass(frozen=True, slots=True)
class WriteNotif:
    transfer_id: str
    prefill_rank: int
    expected_writers: int

    def encode(self) -> bytes:
        return b"|".join(
            (
                PREFIX,
                self.transfer_id.encode(),
                str(self.prefill_rank).encode(),
                str(self.expected_writers).encode(),
            )
        )

    @classmethod
    def decode(cls, raw: bytes) -> WriteNotif | None:
        """Parse a notification; None for anything that is not ours or is malformed."""
        parts = raw.split(b"|")
        if len(parts) != 4 or parts[0] != PREFIX:
            return None
        try:
            tid = parts[1].decode("ascii")
            rank, expected = int(parts[2]), int(parts[3])
        except (UnicodeDecodeError, ValueError):
            return None
        if not tid or rank < 0 or expected < 1:
            return None
        return cls(tid, rank, expected)
