"""The scheduler half's coordinator client: RPCs run on one background thread.

The engine thread only appends calls and drains results; it never waits on
the network and takes no lock on the common path (deque appends and pops are
atomic). The client thread sends everything queued since its last RPC as one
`Submit` batch, so a busy engine costs one RPC per round trip, not per call.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import grpc
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

from wire.codes import REFUSALS, RETRYABLE, code_of
from wire.leader import LeaderFollower
from wire.states import TERMINAL
from wire.tls import TLSFiles
from wire.tls import channel as tls_channel

log = logging.getLogger("pushkv.connector")

MAX_BATCH = 256  # calls per Submit RPC (the coordinator accepts more)
IDLE_WAKE_S = 1.0  # an idle client thread checks for close() at least this often
# With several coordinator replicas, a call is retried (on the leader a standby
# names, or the next address) for this long: a failover takes about one etcd TTL.
FAILOVER_S = 5.0


class Call(NamedTuple):  # a tuple: built on the engine thread, so cheap
    kind: str  # "register" | "prefill_done" | "cancel"
    request_id: str
    transfer_id: str
    engine_id: str = ""
    block_ids: tuple[int, ...] = ()  # KV cache group 0 (the only one without HMA)
    num_tokens: int = 0
    reason: str = ""
    # KV cache groups 1.. (vLLM's hybrid KV cache manager), each its own list.
    more_groups: tuple[tuple[int, ...], ...] = ()
    # prefill_done: when the engine finished the request (unix seconds; 0: unknown).
    finished_unix: float = 0.0


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
        return self.state in TERMINAL

    @property
    def complete(self) -> bool:
        return self.state == pb.TRANSFER_STATE_COMPLETE

    @property
    def ok(self) -> bool:
        return not self.error


def needs_engine(res: Result) -> bool:
    """Whether the scheduler half must act on (or log) this result.

    The common answers (a registration or prefill report accepted, its
    transfer still live or its WRITE still possible) need nothing, so the
    client thread drops them instead of handing them to vLLM's engine thread."""
    return bool(res.error) or res.call.kind == "cancel" or (res.terminal and not res.write_may_land)


def _error_result(c: Call, code: grpc.StatusCode | None, details: str) -> Result:
    text = f"{getattr(code, 'name', code)}: {details}"
    return Result(c, 0, text, refused=code in REFUSALS)


def _groups(c: Call) -> list[pb.BlockIds]:
    first = pb.BlockIds(ids=c.block_ids)
    if not c.more_groups:
        return [first]
    return [first, *(pb.BlockIds(ids=g) for g in c.more_groups)]


def _to_proto(c: Call) -> pb.TransferCall:
    if c.kind == "register":
        return pb.TransferCall(
            register=pb.RegisterDecodeBlocksRequest(
                transfer_id=c.transfer_id,
                decode_engine_id=c.engine_id,
                block_ids=_groups(c),
                num_tokens=c.num_tokens,
            )
        )
    if c.kind == "prefill_done":
        return pb.TransferCall(
            prefill_done=pb.ReportPrefillDoneRequest(
                transfer_id=c.transfer_id,
                prefill_engine_id=c.engine_id,
                block_ids=_groups(c),
                num_tokens=c.num_tokens,
                finished_unix_us=int(c.finished_unix * 1e6),
            )
        )
    return pb.TransferCall(
        cancel=pb.CancelRequest(transfer_id=c.transfer_id, reason=c.reason[:1000])
    )


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 5.0,
        attempts: int = 3,
        tls: TLSFiles | None = None,
        keep: Callable[[Result], bool] | None = None,
        failover_s: float = FAILOVER_S,
    ) -> None:
        # One address, or several coordinator replicas (comma-separated).
        self._follower = LeaderFollower(address)
        self._failover_s = failover_s
        self._channels: dict[str, grpc.Channel] = {}
        # Results for which this is false are dropped on the client thread
        # (None: every result is queued). Read per batch, so a test may change it.
        self.keep = keep
        self.answered = 0  # results received, queued or dropped
        self._tls = tls
        self._timeout = timeout_s
        self._attempts = attempts
        self._calls: collections.deque[Call] = collections.deque()
        self._results: collections.deque[Result] = collections.deque()
        # Wake-ups for the client thread while it sleeps. A SimpleQueue, not an
        # Event: putting takes no lock the client thread may hold (an Event's
        # Condition), so the engine thread never waits for the client thread.
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._sleeping = False
        self._done = threading.Condition()  # only for the waits below (tests, tools)
        self._closed = False
        self.batches_sent = 0
        self._thread = threading.Thread(target=self._run, name="pushkv-coord-client", daemon=True)
        self._thread.start()

    def submit(self, call: Call) -> None:
        self._calls.append(call)
        # Checked after the append; the thread sets _sleeping before it looks
        # at _calls, so one of the two sees the other.
        if self._sleeping:
            self._wakeups.put(None)

    def has_results(self) -> bool:
        return bool(self._results)

    def drain(self) -> list[Result]:
        out: list[Result] = []
        results = self._results
        while results:
            out.append(results.popleft())
        return out

    def wait_result(self, match: Callable[[Result], bool], timeout: float) -> Result | None:
        """Wait until a queued result matches; leave it queued. For tests and tools."""
        with self._done:
            found: Result | None = self._done.wait_for(
                lambda: next((r for r in self._results if match(r)), None), timeout
            )
            return found

    def wait_answered(self, n: int, timeout: float) -> bool:
        """Wait until `n` results in all were received, queued or dropped. For tests."""
        with self._done:
            return self._done.wait_for(lambda: self.answered >= n, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        self._wakeups.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------ client thread
    def _stub(self) -> pbg.TransferServiceStub:
        """A stub on the channel to the address the client dials now."""
        address = self._follower.current
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tls_channel(address, self._tls)
        return pbg.TransferServiceStub(channel)

    def _retry(self, attempt: int, started: float, exc: BaseException) -> bool:
        """After a retryable failure: whether to try again (on which replica)."""
        if not self._follower.several:
            return attempt + 1 < self._attempts
        if time.monotonic() - started > self._failover_s:
            return False
        named = self._follower.follow(exc)
        time.sleep(self._follower.delay(0 if named else attempt))  # jittered: no herd
        return True

    def _run(self) -> None:
        batched = True  # until the coordinator says it has no Submit
        try:
            while True:
                if not self._calls:
                    if self._closed:
                        return
                    self._sleep(IDLE_WAKE_S)
                    continue
                batch: list[Call] = []
                while self._calls and len(batch) < MAX_BATCH:
                    batch.append(self._calls.popleft())
                stub = self._stub()
                if batched:
                    results = self._submit(stub, batch)
                    if results is None:
                        batched = False
                        log.warning("coordinator has no Submit RPC; sending calls one by one")
                if not batched:
                    results = [self._unary(stub, c) for c in batch]
                assert results is not None
                keep = self.keep
                with self._done:
                    self.answered += len(results)
                    self._results.extend(results if keep is None else filter(keep, results))
                    self._done.notify_all()
        finally:
            for channel in self._channels.values():
                channel.close()

    def _sleep(self, timeout: float) -> None:
        """Until submit() or close() wakes this thread, or `timeout` passes."""
        self._sleeping = True
        try:
            if self._calls or self._closed:
                return
            try:
                self._wakeups.get(timeout=timeout)
            except queue.Empty:
                return
        finally:
            self._sleeping = False
        while True:  # drop wake-ups of calls this thread takes anyway
            try:
                self._wakeups.get_nowait()
            except queue.Empty:
                return

    def _submit(self, stub: pbg.TransferServiceStub, batch: list[Call]) -> list[Result] | None:
        """One Submit RPC for the batch; None if the coordinator predates Submit."""
        request = pb.SubmitRequest(calls=[_to_proto(c) for c in batch])
        code: grpc.StatusCode | None = None
        details = ""
        started = time.monotonic()
        for attempt in itertools.count():
            try:
                reply = stub.Submit(request, timeout=self._timeout)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    return None
                # Only transport trouble is retried; the calls are idempotent.
                if code not in RETRYABLE:
                    break
                log.warning(
                    "coordinator Submit of %d calls failed (attempt %d): %s: %s",
                    len(batch),
                    attempt + 1,
                    getattr(code, "name", code),
                    details,
                )
                if not self._retry(attempt, started, exc):
                    break
                stub = self._stub()
                continue
            if len(reply.results) != len(batch):
                code, details = (
                    grpc.StatusCode.INTERNAL,
                    "Submit answered the wrong number of results",
                )
                break
            self.batches_sent += 1
            return [
                Result(c, r.state, write_may_land=r.write_may_land)
                if r.code == 0
                else _error_result(c, code_of(r.code), r.message)
                for c, r in zip(batch, reply.results, strict=True)
            ]
        return [_error_result(c, code, details) for c in batch]

    def _unary(self, stub: pbg.TransferServiceStub, c: Call) -> Result:
        call = _to_proto(c)
        code: grpc.StatusCode | None = None
        details = ""
        started = time.monotonic()
        for attempt in itertools.count():
            try:
                if c.kind == "register":
                    st = stub.RegisterDecodeBlocks(call.register, timeout=self._timeout)
                elif c.kind == "prefill_done":
                    st = stub.ReportPrefillDone(call.prefill_done, timeout=self._timeout)
                else:
                    st = stub.Cancel(call.cancel, timeout=self._timeout)
                return Result(c, st.state, write_may_land=st.write_may_land)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
                if code not in RETRYABLE:
                    break
                log.warning(
                    "coordinator %s for %s failed (attempt %d): %s",
                    c.kind,
                    c.transfer_id,
                    attempt + 1,
                    details,
                )
                if not self._retry(attempt, started, exc):
                    break
                stub = self._stub()
        return _error_result(c, code, details)
