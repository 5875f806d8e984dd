"""Domain errors. Each maps to exactly one gRPC status code in controlplane/status_map.py."""

from __future__ import annotations


class PushKVError(Exception):
    """Base class; `field` names the offending request field when there is one."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class InvalidArgument(PushKVError):
    """The request itself is malformed; retrying it unchanged cannot succeed."""


class NotFound(PushKVError):
    pass


class Conflict(PushKVError):
    """A retried call carries a different payload than the first one."""


class FailedPrecondition(PushKVError):
    """The request is well formed but the system is not in a state to accept it."""


class NoAgents(FailedPrecondition):
    """A side's engine has no registered agents, so that side cannot be served:
    the transfer it names ends with it (Rendezvous.side_refused)."""


class ResourceExhausted(PushKVError):
    pass


class PermissionDenied(PushKVError):
    pass


class Unauthenticated(PushKVError):
    pass


class Unavailable(PushKVError):
    """Not now, nothing recorded: the same call may succeed shortly (a new
    leader still rebuilding its state after a failover)."""
