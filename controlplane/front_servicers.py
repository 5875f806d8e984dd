"""The gRPC servicers of a coordinator whose state lives in partition
processes (`--partition-procs K`, experimental; controlplane/front.py): each
RPC goes to the front, which passes it to its transfer's partition or to all
of them. Translation only, as servicers.py; errors are domain errors, mapped
to status codes by the server's interceptor (status_map.py).

Each caller is authenticated here, as by the replica's own servicers, and
named to the partition on what it sends (PartitionUp.principal): the method
is checked by the server's interceptor, and the partition authorizes each
hello, Submit call and transfer RPC as that caller (controlplane/auth.py).

The replica serves these, and so does each of its front processes on the
same port (`--fronts F`, controlplane/front_host.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from pushkv.controlplane.auth import Authorizer, principal_to_wire
from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.leadership import Leadership
from pushkv.controlplane.servicers import Ctx, fence, first_message, leadership_reply
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg


class FrontTransferServicer(pbg.TransferServiceServicer):
    def __init__(self, front: PartitionFront, authz: Authorizer) -> None:
        self._front = front
        self._authz = authz

    def _caller(self, context: Ctx) -> str:
        return principal_to_wire(self._authz.principal(context))

    async def BeginTransfer(
        self, request: pb.BeginTransferRequest, context: Ctx
    ) -> pb.TransferStatus:
        call = ppb.PartitionCall(begin=request)
        return await self._front.transfer_call(call, request.transfer_id, self._caller(context))

    async def RegisterDecodeBlocks(
        self, request: pb.RegisterDecodeBlocksRequest, context: Ctx
    ) -> pb.TransferStatus:
        call = ppb.PartitionCall(register=request)
        return await self._front.transfer_call(call, request.transfer_id, self._caller(context))

    async def ReportPrefillDone(
        self, request: pb.ReportPrefillDoneRequest, context: Ctx
    ) -> pb.TransferStatus:
        call = ppb.PartitionCall(prefill_done=request)
        return await self._front.transfer_call(call, request.transfer_id, self._caller(context))

    async def Cancel(self, request: pb.CancelRequest, context: Ctx) -> pb.TransferStatus:
        call = ppb.PartitionCall(cancel=request)
        return await self._front.transfer_call(call, request.transfer_id, self._caller(context))

    async def Submit(self, request: pb.SubmitRequest, context: Ctx) -> pb.SubmitResponse:
        return await self._front.submit_rpc(request, self._caller(context))


class FrontStatusServicer(pbg.StatusServiceServicer):
    """Reads from the partitions; GetLeadership as the replica's own, naming
    the front process that answered (`index`: 0 is the replica's own)."""

    def __init__(self, front: PartitionFront, gate: Leadership, index: int = 0) -> None:
        self._front = front
        self._gate = gate
        self._index = index

    async def GetLeadership(self, request: pb.GetLeadershipRequest, context: Ctx) -> pb.Leadership:
        return leadership_reply(self._gate.view, self._index)

    async def GetTransfer(self, request: pb.GetTransferRequest, context: Ctx) -> pb.TransferStatus:
        call = ppb.PartitionCall(get=request)
        return await self._front.transfer_call(call, request.transfer_id)

    async def ListTransfers(
        self, request: pb.ListTransfersRequest, context: Ctx
    ) -> pb.ListTransfersResponse:
        return await self._front.list_transfers(request)

    async def WatchTransfers(
        self, request: pb.WatchTransfersRequest, context: Ctx
    ) -> AsyncIterator[pb.TransferEvent]:
        # The method was checked at the interceptor; a read needs no more.
        async with contextlib.aclosing(self._front.watch(request)) as events:
            async for event in events:
                yield event

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: Ctx
    ) -> pb.ListEnginesResponse:
        return await self._front.list_engines(request)


class FrontAgentServicer(pbg.AgentServiceServicer):
    def __init__(self, front: PartitionFront, authz: Authorizer, gate: Leadership) -> None:
        self._front = front
        self._authz = authz
        self._gate = gate

    def _fence(self) -> None:
        fence(self._gate)  # as AgentServicer: nothing to an agent unless this replica orders

    async def AgentStream(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Ctx
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        first = await first_message(request_iterator)

        async def messages() -> AsyncIterator[pb.AgentMessage]:
            yield first
            async for m in request_iterator:
                yield m

        self._fence()
        caller = principal_to_wire(self._authz.principal(context))
        served = self._front.agent_stream(messages(), _peer(context), caller)
        async with contextlib.aclosing(served) as outs:
            async for out in outs:
                self._fence()
                yield out

    async def NodeStream(
        self, request_iterator: AsyncIterator[pb.NodeUp], context: Ctx
    ) -> AsyncIterator[pb.NodeDown]:
        self._fence()
        caller = principal_to_wire(self._authz.principal(context))
        served = self._front.stream(_peer(context), caller).serve(request_iterator)
        async with contextlib.aclosing(served) as downs:  # its reader ends with the RPC
            async for down in downs:
                self._fence()
                yield down


def _peer(context: Any) -> str:
    peer = context.peer() if context is not None else ""
    return str(peer)
