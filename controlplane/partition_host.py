"""One partition of the partitioned leader in a process of its own (step 2 of
the build order in docs/reliability.md, "Past one leader core").

A partition process holds the transfers whose id hashes to partition `index`
of `k` (`partitions.partition_of`). It is a whole `Runtime` (the state
machine with its share of the limits, the agents' sessions, the effects
turned into the messages each agent gets), fed by the leading replica's
front over a Unix socket. What crosses the socket is what a node relay's
NodeStream carries (`node_stream.NodeChannels`), as length-prefixed frames
(`pushkv.net.frames`), never pickle:

- up, `PartitionUp` (a `NodeUp`): each agent's hello, heartbeats and
  disconnect on its channel (the front, controlplane/front.py, sends them to
  every partition: each keeps its own registry copy), the reports and
  arrivals of this partition's transfers, and the `Submit` calls of its
  transfers (`RelayedSubmit`); and the channels whose carrier was lost (a
  relay's stream ended: their transfers wait for the agents' lease);
- down, `PartitionDown` (a `NodeDown`): each agent's welcome, acks, orders,
  cancels, notices and peer messages on its channel, and the answers to the
  `Submit`s.

Invariants:
- One term. The process stamps the replica's term (given at start, or
  once by `lead` when the replica is elected) on every welcome and order,
  and never changes it after. It asks the kernel to kill it when its
  parent dies (PR_SET_PDEATHSIG), so no partition outlives the replica
  whose lease fences its orders; the replica resigns when a partition dies.
- Its fronts. The process serves `fronts` connections: the replica's own
  front first, then each of its front processes' (`--fronts F`,
  controlplane/front_host.py), on a socket in a directory only the
  replica's user can open; each front authenticates the callers before it
  forwards anything (here the caller is trusted). Each connection is a
  carrier of its own (`NodeChannels`, as each node relay's stream is to the
  single coordinator), so an agent's orders go back down the connection of
  the front that holds its stream. When any connection ends, the process
  ends: a front's streams are gone, and the replica resigns.
- Its order ids carry its index (`<coordinator>.<index>-<n>`), and every
  partition of one replica shares the coordinator id, so the agents see one
  coordinator.

A coordinator starts K of these with `--partition-procs K` (experimental;
controlplane/server.py) and serves through their front
(controlplane/front.py); a replica on etcd starts them at once, with term 0,
and tells them its term when it is elected (`PartitionUp.lead`): they serve
no agent before that. `pushkv bench core --procs K` drives K of
these processes through the front; tests/test_partition_host.py checks them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence

import structlog
import uvloop

from pushkv.controlplane import gcpolicy, logs
from pushkv.controlplane.auth import TRUSTED, Authorizer, Principal, principal_from_wire
from pushkv.controlplane.clock import SystemClock
from pushkv.controlplane.errors import FailedPrecondition, InvalidArgument
from pushkv.controlplane.leadership import Leadership
from pushkv.controlplane.logs import TransferLog
from pushkv.controlplane.metrics import CoordinatorMetrics
from pushkv.controlplane.metrics_merge import snapshot_to_json
from pushkv.controlplane.node_stream import NodeChannels
from pushkv.controlplane.partition_watch import PartitionWatches
from pushkv.controlplane.partitions import partition_of, partition_settings
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.runtime import Runtime
from pushkv.controlplane.servicers import AgentServicer, TransferServicer, list_transfers
from pushkv.controlplane.settings import MAX_FRONTS, MAX_PARTITIONS, CoreSettings
from pushkv.controlplane.status_map import outcome
from pushkv.controlplane.tracing import tracer_from_env
from pushkv.net.frames import frame, read_frames
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb

log = structlog.get_logger("pushkv.coordinator")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
READY = "ready\n"  # on stdout, once the socket listens


def die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGKILL when the parent thread ends; exit now if
    the parent `parent` is already gone (it died before the request)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def partition_runtime(
    settings: CoreSettings, index: int, k: int, term: int, coordinator_id: str
) -> Runtime:
    """The Runtime of partition `index` of `k`: one state machine holding its
    share of the limits, its order ids marked with its index, under `term`."""
    if not 0 <= index < k <= MAX_PARTITIONS:
        raise ValueError(f"partition {index} of {k}: out of range (at most {MAX_PARTITIONS})")
    share = dataclasses.replace(partition_settings(settings, k), partitions=1)
    rt = Runtime(share, SystemClock())
    core = rt.core
    assert isinstance(core, Rendezvous)  # partitions=1: one state machine
    core.coordinator_id = coordinator_id
    core.order_prefix = f"{coordinator_id}.{index}"
    if term:
        rt.lead(term)
    return rt


# The RPC each PartitionCall stands for (for status_map.outcome's log).
RPCS = {
    "begin": "/pushkv.v1.TransferService/BeginTransfer",
    "register": "/pushkv.v1.TransferService/RegisterDecodeBlocks",
    "prefill_done": "/pushkv.v1.TransferService/ReportPrefillDone",
    "cancel": "/pushkv.v1.TransferService/Cancel",
    "get": "/pushkv.v1.StatusService/GetTransfer",
    "list": "/pushkv.v1.StatusService/ListTransfers",
    "engines": "/pushkv.v1.StatusService/ListEngines",
    "metrics": "partition metrics",
}


class Calls:
    """The answers to the front's PartitionCalls: the servicers' own code,
    each call authorized as the caller the front names (PartitionUp.principal;
    the method was checked at the front)."""

    def __init__(
        self, rt: Runtime, transfers: TransferServicer, metrics: CoordinatorMetrics | None = None
    ) -> None:
        self._rt = rt
        self._transfers = transfers
        self._metrics = metrics  # with --metrics: counts this partition's transfers

    def lead(self, term: int) -> None:
        """The replica leads for `term` from now on (Runtime.lead)."""
        self._rt.lead(term)

    def answer(self, call: ppb.PartitionCall, p: Principal = TRUSTED) -> ppb.PartitionReply:
        reply = ppb.PartitionReply(id=call.id)
        kind = call.WhichOneof("kind")
        rt, calls = self._rt, self._transfers.calls
        try:
            if kind == "begin":
                reply.transfer.CopyFrom(self._transfers.begin(call.begin))
            elif kind == "register":
                reply.transfer.CopyFrom(rt.status(calls.register(p, call.register)))
            elif kind == "prefill_done":
                reply.transfer.CopyFrom(rt.status(calls.prefill_done(p, call.prefill_done)))
            elif kind == "cancel":
                reply.transfer.CopyFrom(rt.status(calls.cancel(p, call.cancel)))
            elif kind == "get":
                reply.transfer.CopyFrom(rt.status(rt.core.get(call.get.transfer_id)))
            elif kind == "list":
                reply.list.CopyFrom(list_transfers(rt, call.list))
            elif kind == "engines":
                reply.engines.engines.extend(rt.engines(call.engines.role))
            elif kind == "metrics":
                if self._metrics is None:
                    raise FailedPrecondition("this partition was started without --metrics")
                reply.metrics = snapshot_to_json(self._metrics.snapshot_now())
            else:
                raise InvalidArgument("an empty partition call")
        except Exception as exc:  # the RPC's own failure, told to the front
            code, detail = outcome(exc, RPCS.get(str(kind), "partition call"))
            reply.code, reply.detail = code.value[0], detail
        return reply


def keep_own_held(up: pb.NodeUp, index: int, k: int) -> None:
    """Each hello's held transfers cut to this partition's (the front sends
    every partition the whole hello): a partition adopts, or tells again,
    only what hashes to it, as `partitions.Partitioned` splits them."""
    for item in up.items:
        if item.HasField("message") and item.message.WhichOneof("kind") == "hello":
            held = item.message.hello.held
            if held:
                mine = [h for h in held if partition_of(h.transfer_id, k) == index]
                if len(mine) != len(held):
                    del held[:]
                    held.extend(mine)


async def _ups(
    frames: AsyncIterator[list[bytes]],
    node: NodeChannels,
    calls: Calls,
    watches: PartitionWatches,
    writer: asyncio.StreamWriter,
    index: int,
    k: int,
) -> AsyncIterator[pb.NodeUp]:
    """The front's PartitionUps as the NodeUps `node` reads; each one's lost
    links and calls applied once its NodeUp was (the reader takes the next
    only then), the calls' replies written at once."""
    parse = ppb.PartitionUp.FromString
    async for got in frames:
        for data in got:
            up = parse(data)
            if up.lead:
                calls.lead(up.lead)
            # The front names only callers it authenticated: one it could not
            # have is a bug, which ends this connection (and the replica).
            caller = principal_from_wire(up.principal)
            if up.node.items:
                keep_own_held(up.node, index, k)
                node.act_as(caller)  # the reader applies this NodeUp before the next
                node.vias.update(up.via)
                yield up.node
            for channel in up.link_lost:
                node.lose_link(channel)
            if up.calls:
                down = ppb.PartitionDown(replies=[calls.answer(c, caller) for c in up.calls])
                watches.flush()  # the calls' changes reach the front's watches first
                writer.write(frame(down.SerializeToString()))
            for opened in up.watch_open:
                watches.open(opened)
            for wid in up.watch_close:
                watches.close(wid)


async def serve_front(
    rt: Runtime,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    index: int = 0,
    k: int = 1,
    metrics: CoordinatorMetrics | None = None,
) -> None:
    """The front's one connection, as a node relay's NodeStream is served:
    NodeUp frames in, NodeDown frames out, until either side ends."""
    authz = Authorizer(tls_enabled=False)
    transfers = TransferServicer(rt, authz)
    gate = Leadership()  # the replica fences; this process orders under its term
    agents = AgentServicer(rt, authz, gate, transfers.submit)
    node = NodeChannels(rt, agents.open_agent, TRUSTED, lambda: None, transfers.submit, "front")

    def send_watch(events: ppb.WatchEvents) -> None:
        if not writer.is_closing():
            writer.write(frame(ppb.PartitionDown(watch=[events]).SerializeToString()))

    watches = PartitionWatches(rt, send_watch)
    calls = Calls(rt, transfers, metrics)
    ups = _ups(read_frames(reader), node, calls, watches, writer, index, k)
    try:
        async for down in node.serve(ups):
            writer.write(frame(ppb.PartitionDown(node=down).SerializeToString()))
            await writer.drain()
    except ConnectionError:
        pass  # the front hung up: what it did not read goes nowhere
    finally:
        watches.close_all()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def serve(
    path: str,
    rt: Runtime,
    index: int = 0,
    k: int = 1,
    *,
    metrics: bool = False,
    rank: bool = True,
    fronts: int = 1,
) -> None:
    """Listen on `path`, serve the first `fronts` connections, and return
    when one of them ends."""
    done = asyncio.Event()
    taken = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal taken
        if taken >= fronts or done.is_set():  # its fronts only
            writer.close()
            return
        taken += 1
        try:
            await serve_front(rt, reader, writer, index, k, counted)
        except asyncio.CancelledError:
            pass  # another front's connection ended first: this process is ending
        finally:
            done.set()

    counted = (
        CoordinatorMetrics(rt, rank_series=rank, process=f"partition-{index}") if metrics else None
    )
    if counted is not None:
        rt.observers.append(counted.events)  # served by the front's /metrics
        counted.sample_lag()  # its own loop's, in its snapshot
    rt.observers.append(TransferLog(rt.core.has_transfer))  # its transfers' outcomes
    tracer = tracer_from_env(rt, partition=index)  # PUSHKV_OTEL: its own transfers' spans
    if tracer is not None:
        rt.observers.append(tracer)
    rt.start()
    # The leader's GC policy (gcpolicy.py): a due full pass waits for a quiet second.
    policy = gcpolicy.FullCollections()
    policy.activity = lambda: rt.core.transfers_begun
    full_gc = asyncio.create_task(gcpolicy.full_collections(policy=policy))  # owned here
    server = await asyncio.start_unix_server(on_connect, path)
    try:
        sys.stdout.write(READY)  # the parent waits for this line
        sys.stdout.flush()
        await done.wait()
    finally:
        server.close()
        full_gc.cancel()
        if counted is not None:
            await counted.close()
        await rt.stop()
        if tracer is not None:
            tracer.close()


def settings_json(settings: CoreSettings) -> str:
    """`settings` for --settings (JSON: never pickle between processes)."""
    return json.dumps(dataclasses.asdict(settings))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pushkv.controlplane.partition_host")
    p.add_argument("--socket", required=True, help="the Unix socket to listen on")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--term", type=int, default=0)
    p.add_argument("--coordinator-id", required=True)
    p.add_argument("--parent", type=int, default=0, help="die with this process (pid)")
    p.add_argument("--log-level", default="WARNING", help="its log, on stderr")
    p.add_argument("--settings", default="{}", help="the replica's CoreSettings, as a JSON object")
    p.add_argument("--metrics", action="store_true", help="count for the front's /metrics")
    p.add_argument("--no-rank-metrics", dest="rank_metrics", action="store_false")
    p.add_argument("--fronts", type=int, default=1, help="the connections it serves")
    args = p.parse_args(argv)
    if not 1 <= args.fronts <= MAX_FRONTS:
        p.error(f"--fronts must be 1 to {MAX_FRONTS}, got {args.fronts}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.parent:
        die_with_parent(args.parent)
    # stderr: stdout carries READY only
    logs.configure(args.log_level, process=f"partition-{args.index}")
    settings = CoreSettings(**json.loads(args.settings))
    rt = partition_runtime(settings, args.index, args.partitions, args.term, args.coordinator_id)
    gcpolicy.install()
    # The coordinator's event loop (pushkv/cli/main.py).
    uvloop.run(
        serve(
            args.socket,
            rt,
            args.index,
            args.partitions,
            metrics=args.metrics,
            rank=args.rank_metrics,
            fronts=args.fronts,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
