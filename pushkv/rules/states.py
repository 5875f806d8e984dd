"""Transfer states as the contract numbers them, read by the coordinator's clients."""

from __future__ import annotations

from pushkv.v1 import pushkv_pb2 as pb

# A transfer in one of these states changes no more. Compare against this set,
# never by number: TRANSFER_STATE_ARMED (10) is not terminal.
TERMINAL: frozenset[pb.TransferState.ValueType] = frozenset(
    {
        pb.TRANSFER_STATE_COMPLETE,
        pb.TRANSFER_STATE_FAILED,
        pb.TRANSFER_STATE_CANCELLED,
        pb.TRANSFER_STATE_EXPIRED,
    }
)
