"""gRPC servicers: translate proto <-> domain and call the runtime. No logic here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from pushkv.controlplane import convert
from pushkv.controlplane.auth import Authorizer, Principal
from pushkv.controlplane.calls import TransferCalls
from pushkv.controlplane.errors import (
    FailedPrecondition,
    InvalidArgument,
    PushKVError,
    ResourceExhausted,
)
from pushkv.controlplane.leadership import Leadership, NotLeader, Role, StaleTerm
from pushkv.controlplane.node_stream import NodeChannels, Submit, session_messages
from pushkv.controlplane.runtime import AgentSession, Runtime
from pushkv.controlplane.transfer_filter import TransferFilter
from pushkv.protocol import PROTOCOL_VERSION
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.coordinator")

Ctx = grpc.aio.ServicerContext[Any, Any]
HELLO_TIMEOUT_S = 10.0
DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10_000


# A Submit batch holds at most this many calls (each as heavy as its unary RPC).
MAX_SUBMIT_CALLS = 1024


class TransferServicer(pbg.TransferServiceServicer):
    def __init__(self, rt: Runtime, authz: Authorizer) -> None:
        self._rt = rt
        self._authz = authz
        self._calls = TransferCalls(rt, authz)

    async def BeginTransfer(
        self, request: pb.BeginTransferRequest, context: Ctx
    ) -> pb.TransferStatus:
        t, effects = self._rt.core.begin(
            request.transfer_id, request.prefill_engine_id, request.decode_engine_id
        )
        self._rt.apply(effects)
        return self._rt.status(t)

    async def RegisterDecodeBlocks(
        self, request: pb.RegisterDecodeBlocksRequest, context: Ctx
    ) -> pb.TransferStatus:
        return self._rt.status(self._calls.register(self._authz.principal(context), request))

    async def ReportPrefillDone(
        self, request: pb.ReportPrefillDoneRequest, context: Ctx
    ) -> pb.TransferStatus:
        return self._rt.status(self._calls.prefill_done(self._authz.principal(context), request))

    async def Cancel(self, request: pb.CancelRequest, context: Ctx) -> pb.TransferStatus:
        return self._rt.status(self._calls.cancel(self._authz.principal(context), request))

    async def Submit(self, request: pb.SubmitRequest, context: Ctx) -> pb.SubmitResponse:
        return self.submit(self._authz.principal(context), request)

    def submit(self, principal: Principal, request: pb.SubmitRequest) -> pb.SubmitResponse:
        """A Submit's answer: the RPC's, and a relayed one's (node_stream.py)."""
        calls = request.calls
        if len(calls) > MAX_SUBMIT_CALLS:
            raise InvalidArgument(
                f"{len(calls)} calls in one batch (at most {MAX_SUBMIT_CALLS})", field="calls"
            )
        response = pb.SubmitResponse(term=self._rt.term)
        self._calls.submit(principal, calls, response)
        return response


def _filter(
    states: Any, engine_id: str, min_age_ms: int = 0, max_age_ms: int = 0
) -> TransferFilter:
    wanted = set()
    for s in states:
        st = convert.STATE_FROM_PB.get(s)
        if st is None:
            raise InvalidArgument(f"unknown state {s}", field="states")
        wanted.add(st)
    return TransferFilter(frozenset(wanted), engine_id, min_age_ms / 1000, max_age_ms / 1000)


_ROLES = {
    Role.SINGLE: pb.LEADER_ROLE_SINGLE,
    Role.LEADER: pb.LEADER_ROLE_LEADER,
    Role.STANDBY: pb.LEADER_ROLE_STANDBY,
}


class StatusServicer(pbg.StatusServiceServicer):
    def __init__(self, rt: Runtime, gate: Leadership | None = None) -> None:
        self._rt = rt
        self._gate = gate or Leadership()

    async def GetLeadership(self, request: pb.GetLeadershipRequest, context: Ctx) -> pb.Leadership:
        v = self._gate.view
        return pb.Leadership(
            role=_ROLES[v.role], leader=v.leader, term=v.term, advertise=v.advertise, etcd=v.etcd
        )

    async def GetTransfer(self, request: pb.GetTransferRequest, context: Ctx) -> pb.TransferStatus:
        return self._rt.status(self._rt.core.get(request.transfer_id))

    async def ListTransfers(
        self, request: pb.ListTransfersRequest, context: Ctx
    ) -> pb.ListTransfersResponse:
        flt = _filter(request.states, request.engine_id, request.min_age_ms, request.max_age_ms)
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        found, total = self._rt.core.find(flt, limit)
        return pb.ListTransfersResponse(
            transfers=[self._rt.status(t) for t in found], total_matching=total
        )

    async def WatchTransfers(
        self, request: pb.WatchTransfersRequest, context: Ctx
    ) -> AsyncIterator[pb.TransferEvent]:
        flt = _filter(request.states, request.engine_id)
        w = self._rt.watch(flt)  # before the replay: no change between the two is lost
        try:
            if request.include_existing:
                # Every matching transfer still held, oldest first: live ones and
                # terminal ones within their retention (a watch for terminal states
                # sees what ended before it started; `pushkv status watch --existing`).
                found, _ = self._rt.core.find(flt, MAX_LIST_LIMIT)
                for t in reversed(found):
                    yield pb.TransferEvent(transfer=self._rt.status(t))
            while True:
                event = await w.queue.get()
                if event is None:
                    if w.overflowed:
                        raise ResourceExhausted("watcher fell too far behind; re-list and watch")
                    return
                yield event
        finally:
            self._rt.unwatch(w)

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: Ctx
    ) -> pb.ListEnginesResponse:
        return pb.ListEnginesResponse(engines=self._rt.engines(request.role))


class AgentServicer(pbg.AgentServiceServicer):
    def __init__(
        self,
        rt: Runtime,
        authz: Authorizer,
        gate: Leadership,
        submit: Submit,
    ) -> None:
        self._rt = rt
        self._authz = authz
        self._gate = gate
        self._submit = submit  # what a NodeStream's relayed Submits call (TransferServicer.submit)

    def _fence(self) -> None:
        """Nothing goes to an agent once this replica may no longer order."""
        if not self._gate.may_order():
            v = self._gate.view
            raise NotLeader(v.leader if v.role is Role.STANDBY else "", v.term)

    def open_agent(
        self, first: pb.AgentMessage, principal: Principal, via: str = ""
    ) -> AgentSession:
        """The session for an agent stream whose first message is `first`
        (AgentStream, or one channel of a NodeStream): the hello's checks."""
        if first.WhichOneof("kind") != "hello":
            raise InvalidArgument("the first message must be hello", field="hello")
        if first.hello.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"agent speaks protocol {first.hello.protocol_version}, coordinator "
                f"{PROTOCOL_VERSION}: upgrade the older side",
                field="hello.protocol_version",
            )
        self._authz.require_engine(
            principal, first.hello.identity.engine_id, field="hello.identity.engine_id"
        )
        if self._rt.term and first.hello.term > self._rt.term:
            raise StaleTerm(self._rt.term, first.hello.term)  # term fencing
        return self._rt.open_session(
            convert.registration_from_pb(first.hello),
            accepts_batches=first.hello.accepts_batches,
            held=convert.held_from_pb(first.hello),
            # Adopted only from a rebuilding agent that followed an older
            # leader (a failover); otherwise what ended is told again.
            adopt=first.hello.term < self._rt.term and not first.hello.held_tell_only,
            via=via,
        )

    async def AgentStream(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Ctx
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        try:
            first = await asyncio.wait_for(anext(request_iterator), HELLO_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            raise InvalidArgument("the first message must be hello", field="hello") from None
        session = self.open_agent(first, self._authz.principal(context))
        broken: list[PushKVError] = []

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    try:
                        self._rt.on_agent_message(session, msg)
                    except Exception as exc:  # a bad report must not kill the stream
                        log.warning(
                            "agent_message_rejected", agent=str(session.key), error=str(exc)
                        )
            except PushKVError as exc:  # an undecodable message ends the stream with its code
                broken.append(exc)
            finally:
                session.close()

        reader = asyncio.get_running_loop().create_task(read(), name=f"agent-{session.key}")
        try:
            async for out in session_messages(session):
                self._fence()
                yield out
            if broken:
                raise broken[0]
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self._rt.close_session(session)

    def NodeStream(
        self, request_iterator: AsyncIterator[pb.NodeUp], context: Ctx
    ) -> AsyncIterator[pb.NodeDown]:
        principal = self._authz.principal(context)
        node = NodeChannels(
            self._rt, self.open_agent, principal, self._fence, self._submit, context.peer()
        )
        return node.serve(request_iterator)
