"""A front process of a partitioned leader (`pushkv coordinator
--partition-procs K --fronts F`, experimental; step 3 of the build order in
docs/reliability.md, "Past one leader core").

The replica (controlplane/server.py) serves its port through its own front
(controlplane/front.py); each of its F-1 front processes is one more. It
binds the same port (SO_REUSEPORT: the kernel spreads new connections over
every socket listening on it), holds a connection of its own to each of the
K partition processes (controlplane/partition_host.py), and serves every
RPC and stream it is handed as the replica's front does
(controlplane/front_servicers.py). A partition holds each front's
connection as a carrier of its own, so an agent's orders come back to the
front that holds the agent's stream.

It serves under the replica's election: the replica writes its view on the
front's stdin (`FrontControl`, length-prefixed frames) before the front
listens and on every change, and its order deadline on every renewal of
its etcd lease. The front's gate, its health and GetLeadership follow it, so
a standby's fronts refuse writes naming the leader, and nothing goes to an
agent past the deadline (servicers.fence), as at the replica.

Invariants:
- It dies with the replica: PR_SET_PDEATHSIG, and the end of its stdin.
  When it dies, every partition ends (each ends with any of its fronts'
  connections), and so the replica resigns (exit 5), as for a partition.
- It listens only once it holds every partition's connection and the
  replica's first view; READY on stdout says it does.
- Its /metrics are the replica's: the partitions hold the state, and the
  replica's scrape gathers them; of its own, the replica asks its event
  loop's lag (FrontControl.report, answered by a FrontReport on stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence

import structlog
import uvloop

from pushkv.controlplane import gcpolicy, logs
from pushkv.controlplane.auth import Authorizer
from pushkv.controlplane.front import PartitionFront
from pushkv.controlplane.grpc_edge import (
    add_front_services,
    add_health_and_reflection,
    bind,
    new_server,
    set_health,
)
from pushkv.controlplane.leadership import Leadership, Role, View
from pushkv.controlplane.metric_families import HistogramSeries
from pushkv.controlplane.partition_host import die_with_parent
from pushkv.controlplane.partition_link import PartitionConnection
from pushkv.controlplane.servicers import leadership_reply, leadership_view
from pushkv.controlplane.settings import MAX_FRONTS, MAX_PARTITIONS
from pushkv.controlplane.transfer_metrics import loop_lag_family
from pushkv.net.event_loop import check_dump_after, report_stalls, sample_loop_lag
from pushkv.net.frames import frame, read_frames
from pushkv.net.tls import TLSFiles
from pushkv.v1 import partition_pb2 as ppb

log = structlog.get_logger("pushkv.coordinator")

READY = "pushkv-front-ready\n"
EXIT_PARTITION_LOST = 5  # as the replica's (server.py): a partition's connection ended
FIRST_VIEW_S = 30.0  # the replica's first FrontControl, written at the front's start
MAX_GRACE_S = 60.0  # a stop's grace, at most


def control(
    view: View | None = None,
    order_deadline: float = 0.0,
    *,
    silence: bool = False,
    stop_grace_s: float | None = None,
    report: int = 0,
) -> bytes:
    """One FrontControl frame, as the replica writes it (`stop_grace_s`:
    stop; `report`: a FrontReport asked, with this number)."""
    msg = ppb.FrontControl(order_deadline=order_deadline, silence=silence, report=report)
    if stop_grace_s is not None:
        msg.stop, msg.grace_s = True, stop_grace_s
    if view is not None:
        msg.view.CopyFrom(leadership_reply(view))
    return frame(msg.SerializeToString())


def apply(msg: ppb.FrontControl, gate: Leadership, front: PartitionFront | None) -> None:
    """One FrontControl, applied to this front's gate (and its streams)."""
    if msg.HasField("view"):
        view = leadership_view(msg.view)
        if front is not None:
            lead(front, view)
        gate.update(view, order_deadline=msg.order_deadline)
    elif msg.order_deadline:
        gate.extend(msg.order_deadline)
    if msg.silence and front is not None:
        front.silence()  # the replica lost the leadership: nothing more to any agent


def report(number: int, lag: HistogramSeries) -> bytes:
    """The FrontReport frame that answers FrontControl.report `number`."""
    counts, total, created = lag.copy()
    msg = ppb.FrontReport(
        report=number, loop_lag_counts=counts, loop_lag_sum=total, loop_lag_created=created
    )
    return frame(msg.SerializeToString())


def lead(front: PartitionFront, view: View) -> None:
    """A leader's term, to every partition down this front's own connections
    before the gate opens: an agent's hello through this front then reaches
    a partition after the term (each connection is in order; the replica's
    own `lead` travels on another). The same term again changes nothing."""
    if view.role is Role.LEADER:
        front.lead(view.term)


async def _stdin_controls() -> AsyncIterator[ppb.FrontControl]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async for got in read_frames(reader):
        for data in got:
            yield ppb.FrontControl.FromString(data)


def _log_stall(seconds: float) -> None:
    log.warning(
        "front_stalled",
        seconds=round(seconds, 1),
        detail="this front process did not run its event loop for that long: "
        "the agents and clients on its connections heard nothing meanwhile",
    )


async def serve(args: argparse.Namespace) -> int:
    """Serve until the replica goes (0) or a partition's connection ends (5)."""
    controls = _stdin_controls()
    gate = Leadership()
    try:  # the replica writes it before it waits for READY
        first = await asyncio.wait_for(anext(controls, None), FIRST_VIEW_S)
    except TimeoutError:
        first = None
    if first is None or not first.HasField("view"):
        log.error("front_not_started", detail="the replica sent no view")
        return 2
    apply(first, gate, None)
    links = [await PartitionConnection.open(args.socket_dir, i) for i in range(args.k)]
    front = PartitionFront(links)
    front.start()
    lead(front, gate.view)
    tls = TLSFiles(args.tls_ca, args.tls_cert, args.tls_key)
    authz = Authorizer(tls_enabled=tls.enabled)
    server = new_server(args.max_message_bytes, authz, gate)
    add_front_services(server, front, authz, gate, args.index)
    health = add_health_and_reflection(server)
    host, _, port = args.address.rpartition(":")
    bind(server, host, int(port), tls)
    await server.start()
    await set_health(health, gate)
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()

    def on_change(_: View) -> None:
        task = loop.create_task(set_health(health, gate))
        pending.add(task)
        task.add_done_callback(pending.discard)

    gate.on_change.append(on_change)
    stalls = loop.create_task(report_stalls(_log_stall, dump_after_s=args.hang_dump_s))
    lag = loop_lag_family().child(f"front-{args.index}")  # for the replica's /metrics
    sampler = loop.create_task(sample_loop_lag(lag.observe))
    full_gc = loop.create_task(gcpolicy.full_collections())  # gcpolicy.py, as the replica's

    grace = 0.0  # the replica gone without a word: stop at once

    async def follow() -> None:
        nonlocal grace
        async for msg in controls:
            if msg.stop:
                grace = max(0.0, min(msg.grace_s, MAX_GRACE_S))
                await health.enter_graceful_shutdown()
                return
            apply(msg, gate, front)
            if msg.report:  # stdout: READY, then FrontReport frames only
                sys.stdout.buffer.write(report(msg.report, lag))
                sys.stdout.buffer.flush()

    followed = loop.create_task(follow(), name="replica-control")
    dead = loop.create_task(front.dead.wait())
    log.info("front_started", index=args.index, address=args.address, partitions=args.k)
    sys.stdout.write(READY)  # the replica waits for this line
    sys.stdout.flush()
    try:
        await asyncio.wait({followed, dead}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (followed, dead, stalls, sampler, full_gc):
            task.cancel()
        await server.stop(0 if front.dead.is_set() else grace)
        front.silence()
        await front.stop()
        for link in links:
            await link.end()
    if front.dead.is_set():
        log.error("front_stopping", index=args.index, reason=front.broken[0])
        return EXIT_PARTITION_LOST
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pushkv.controlplane.front_host")
    p.add_argument("--socket-dir", required=True, help="the partitions' sockets")
    p.add_argument("--partitions", dest="k", type=int, required=True)
    p.add_argument("--index", type=int, required=True, help="this front (1 and up)")
    p.add_argument("--address", required=True, help="HOST:PORT, the replica's")
    p.add_argument("--parent", type=int, default=0, help="die with this process (pid)")
    p.add_argument("--log-level", default="WARNING", help="its log, on stderr")
    p.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--tls-ca", default="")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--hang-dump-s", type=float, default=0.0)
    args = p.parse_args(argv)
    if not 1 <= args.k <= MAX_PARTITIONS:
        p.error(f"--partitions must be 1 to {MAX_PARTITIONS}, got {args.k}")
    if not 1 <= args.index < MAX_FRONTS:
        p.error(f"--index must be 1 to {MAX_FRONTS - 1}, got {args.index}")
    check_dump_after(args.hang_dump_s)  # refuses a negative, nan or too long a wait
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.parent:
        die_with_parent(args.parent)
    # stderr: stdout carries READY and FrontReport frames only
    logs.configure(args.log_level, process=f"front-{args.index}")
    gcpolicy.install()
    with contextlib.suppress(KeyboardInterrupt):
        return uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
