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


@dataclass(frozen=True, slots=True)
class Result:
    call: Call
    state: int  # pb.TransferState; 0 when the call failed
    error: str = ""

    @property
    def terminal(self) -> bool:
        return self.state >= pb.TRANSFER_STATE_COMPLETE

    @property
    def ok(self) -> bool:
        return not self.error


class CoordinatorClient:
    def __init__(self, address: str, *, timeout_s: float = 5.0, attempts: int = 3) -> None:
        self._address = address
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
        channel = grpc.insecure_channel(self._address)
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
                return Result(c, st.state)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                last = f"{getattr(code, 'name', code)}: {details}"
                # Only transport trouble is retried; the calls are idempotent.
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    break
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
