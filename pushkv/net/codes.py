"""How a client of the coordinator reads its gRPC status codes.

The coordinator maps its errors to codes in one place
(controlplane/status_map.py); these sets are the client side of that map.
"""

from __future__ import annotations

import grpc

# Transient: the same call may succeed on a retry (or on another coordinator).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

# The coordinator refused the call before recording anything.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)

# Refusals that retrying the same call unchanged can never fix.
PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)

_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def code_of(number: int) -> grpc.StatusCode | None:
    """The status code with this wire number (as in a google.rpc.Status), if any."""
    return _BY_NUMBER.get(number)
