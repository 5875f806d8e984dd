"""The replica's side of its front processes (controlplane/front_host.py):
start each with the replica's view of the election, tell it every change
and every renewal, and stop it.

Ownership: `FrontProcesses` owns the children and their stdin pipes, all on
the replica's event loop (a renewal from the lease keeper's thread comes in
through `call_soon_threadsafe`). `close()` ends each stdin (the child then
ends on its own), waits within a deadline and kills past it; a child also
dies with the replica (PR_SET_PDEATHSIG). `dead` is set when a child ends
while the replica still serves (the replica then resigns, as for a
partition). `loop_lag` asks each front for its event loop's lag at a
/metrics scrape; `_reports` reads the answers from the front's stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence

import structlog
from google.protobuf.message import DecodeError

from pushkv.controlplane.front_host import READY, control
from pushkv.controlplane.leadership import Leadership, View
from pushkv.controlplane.metric_families import FamilyCopy
from pushkv.net.child import Child
from pushkv.net.frames import FrameError, read_frames
from pushkv.net.tls import TLSFiles
from pushkv.v1 import partition_pb2 as ppb

log = structlog.get_logger("pushkv.coordinator")

START_S = 30.0  # a child imports the coordinator's modules first
STOP_S = 10.0
REPORT_S = 0.5  # a front's FrontReport, at a scrape (within the scrape's 2 s)


class FrontProcesses:
    def __init__(self, procs: Sequence[Child], gate: Leadership) -> None:
        self._procs = list(procs)
        self._gate = gate
        self._closing = False
        self.dead = asyncio.Event()
        self.broken: list[str] = []
        loop = asyncio.get_running_loop()
        # FrontReports: the number last asked, and each front's answer to it.
        self._asked = 0
        self._answers: dict[int, asyncio.Future[ppb.FrontReport]] = {}
        self._asking = asyncio.Lock()
        self._watchers = [
            *(loop.create_task(self._watch(i + 1, p)) for i, p in enumerate(self._procs)),
            *(loop.create_task(self._reports(i + 1, p)) for i, p in enumerate(self._procs)),
        ]

    @classmethod
    async def start(
        cls,
        count: int,
        *,
        socket_dir: str,
        k: int,
        address: str,
        gate: Leadership,
        tls: TLSFiles,
        max_message_bytes: int,
        log_level: str = "WARNING",
        hang_dump_s: float = 0.0,
        start_s: float = START_S,
    ) -> FrontProcesses:
        """Start fronts 1..count on `address` (the replica's bound port),
        each told `gate`'s view first; return once all listen."""
        procs: list[Child] = []
        try:
            for index in range(1, count + 1):
                proc = await Child.start(
                    [
                        sys.executable,
                        *(("-P",) if sys.flags.safe_path else ()),  # as partition_link's
                        "-m",
                        "pushkv.controlplane.front_host",
                        *("--socket-dir", socket_dir, "--partitions", str(k)),
                        *("--index", str(index), "--address", address),
                        *("--parent", str(os.getpid()), "--log-level", log_level),
                        *("--max-message-bytes", str(max_message_bytes)),
                        *("--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key),
                        *("--hang-dump-s", str(hang_dump_s)),
                    ],
                    stdin=True,
                )
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(control(gate.view, gate.order_deadline))
            for index, proc in enumerate(procs, 1):
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), start_s)
                if line.decode() != READY:
                    code = await asyncio.wait_for(proc.wait(), STOP_S)
                    raise RuntimeError(f"front {index} did not start (exit code {code})")
        except BaseException:
            for proc in procs:
                proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), STOP_S)
            raise
        fronts = cls(procs, gate)
        loop = asyncio.get_running_loop()
        gate.on_change.append(fronts.tell)

        def renewed(deadline: float) -> None:  # on the lease keeper's thread, or the loop's
            with contextlib.suppress(RuntimeError):  # the loop closed: the replica is ending
                loop.call_soon_threadsafe(fronts.extend, deadline)

        gate.on_extend.append(renewed)
        return fronts

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _send(self, data: bytes) -> None:
        for proc in self._procs:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.write(data)

    def tell(self, view: View) -> None:
        """The replica's view changed (on_change: the gate holds its deadline)."""
        self._send(control(view, self._gate.order_deadline))

    def extend(self, order_deadline: float) -> None:
        """A renewal of the leader's lease: orders may go out until then."""
        self._send(control(None, order_deadline))

    def silence(self) -> None:
        """The replica lost the leadership: every front ends its agents' streams."""
        self._send(control(None, 0.0, silence=True))

    async def loop_lag(self, within_s: float = REPORT_S) -> FamilyCopy:
        """Each front's pushkv_event_loop_lag_seconds series, for a scrape
        (a front that does not answer within `within_s` is left out)."""
        if not self._procs:
            return []
        async with self._asking:
            self._asked += 1
            loop = asyncio.get_running_loop()
            self._answers = {i: loop.create_future() for i in range(1, len(self._procs) + 1)}
            self._send(control(None, 0.0, report=self._asked))
            await asyncio.wait(self._answers.values(), timeout=within_s)
            answers, self._answers = self._answers, {}
        out: FamilyCopy = []
        for i, fut in answers.items():
            if fut.done() and not fut.cancelled():
                r = fut.result()
                series = (list(r.loop_lag_counts), r.loop_lag_sum, r.loop_lag_created)
                out.append(((f"front-{i}",), series))
            else:
                fut.cancel()
        return out

    async def _reports(self, index: int, proc: Child) -> None:
        """Front `index`'s FrontReports (its stdout after READY), until it ends."""
        if proc.stdout is None:
            return
        try:
            async for got in read_frames(proc.stdout):
                for data in got:
                    r = ppb.FrontReport.FromString(data)
                    fut = self._answers.get(index)
                    if r.report == self._asked and fut is not None and not fut.done():
                        fut.set_result(r)  # an answer to an older ask is dropped
        except (FrameError, DecodeError) as exc:  # the same build: never expected
            log.error("front_report_unreadable", index=index, error=str(exc))

    async def _watch(self, index: int, proc: Child) -> None:
        code = await proc.wait()
        if not self._closing:
            reason = f"front process {index} ended (exit code {code})"
            log.error("front_lost", index=index, exit=code)
            self.broken.append(reason)
            self.dead.set()

    async def close(self, grace: float | None = None, stop_s: float = STOP_S) -> None:
        """Stop every front, each letting its calls in flight finish within
        `grace` (None: at once), and wait for them (killed past the grace
        and `stop_s`)."""
        self._closing = True
        if grace:
            self._send(control(None, 0.0, stop_grace_s=grace))
        for proc in self._procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self._procs:
            try:
                await asyncio.wait_for(proc.wait(), (grace or 0.0) + stop_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for w in self._watchers:
            w.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w
