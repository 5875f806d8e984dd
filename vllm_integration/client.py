"""The scheduler half's coordinator client: RPCs run on one background thread.

The engine thread only enqueues calls and drains results; it never waits on
the network.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

from controlplane.tls import TLSFiles
from controlplane.tls import channel as tls_channel

log = logging.getLogger("pushkv.connector")


@dataclass(frozen=True, slots=True)
class Call:
    kind: str  # "register" | "prefill_done" | "cancel"
    request_id: str
    transfer_id: str
    engine_id: str = ""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    reason: str = ""


# Error codes with which the coordinator refuses a call before recording anything.
_REFUSALS = frozenset(
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


@dataclass(frozen=True, slots=True)
class Result:
    call: Call
    state: int  # pb.TransferState; 0 when the call failed
    error: str = ""
    # From the answer: a WRITE of this transfer may still be in flight.
    write_may_land: bool = False
    # The call was answered with an error that means nothing was recorded (as
    # opposed to a transport failure, after which the outcome is unknown).
    refused: bool = False

    @property
    def terminal(self) -> bool:
        return self.state >= pb.TRANSFER_STATE_COMPLETE

    @property
    def ok(self) -> bool:
        return not self.error


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 5.0,
        attempts: int = 3,
        tls: TLSFiles | None = None,
    ) -> None:
        self._address = address
        self._tls = tls
        self._timeout = timeout_s
        self._attempts = attempts
        self._calls: queue.Queue[Call | None] = queue.Queue()
        self.results: queue.Queue[Result] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pushkv-coord-client", daemon=True)
        self._thread.start()

    def submit(self, call: Call) -> None:
        self._calls.put(call)

    def drain(self) -> list[Result]:
        out: list[Result] = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 5.0) -> None:
        self._calls.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        channel = tls_channel(self._address, self._tls)
        stub = pbg.TransferServiceStub(channel)
        try:
            while (call := self._calls.get()) is not None:
                self.results.put(self._do(stub, call))
        finally:
            channel.close()

    def _do(self, stub: pbg.TransferServiceStub, c: Call) -> Result:
        blocks = [pb.BlockIds(ids=list(c.block_ids))]
        last = ""
        for attempt in range(self._attempts):
            try:
                if c.kind == "register":
                    st = stub.RegisterDecodeBlocks(
                        pb.RegisterDecodeBlocksRequest(
                            transfer_id=c.transfer_id,
                            decode_engine_id=c.engine_id,
                            block_ids=blocks,
                            num_tokens=c.num_tokens,
                        ),
                        timeout=self._timeout,
                    )
                elif c.kind == "prefill_done":
                    st = stub.ReportPrefillDone(
                        pb.ReportPrefillDoneRequest(
                            transfer_id=c.transfer_id,
                            prefill_engine_id=c.engine_id,
                            block_ids=blocks,
                            num_tokens=c.num_tokens,
                        ),
                        timeout=self._timeout,
                    )
                else:
                    st = stub.Cancel(
                        pb.CancelRequest(transfer_id=c.transfer_id, reason=c.reason[:1000]),
                        timeout=self._timeout,
                    )
                return Result(c, st.state, write_may_land=st.write_may_land)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                last = f"{getattr(code, 'name', code)}: {details}"
                # Only transport trouble is retried; the calls are idempotent.
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return Result(c, 0, last, refused=code in _REFUSALS)
                log.warning(
                    "coordinator %s for %s failed (attempt %d): %s",
                    c.kind,
                    c.transfer_id,
                    attempt + 1,
                    last,
                )
        return Result(c, 0, last)


def block_tuple(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(b) for b in ids)
