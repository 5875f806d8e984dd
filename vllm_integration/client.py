"""The scheduler half's coordinator client: RPCs run on one background thread.

The engine thread only appends calls and drains results; it never waits on
the network and takes no lock on the common path (deque appends and pops are
atomic). The client thread sends everything queued since its last RPC as one
`Submit` batch, so a busy engine costs one RPC per round trip, not per call.

After a failover the client resubmits its open calls to the new leader
(open_calls.py): every Submit answer carries the leader's term, and when it
grows, the registrations and prefill reports an older leader accepted whose
transfers the engine still holds are sent again, flagged `resubmitted`. With
several replicas and open calls, an idle client asks for the term (an empty
Submit) every PROBE_S, so a failover is noticed without new requests.
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

from pushkv.net.codes import REFUSALS, RETRYABLE, code_of
from pushkv.net.leader import LeaderFollower
from pushkv.net.tls import ChannelCache, TLSFiles
from pushkv.net.tls import channel as tls_channel
from pushkv.rules import block_groups
from pushkv.rules.block_groups import BlockGroups
from pushkv.rules.states import TERMINAL
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.open_calls import OpenCalls

log = logging.getLogger("pushkv.connector")

MAX_BATCH = 256  # calls per Submit RPC (the coordinator accepts more)
IDLE_WAKE_S = 1.0  # an idle client thread checks for close() at least this often
# With several coordinator replicas, a call is retried (on the leader a standby
# names, or the next address) for this long: a failover takes about one etcd TTL.
FAILOVER_S = 5.0
# With several replicas, one attempt waits this long at most (within
# FAILOVER_S): a leader answers in milliseconds, and one that went silent
# (frozen, cut off: its connection open, nothing refused) is left for the next.
ATTEMPT_S = 2.0
# Resubmissions answered UNAVAILABLE (the new leader waiting for the agents:
# at most its --rebuild-window-s, 10 s by default) are retried every
# RESUBMIT_RETRY_S for this long after the new term was seen; then they fail
# like an unreachable call.
RESUBMIT_S = 15.0
RESUBMIT_RETRY_S = 0.2
# With several replicas and open calls: ask for the leader's term when no RPC
# was sent for this long.
PROBE_S = 1.0
NO_BLOCKS = BlockGroups(())  # a call that names no blocks (cancel, settled)


class Call(NamedTuple):  # a tuple: built on the engine thread, so cheap
    kind: str  # "register" | "prefill_done" | "cancel" | "settled" (never sent)
    request_id: str
    transfer_id: str
    engine_id: str = ""
    # Per KV cache group (several with vLLM's hybrid KV cache manager).
    blocks: BlockGroups = NO_BLOCKS
    num_tokens: int = 0
    reason: str = ""
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
    code: grpc.StatusCode | None = None  # the error's status code, if known

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
    return Result(c, 0, text, refused=code in REFUSALS, code=code)


def _to_proto(c: Call, resubmitted: bool = False) -> pb.TransferCall:
    if c.kind == "register":
        return pb.TransferCall(
            register=pb.RegisterDecodeBlocksRequest(
                transfer_id=c.transfer_id,
                decode_engine_id=c.engine_id,
                block_ids=block_groups.to_pb(c.blocks),
                num_tokens=c.num_tokens,
            ),
            resubmitted=resubmitted,
        )
    if c.kind == "prefill_done":
        return pb.TransferCall(
            prefill_done=pb.ReportPrefillDoneRequest(
                transfer_id=c.transfer_id,
                prefill_engine_id=c.engine_id,
                block_ids=block_groups.to_pb(c.blocks),
                num_tokens=c.num_tokens,
                finished_unix_us=int(c.finished_unix * 1e6),
            ),
            resubmitted=resubmitted,
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
        resubmit_s: float = RESUBMIT_S,
        resubmit: bool = True,
    ) -> None:
        """`resubmit`: after a failover, resubmit the open calls (off: the
        engine's agents do not rebuild, so the new leader would fail them)."""
        # One address, or several coordinator replicas (comma-separated).
        self._follower = LeaderFollower(address)
        self._failover_s = failover_s
        # A channel per replica, replaced when the TLS files change (renewed
        # certificates). Only the client thread calls, one RPC at a time, so
        # a replaced channel has no call in flight: closed at once.
        self._channels: ChannelCache[grpc.Channel] = ChannelCache(
            lambda a: tls_channel(a, tls), tls, lambda c: c.close()
        )
        # Results for which this is false are dropped on the client thread
        # (None: every result is queued). Read per batch, so a test may change it.
        self.keep = keep
        self.answered = 0  # results received, queued or dropped
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
        # Failover resubmission (client thread; _open read by others under _done).
        self._open = OpenCalls()
        self._term = 0  # the newest leader term an answer carried
        self._reply_term = 0  # the last Submit answer's
        self._resubmit_at: float | None = None  # monotonic: next resubmission
        self._resubmit_until = 0.0
        self._resubmit_s = resubmit_s
        self._resubmits = resubmit
        self._last_rpc = 0.0
        self.resubmitted = 0  # calls sent again to a new leader (counting retries)
        self.resubmit_accepted = 0
        self.resubmit_ended = 0  # answered with the transfer's end (COMPLETE if written before)
        self.resubmit_failed = 0  # ended there other than COMPLETE, refused, or given up on
        self._thread = threading.Thread(target=self._run, name="pushkv-coord-client", daemon=True)
        self._thread.start()

    def submit(self, call: Call) -> None:
        self._enqueue(call)

    def _enqueue(self, call: Call) -> None:
        self._calls.append(call)
        # Checked after the append; the thread sets _sleeping before it looks
        # at _calls, so one of the two sees the other.
        if self._sleeping:
            self._wakeups.put(None)

    def settle(self, request_id: str, transfer_id: str) -> None:
        """The engine is done with this transfer (decode: loaded or given up;
        prefill: blocks freed): nothing of it is resubmitted after a failover."""
        self._enqueue(Call("settled", request_id, transfer_id))

    def open_transfers(self) -> set[str]:
        """Transfers with a call open (resubmitted on a failover). For tests."""
        with self._done:
            return self._open.transfer_ids()

    def wait_open(self, match: Callable[[set[str]], bool], timeout: float) -> bool:
        """Wait until the open transfers match. For tests."""
        with self._done:
            return self._done.wait_for(lambda: match(self._open.transfer_ids()), timeout)

    @property
    def channels_replaced(self) -> int:
        """Channels replaced because the TLS files changed (renewed certificates)."""
        return self._channels.replaced

    @property
    def term(self) -> int:
        """The newest leader term an answer carried (0: none, or no --etcd)."""
        return self._term

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
        return pbg.TransferServiceStub(self._channels.get(self._follower.current))

    def _attempt_s(self) -> float:
        """One RPC's deadline: capped with several replicas (ATTEMPT_S)."""
        return min(self._timeout, ATTEMPT_S) if self._follower.several else self._timeout

    def _retry(self, attempt: int, started: float, exc: BaseException) -> bool:
        """After a retryable failure: whether to try again (on which replica)."""
        if not self._follower.several:
            return attempt + 1 < self._attempts
        # Move first, retried or not: the next call must not go back to a
        # replica that timed out (a frozen leader answers nothing, ever).
        named = self._follower.follow(exc)
        if time.monotonic() - started > self._failover_s:
            return False
        time.sleep(self._follower.delay(0 if named else attempt))  # jittered: no herd
        return True

    def _run(self) -> None:
        batched = True  # until the coordinator says it has no Submit
        try:
            while True:
                due = self._resubmit_at
                if due is not None and due <= time.monotonic():
                    self._maintain()  # before new calls: a busy engine must not starve it
                    continue
                if not self._calls:
                    if self._closed:
                        return
                    wait = self._due() if batched else IDLE_WAKE_S
                    if wait <= 0:
                        self._maintain()
                    else:
                        self._sleep(min(wait, IDLE_WAKE_S))
                    continue
                batch: list[Call] = []
                settled: list[Call] = []
                while self._calls and len(batch) < MAX_BATCH:
                    c = self._calls.popleft()
                    (settled if c.kind == "settled" else batch).append(c)
                results: list[Result] | None = []
                if batch:
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
                    if batched:
                        self._track(results, settled)
                    self.answered += len(results)
                    self._results.extend(results if keep is None else filter(keep, results))
                    self._done.notify_all()
                if batched and batch:
                    self._check_term()
        finally:
            for channel in self._channels.take_all():
                channel.close()

    # ------------------------------------------------------------ failover
    def _track(self, results: list[Result], settled: list[Call]) -> None:
        """Open calls after a batch's answers (under _done), then its settles."""
        for r in results:
            c = r.call
            if c.kind == "cancel":
                self._open.close(c.transfer_id)
            elif r.ok:
                self._open.accepted(c, self._reply_term, r.terminal)
        for c in settled:
            self._open.close(c.transfer_id)

    def _check_term(self) -> None:
        """After an answer: a newer leader term schedules the resubmission of
        the calls older leaders accepted."""
        term = self._reply_term
        if term == self._term:
            return
        if term > self._term:
            log.info("coordinator leader term %d (was %d)", term, self._term)
            self._term = term
        if self._resubmits and self._resubmit_at is None and self._open.older_than(self._term):
            now = time.monotonic()
            self._resubmit_at, self._resubmit_until = now, now + self._resubmit_s

    def _due(self) -> float:
        """Seconds until the idle client thread has failover work to do."""
        now = time.monotonic()
        if self._resubmit_at is not None:
            return self._resubmit_at - now
        if self._resubmits and self._follower.several and len(self._open):
            return self._last_rpc + PROBE_S - now
        return IDLE_WAKE_S

    def _maintain(self) -> None:
        """Resubmit what is due, or probe the leader's term (an empty Submit)."""
        if self._resubmit_at is None:
            self._submit(self._stub(), [])
            self._check_term()
            return
        with self._done:
            calls = self._open.older_than(self._term)[:MAX_BATCH]
        if not calls:
            self._resubmit_at = None
            return
        log.warning(
            "resubmitting %d open calls to the coordinator leader of term %d",
            len(calls),
            self._term,
        )
        self.resubmitted += len(calls)
        results = self._submit(self._stub(), calls, resubmitted=True) or []
        now = time.monotonic()
        give_up = now >= self._resubmit_until
        out: list[Result] = []
        with self._done:
            for r in results:
                c = r.call
                if r.ok:
                    self.resubmit_accepted += 1
                    self._open.accepted(c, self._reply_term, r.terminal)
                    if r.terminal:  # ended: COMPLETE if written before the failover
                        self.resubmit_ended += 1
                        if r.state != pb.TRANSFER_STATE_COMPLETE:
                            self.resubmit_failed += 1
                        out.append(r)
                elif r.code in RETRYABLE and not give_up:
                    continue  # the new leader is rebuilding: again shortly
                else:
                    # Never "refused": the engine must not reuse or free the
                    # blocks on this answer alone (an older order may exist).
                    self.resubmit_failed += 1
                    self._open.drop([c])
                    out.append(Result(c, 0, f"resubmission after a failover: {r.error}"))
            keep = self.keep
            self._results.extend(out if keep is None else filter(keep, out))
            self._done.notify_all()
            left = bool(self._open.older_than(self._term))
        self._resubmit_at = None
        self._check_term()  # the answer may come from a newer leader still
        if left and self._resubmit_at is None:
            self._resubmit_at = now + self._follower.delay(0, base_s=RESUBMIT_RETRY_S)

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

    def _submit(
        self, stub: pbg.TransferServiceStub, batch: list[Call], resubmitted: bool = False
    ) -> list[Result] | None:
        """One Submit RPC for the batch; None if the coordinator predates Submit.

        Calls answered UNAVAILABLE one by one (a leader just elected, whose
        agents are still reconnecting) are sent again for up to the failover
        time after that answer (the time spent finding the leader not
        counted); a resubmission batch retries on its own schedule (_maintain)."""
        results = self._submit_rpc(stub, batch, resubmitted, time.monotonic())
        if results is None or resubmitted:
            return results
        answered = time.monotonic()
        for attempt in itertools.count():
            again = [i for i, r in enumerate(results) if r.code is grpc.StatusCode.UNAVAILABLE]
            if not again or time.monotonic() - answered > self._failover_s:
                return results
            time.sleep(self._follower.delay(attempt, base_s=0.1))  # jittered: no herd
            retry = [batch[i] for i in again]
            retried = self._submit_rpc(self._stub(), retry, False, time.monotonic())
            if retried is None:
                return results
            for i, r in zip(again, retried, strict=True):
                results[i] = r
        return results  # not reached

    def _submit_rpc(
        self,
        stub: pbg.TransferServiceStub,
        batch: list[Call],
        resubmitted: bool,
        started: float,
    ) -> list[Result] | None:
        """One Submit RPC, retried on transport trouble (the failover time
        counted from `started`); None if the coordinator predates Submit."""
        request = pb.SubmitRequest(calls=[_to_proto(c, resubmitted) for c in batch])
        self._last_rpc = time.monotonic()
        code: grpc.StatusCode | None = None
        details = ""
        for attempt in itertools.count():
            try:
                reply = stub.Submit(request, timeout=self._attempt_s())
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
            self._reply_term = reply.term
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
                    st = stub.RegisterDecodeBlocks(call.register, timeout=self._attempt_s())
                elif c.kind == "prefill_done":
                    st = stub.ReportPrefillDone(call.prefill_done, timeout=self._attempt_s())
                else:
                    st = stub.Cancel(call.cancel, timeout=self._attempt_s())
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
