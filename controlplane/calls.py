"""The bodies of the transfer calls, shared by their unary RPCs and Submit.

Both paths authorize, validate, apply and log identically; errors leave as
PushKVError and are mapped to status codes in one place (status_map). No gRPC
here beyond the request and response messages, so the module compiles with
the rest of the core (controlplane/core_build.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from pushkv.controlplane import convert, logs, status_map
from pushkv.controlplane.auth import Authorizer, Kind, Principal
from pushkv.controlplane.domain import Effect, Role
from pushkv.controlplane.errors import InvalidArgument, NoAgents, PermissionDenied
from pushkv.controlplane.runtime import Runtime
from pushkv.controlplane.transfer import Transfer
from pushkv.rules import block_groups
from pushkv.rules.block_groups import BlockGroups
from pushkv.v1 import pushkv_pb2 as pb

log = structlog.get_logger("pushkv.coordinator")

# The unary method whose authorization rules each kind of Submit call follows.
CALL_METHOD = {
    "register": "/pushkv.v1.TransferService/RegisterDecodeBlocks",
    "prefill_done": "/pushkv.v1.TransferService/ReportPrefillDone",
    "cancel": "/pushkv.v1.TransferService/Cancel",
}


# Per side: its debug log event, and its name in a refusal's detail.
_EVENT = {Role.DECODE: "decode_registered", Role.PREFILL: "prefill_done"}
_SIDE = {Role.DECODE: "decode registration", Role.PREFILL: "prefill report"}


class TransferCalls:
    def __init__(self, rt: Runtime, authz: Authorizer) -> None:
        self._rt = rt
        self._authz = authz

    def register(
        self, p: Principal, request: pb.RegisterDecodeBlocksRequest, resubmitted: bool = False
    ) -> Transfer:
        """`resubmitted`: a Submit call sent again after a failover (resubmission.py)."""
        self._authz.require_engine(p, request.decode_engine_id, field="decode_engine_id")
        core = self._rt.core

        def report(
            tid: str, engine: str, blocks: BlockGroups, n: int
        ) -> tuple[Transfer, list[Effect]]:
            return core.register_decode(tid, engine, blocks, n, resubmitted)

        return self._side(report, request, request.decode_engine_id, Role.DECODE)

    def prefill_done(
        self, p: Principal, request: pb.ReportPrefillDoneRequest, resubmitted: bool = False
    ) -> Transfer:
        self._authz.require_engine(p, request.prefill_engine_id, field="prefill_engine_id")
        core, finished = self._rt.core, request.finished_unix_us / 1e6

        def report(
            tid: str, engine: str, blocks: BlockGroups, n: int
        ) -> tuple[Transfer, list[Effect]]:
            return core.prefill_done(tid, engine, blocks, n, finished, resubmitted)

        return self._side(report, request, request.prefill_engine_id, Role.PREFILL)

    def _side(
        self,
        report: Callable[[str, str, BlockGroups, int], tuple[Transfer, list[Effect]]],
        request: pb.RegisterDecodeBlocksRequest | pb.ReportPrefillDoneRequest,
        engine_id: str,
        role: Role,
    ) -> Transfer:
        """One side's report (an authorized caller): apply it to the core."""
        try:
            t, effects = report(
                request.transfer_id,
                engine_id,
                block_groups.from_pb(request.block_ids),
                request.num_tokens,
            )
        except NoAgents as exc:  # refused for good: the transfer ends with it
            why = f"the {_SIDE[role]} was refused: {exc}"
            ended = self._rt.core.side_refused(request.transfer_id, role, engine_id, why)
            self._rt.apply(ended)
            raise
        self._rt.apply(effects)
        if logs.debug_enabled():
            log.debug(_EVENT[role], transfer_id=t.transfer_id, engine_id=engine_id)
        return t

    def cancel(self, p: Principal, request: pb.CancelRequest) -> Transfer:
        if p.kind is Kind.ENGINE and self._rt.core.has_transfer(request.transfer_id):
            known = self._rt.core.get(request.transfer_id)
            if p.name not in (known.prefill_engine, known.decode_engine):
                raise PermissionDenied(f"{p} is not part of transfer {request.transfer_id}")
        t, effects = self._rt.core.cancel(request.transfer_id, request.reason)
        self._rt.apply(effects)
        log.info("transfer_cancelled", transfer_id=t.transfer_id, reason=request.reason)
        return t

    def submit(
        self, p: Principal, calls: Sequence[pb.TransferCall], response: pb.SubmitResponse
    ) -> None:
        """Apply each call in order; one CallResult each, built in place in `response`."""
        add = response.results.add
        for call in calls:
            kind = call.WhichOneof("kind")
            try:
                if kind is None:
                    raise InvalidArgument("empty call: set register, prefill_done or cancel")
                self._authz.check_method(p, CALL_METHOD[kind])
                if kind == "register":
                    t = self.register(p, call.register, call.resubmitted)
                elif kind == "prefill_done":
                    t = self.prefill_done(p, call.prefill_done, call.resubmitted)
                else:
                    t = self.cancel(p, call.cancel)
            except Exception as exc:  # each call fails alone, with its unary RPC's code
                code, message = status_map.outcome(exc, f"Submit/{kind}")
                add(code=code.value[0], message=message)
                continue
            add(state=convert.STATE_TO_PB[t.state], write_may_land=t.write_may_land)
