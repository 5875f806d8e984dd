"""A host process of `pushkv bench cluster`: many simulated agent ranks (one
gRPC channel and AgentStream each, all on one asyncio loop) and the engines'
request load, against replicated coordinators.

Each rank follows the leader as ``agent/link.py``'s CoordinatorLink does: a
``LeaderFollower`` over the replicas' addresses; after a stream ends it moves
to the leader a standby named (backoff back to its minimum, unless that is
the address that just failed: pushkv/net/leader.py) or to the next
address, and waits ``delay * (0.5 + random())`` before dialling again, the
delay doubling up to its maximum (jittered exponential backoff: a thousand
ranks losing their leader at once do not dial back in step). It re-registers
with the same incarnation and heartbeats at the interval its Welcome names.

With ``--relay`` each engine's ranks (a TP-8 engine is one node) reach the
coordinators through one in-process ``pushkv.relay.upstream.Upstream`` per engine,
the node relay's own upstream code: each rank's session is one channel of its
engine's NodeStream (`RelayCall`) instead of its own gRPC channel and
AgentStream; only the node-local hop from agent to relay is left out. The
Upstream follows the leader itself (jittered backoff); a rank whose channel
ended backs off as after a refused stream and opens another, its hello held
until the leader accepts the Upstream's next stream (as ``pushkv relay``
holds it).

The ranks move no bytes. A prefill rank that receives an order reports POSTED
and DONE on its own stream and the arrival on the target decode rank's stream
(every target rank lives in this process: each host's transfers pair its own
prefill and decode engines). The engines' load: per scheduler step, each
engine sends what became due as one ``Submit`` (decode engines their
registrations, prefill engines their prefill reports; which side goes first
is drawn per step, the second sent once the first was answered). With
``--relay`` those ``Submit``s go up the engine's NodeStream too
(``Upstream.submit``, as ``pushkv relay`` carries a node scheduler's), unless
``--submit-direct``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pushkv.bench.coordinator_load import ClientReport
from pushkv.bench.coordinator_server import pin
from pushkv.bench.coordinator_workload import COMPLETE, RPC_TIMEOUT_S, agent_hello
from pushkv.bench.coordinator_workload import decode_request as _decode_request
from pushkv.bench.coordinator_workload import prefill_request as _prefill_request
from pushkv.net.event_loop import sample_loop_lag
from pushkv.net.leader import LeaderFollower, go_to
from pushkv.net.silence import WATCH_S, SilenceWatch

if TYPE_CHECKING:
    from pushkv.relay.upstream import Channel, Upstream

# Each rank's channel (each relay's, with --relay; each engine's Submit
# client) opens a TCP connection of its own, as agents in their own processes
# and relays and engines on their own nodes do. gRPC would otherwise share one
# connection among every channel of this process to the same address: a
# host's ranks multiplexed on one HTTP/2 connection, which costs the leader
# less per message than a cluster does.
OWN = (("grpc.use_local_subchannel_pool", 1),)
# agent/link.py's CoordinatorLink defaults (tests/test_bench_cluster.py checks them).
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
MAX_OUT_BATCH = 256  # reports per AgentBatch, as agent/link.py
SPOT_CHECK = 16
HOST_NICE = 5


@dataclass(frozen=True)
class HostSpec:
    index: int
    prefill: tuple[str, ...]  # engine ids
    decode: tuple[str, ...]
    tp: int
    addresses: str  # the replicas, comma-separated
    start_spread_s: float  # ranks start at random times within this
    seed: int
    relay: bool = False  # each engine's ranks through one relay Upstream
    relay_submit: bool = False  # and its Submits up that Upstream's stream


def engines(n: int, hosts: int, prefix: str = "cl") -> list[tuple[list[str], list[str]]]:
    """`n` engines dealt to `hosts` hosts, alternately prefill and decode within
    each host: (prefill ids, decode ids) per host. Every host needs both."""
    if hosts < 1 or n < 2 * hosts:
        raise ValueError(f"{n} engines cannot give {hosts} hosts a prefill and a decode engine")
    out: list[tuple[list[str], list[str]]] = [([], []) for _ in range(hosts)]
    per = [n // hosts + (1 if h < n % hosts else 0) for h in range(hosts)]
    for h, k in enumerate(per):
        for i in range(k):
            side = out[h][i % 2]
            side.append(f"{prefix}-h{h}-{'pd'[i % 2]}{i // 2}")
    return out


@dataclass
class Stats:
    """Counters of one host (the controller takes differences)."""

    sent: int = 0  # AgentMessages sent (a batch counts its items)
    received: int = 0  # CoordinatorMessages received (likewise)
    heartbeats: int = 0
    acks: int = 0
    hellos: int = 0  # streams opened (each sends a hello); with --relay, channels
    refused: int = 0  # streams that ended in an error (--relay: or found no upstream)
    writes: int = 0  # stream messages the ranks wrote (a hello, a batch: one each)
    node_streams: int = 0  # --relay: NodeStreams the Upstreams opened
    up_messages: int = 0  # --relay: NodeUp messages they sent (carrying the writes)
    relayed_submits: int = 0  # --relay: Submits they carried
    # Streams a rank left for the coordinator's silence (--relay: NodeStreams
    # an Upstream ended for it, pushkv/relay/upstream.py).
    silenced: int = 0
    # Streams a rank left, while the coordinator was silent, for the leader
    # another replica named (pushkv/net/silence.py, ask_due; --relay: the Upstreams').
    redirected: int = 0


def grpc_eof() -> Any:
    import grpc

    return grpc.aio.EOF  # type: ignore[attr-defined]


UNAVAILABLE = 14  # grpc.StatusCode.UNAVAILABLE's code
RELAY_HELLO_WAIT_S = 10.0  # pushkv/relay/server.py RelaySettings.hello_wait_s


class ChannelEnded(Exception):
    """A relay channel ended with an error status (as an AgentStream's AioRpcError)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"status {code}: {detail}")
        self.code = code
        self.detail = detail


class RelayCall:
    """A relay channel with the surface of the AgentStream call `Rank._session`
    uses: write -> Channel.send, read -> the next ChannelDown's message (EOF
    on a clean end; ChannelEnded on an error end), cancel -> Channel.close_up."""

    def __init__(self, channel: Channel) -> None:
        self._ch = channel
        # The NodeStream's coordinator: the upstream's address while it is open.
        self.address = channel.gen.address
        self._ended = False

    async def write(self, msg: Any) -> None:
        if not self._ch.send(msg):
            raise ChannelEnded(UNAVAILABLE, "relay: the channel is closed")

    async def read(self) -> Any:
        if self._ended:
            return grpc_eof()
        item = await self._ch.down.get()
        if not item.ended:
            return item.message
        self._ended = True
        if item.code:
            raise ChannelEnded(item.code, item.detail)
        return grpc_eof()

    async def code(self) -> int:
        return 0  # an error end raised in read

    def cancel(self) -> None:
        self._ch.close_up()


class StreamCall:
    """An AgentStream whose requests come from an async iterator, as
    agent/link.py's come from its generator, with the surface `Rank._session`
    uses (write, read, code, cancel). A `call.write` that finds the call
    already ended makes grpc.aio report INTERNAL "Internal error from Core"
    instead of the server's status and the leader a standby names (the
    coordinator now reads a refused stream's first message first:
    controlplane/status_map.py)."""

    def __init__(self, open_stream: Any) -> None:
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._call = open_stream(self._requests())

    async def _requests(self) -> Any:
        while (msg := await self._out.get()) is not None:
            yield msg

    async def write(self, msg: Any) -> None:
        if self._call.done():
            raise ChannelEnded(UNAVAILABLE, "the stream ended")
        self._out.put_nowait(msg)

    async def read(self) -> Any:
        return await self._call.read()

    async def code(self) -> Any:
        return await self._call.code()

    def cancel(self) -> None:
        self._out.put_nowait(None)
        self._call.cancel()


class Rank:
    """One simulated agent rank: its stream, its leader following, its reports."""

    def __init__(self, host: Host, engine: str, role: Any, rank: int) -> None:
        self.host, self.engine, self.rank, self.role = host, engine, rank, role
        self.hello = agent_hello(engine, role, batched=True, rank=rank, tp=host.spec.tp)
        self.rng = random.Random(host.rng.random())  # this rank's jitter
        self.follower = LeaderFollower(host.spec.addresses, rng=self.rng)
        self.upstream: Upstream | None = host.upstreams.get(engine)  # --relay
        self.peer = ""  # the coordinator the current session reaches
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.welcomed_at = 0.0  # monotonic time of the last Welcome (0: none)
        self.welcomed_by = ""  # the address that sent it
        self.registered = False
        self.hb_interval_s = 1.0
        # The link's silence rule (pushkv/net/silence.py; direct streams, a relay's
        # Upstream has its own): the current call, its watch, and whether the
        # host's watchdog cancelled it.
        self.call: Any = None
        self.silence = SilenceWatch()
        self.silenced = False
        self.redirect = ""  # the leader another replica named (the call is cancelled)
        self.term = 0  # the leader term its welcomes told

    def put(self, msgs: list[Any]) -> None:
        if self.registered:  # reports for a dead stream are dropped, as no WRITE ran
            self.queue.put_nowait(msgs)

    async def run(self) -> None:
        """agent/link.py's loop: session, follow, jittered exponential backoff."""
        import grpc

        from pushkv.v1 import pushkv_pb2_grpc as pbg

        rng = self.rng
        await asyncio.sleep(rng.random() * self.host.spec.start_spread_s)
        delay = BACKOFF_MIN_S
        while True:
            channel: Any = None
            try:
                if self.upstream is not None:
                    await self._session(await self._open_channel())
                else:
                    channel = grpc.aio.insecure_channel(self.follower.current, options=OWN)
                    self.peer = self.follower.current
                    await self._session(StreamCall(pbg.AgentServiceStub(channel).AgentStream))
                delay = BACKOFF_MIN_S
            except asyncio.CancelledError:
                if not self.silenced:  # the task itself is cancelled
                    raise
            except grpc.aio.AioRpcError as exc:
                self.host.stats.refused += 1
                # To the leader a standby named (backoff to its minimum, unless it
                # is the address that just failed), else the next.
                if not self.silenced and self.follower.follow(exc):
                    delay = BACKOFF_MIN_S
                delay = min(delay, self.follower.retry_cap(delay))
            except ChannelEnded:
                self.host.stats.refused += 1  # the Upstream follows the leader itself
            finally:
                self.registered = False
                self.call = None
                if channel is not None:
                    await channel.close()
            if self.silenced:  # as the link after its watchdog's cancel: the next address
                self.silenced = False
                if self.redirect:  # or the leader another replica named
                    self.host.stats.redirected += 1
                    self.follower.move_to(self.redirect)
                    self.redirect = ""
                else:
                    self.host.stats.silenced += 1
                    self.follower.follow()
            await asyncio.sleep(delay * (0.5 + rng.random()))  # jitter spreads reconnects
            delay = min(delay * 2, self.follower.retry_cap(BACKOFF_MAX_S))

    async def _open_channel(self) -> RelayCall:
        """A channel on the engine's NodeStream, the hello held until the
        leader accepted one, at most RELAY_HELLO_WAIT_S (as ``pushkv relay``
        holds the agent's stream, pushkv/relay/server.py), then refused."""
        assert self.upstream is not None
        ch = await self.upstream.wait_channel(RELAY_HELLO_WAIT_S)
        if ch is None:
            self.host.stats.hellos += 1  # the agent's stream to the relay, refused
            raise ChannelEnded(UNAVAILABLE, f"relay: no stream to {self.upstream.address} yet")
        call = RelayCall(ch)
        self.peer = call.address
        return call

    async def _session(self, call: Any) -> None:
        """One AgentStream (or relay channel, `RelayCall`): hello, then serve it."""
        from pushkv.v1 import pushkv_pb2 as pb

        stats = self.host.stats
        self.queue = asyncio.Queue()
        queue = self.queue
        eof: Any = grpc_eof()

        async def writer() -> None:
            while True:
                items: list[Any] = await queue.get()
                while len(items) < MAX_OUT_BATCH and not queue.empty():
                    items += queue.get_nowait()  # what is queued behind it, as the link does
                stats.sent += len(items)
                stats.writes += 1
                msg = (
                    items[0]
                    if len(items) == 1
                    else pb.AgentMessage(batch=pb.AgentBatch(messages=items))
                )
                try:
                    await call.write(msg)
                except Exception:
                    return  # the stream ended: the session's read says how

        stats.hellos += 1
        stats.writes += 1
        self.silence.started()  # the welcome is due within its limit too
        if self.upstream is None:
            self.call = call
        await call.write(pb.AgentMessage(hello=self.hello))
        tasks = [asyncio.create_task(writer()), asyncio.create_task(self._heartbeats(queue))]
        try:
            while (msg := await call.read()) is not eof:
                self._on_message(msg)
            await call.code()  # a clean end returns; an error raises AioRpcError
        finally:
            for t in tasks:
                t.cancel()
            call.cancel()

    async def _heartbeats(self, queue: asyncio.Queue[Any]) -> None:
        from pushkv.v1 import pushkv_pb2 as pb

        seq = 0
        while True:
            await asyncio.sleep(self.hb_interval_s)  # the lease keep-alive period
            seq += 1
            self.host.stats.heartbeats += 1
            queue.put_nowait([pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq))])

    def _on_message(self, msg: Any) -> None:
        host = self.host
        kind = msg.WhichOneof("kind")
        items = msg.batch.messages if kind == "batch" else (msg,)
        host.stats.received += len(items)
        now = time.monotonic()
        self.silence.heard()
        out: dict[Rank, list[Any]] = {}
        for m in items:
            k = m.WhichOneof("kind")
            if k == "heartbeat_ack":
                host.stats.acks += 1
            elif k == "order":
                host.on_order(self, m.order, now, out)
            elif k == "notice" and not m.notice.write_may_land:
                host.failed[m.notice.transfer_id] = (now, m.notice.state)
            elif k == "welcome":
                w = m.welcome
                self.hb_interval_s = w.heartbeat_interval_ms / 1000 or self.hb_interval_s
                self.silence.told(w.lease_ms, w.heartbeat_interval_ms)
                self.term = max(self.term, w.term)
                self.welcomed_at, self.welcomed_by = now, self.peer
                self.follower.reached()
                self.registered = True
        for rank, msgs in out.items():
            rank.put(msgs)


@dataclass
class Host:
    spec: HostSpec
    rng: random.Random
    stats: Stats = field(default_factory=Stats)
    ranks: dict[tuple[str, int], Rank] = field(default_factory=dict)
    orders: Counter[str] = field(default_factory=Counter)  # tid -> orders received
    ordered: dict[str, float] = field(default_factory=dict)  # tid -> its last order received
    failed: dict[str, tuple[float, int]] = field(default_factory=dict)
    upstreams: dict[str, Upstream] = field(default_factory=dict)  # --relay: per engine
    channels: dict[str, Any] = field(default_factory=dict)  # address -> its GetLeadership channel

    def channel(self, address: str) -> Any:
        """One aio channel per replica for the ranks' GetLeadership questions."""
        import grpc

        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address)
        return self.channels[address]

    def on_order(self, rank: Rank, o: Any, now: float, out: dict[Rank, list[Any]]) -> None:
        from pushkv.v1 import pushkv_pb2 as pb

        mine = out.setdefault(rank, [])
        for st in (pb.WRITE_STATUS_POSTED, pb.WRITE_STATUS_DONE):
            w = pb.WriteReport(order_id=o.order_id, transfer_id=o.transfer_id, status=st)
            mine.append(pb.AgentMessage(write=w))
        for t in o.targets:
            dst = self.ranks[(t.decode_engine_id, t.decode_rank)]
            a = pb.ArrivalReport(transfer_id=o.transfer_id, prefill_ranks=[o.prefill_rank])
            out.setdefault(dst, []).append(pb.AgentMessage(arrival=a))
        self.orders[o.transfer_id] += 1
        if self.orders[o.transfer_id] == self.spec.tp:  # every prefill rank ordered
            self.ordered[o.transfer_id] = now
            del self.orders[o.transfer_id]

    def leader(self) -> str:
        """The address the most recently welcomed rank was welcomed by."""
        last = max(self.ranks.values(), key=lambda r: r.welcomed_at)
        return last.welcomed_by

    def followed(self, address: str, since: float) -> list[float]:
        """Welcome times after `since` of the ranks registered with `address`."""
        return [
            r.welcomed_at
            for r in self.ranks.values()
            if r.registered and r.welcomed_by == address and r.welcomed_at > since
        ]

    def collect(self, prefix: str) -> tuple[dict[str, float], dict[str, tuple[float, int]]]:
        """(tid -> every rank ordered, tid -> (end, state)) of `prefix`, removed.
        A transfer every rank was ordered for and no notice failed counts as
        COMPLETE here; the controller then checks the coordinator agrees."""
        ordered = {k: v for k, v in self.ordered.items() if k.startswith(prefix)}
        failed = {k: v for k, v in self.failed.items() if k.startswith(prefix)}
        ends: dict[str, tuple[float, int]] = {k: (t, COMPLETE) for k, t in ordered.items()}
        ends.update(failed)
        for k in ordered:
            del self.ordered[k]
        for k in failed:
            del self.failed[k]
        for k in [k for k in self.orders if k.startswith(prefix)]:
            del self.orders[k]
        return ordered, ends


async def _watch_silence(host: Host) -> None:
    """agent/link.py's watchdog for every rank of the host at once: cancel a
    stream whose coordinator said nothing for its limit (the rank follows on),
    or, with several replicas, one that another replica says no longer goes
    to the leader (asked at each step of the silence, each rank on its own)."""
    asking: dict[Rank, asyncio.Task[None]] = {}
    while True:
        await asyncio.sleep(WATCH_S)  # a timer, not a synchronisation
        for r in host.ranks.values():
            if r.call is None or r.silenced:
                continue
            if r.silence.overdue():
                r.silenced = True
                r.call.cancel()
            elif r not in asking and r.follower.several and r.silence.ask_due():
                asking[r] = asyncio.create_task(_ask_leader(host, r, r.call))
        for r in [r for r, t in asking.items() if t.done()]:
            del asking[r]  # asked: the rank may ask again at its next step


async def _ask_leader(host: Host, r: Rank, call: Any) -> None:
    """The link's question for one rank (pushkv/net/leader_ask.py, on the host's
    shared channels); a leader named elsewhere (pushkv/net/leader.go_to) cancels
    the rank's call for it."""
    from pushkv.net.leader_ask import ask_aio  # grpc only in the hosts' processes

    dialed, answered = r.follower.current, r.silence.answered
    named, named_term = await ask_aio(r.follower.addresses, dialed, host.channel, owned=False)
    leader = go_to(named, named_term, dialed=dialed, answered=answered, term=r.term)
    if leader and r.call is call and not r.silenced:
        r.redirect, r.silenced = leader, True
        call.cancel()


def host_main(conn: Connection, spec: HostSpec, cpus: set[int] | None) -> None:
    """Process entry: serve the controller's commands until "quit"."""
    pin(cpus)
    # Below etcd and the standby on the shared CPUs: the simulation must not
    # starve the replicas' lease renewals (they would step down).
    with contextlib.suppress(OSError):
        os.nice(HOST_NICE)
    asyncio.run(_host(conn, spec))


async def _host(conn: Connection, spec: HostSpec) -> None:
    import grpc

    from pushkv.relay.upstream import RelayError
    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    host = Host(spec, random.Random(spec.seed))
    stop = asyncio.Event()  # ends the Upstreams
    up_tasks: list[asyncio.Task[None]] = []
    if spec.relay:
        from pushkv.relay.upstream import Upstream

        for engine in (*spec.prefill, *spec.decode):
            # The relay's own backoff (pushkv/relay/upstream.py), and a connection of its own.
            up = Upstream(spec.addresses, channel_options=OWN)
            host.upstreams[engine] = up
            up_tasks.append(asyncio.create_task(up.run(stop)))
    for engine in spec.prefill:
        for r in range(spec.tp):
            host.ranks[(engine, r)] = Rank(host, engine, pb.ROLE_PREFILL, r)
    for engine in spec.decode:
        for r in range(spec.tp):
            host.ranks[(engine, r)] = Rank(host, engine, pb.ROLE_DECODE, r)
    tasks = [asyncio.create_task(r.run()) for r in host.ranks.values()]
    if not spec.relay:
        tasks.append(asyncio.create_task(_watch_silence(host)))
    # (address, engine) -> (channel, TransferService stub): each engine's
    # scheduler client on a connection of its own, as engines on their own hosts.
    client: dict[tuple[str, str], Any] = {}
    code_name = {c.value[0]: c.name for c in grpc.StatusCode}

    def stub(address: str, engine: str) -> Any:
        if (address, engine) not in client:
            ch: Any = grpc.aio.insecure_channel(address, options=OWN)
            client[address, engine] = (ch, pbg.TransferServiceStub(ch))
        return client[address, engine][1]

    async def offer(prefix: str, rate: float, duration: float, cap: int, step_s: float) -> None:
        """Open loop: `rate` transfers/s for `duration` s, at most `cap` pending."""
        rng = host.rng
        leader = host.leader()
        sent: dict[str, float] = {}
        errors: Counter[str] = Counter()
        counts = [0, 0]  # RPCs, calls
        outstanding = [0]
        pending: set[asyncio.Task[None]] = set()

        async def submit(engine_calls: dict[str, list[Any]]) -> list[Any]:
            async def one(engine: str, calls: list[Any]) -> list[Any]:
                counts[0] += 1
                counts[1] += len(calls)
                request = pb.SubmitRequest(calls=calls)
                up = host.upstreams.get(engine) if spec.relay_submit else None
                if up is not None:  # on the engine's node stream
                    return list((await up.submit(request, RPC_TIMEOUT_S)).results)
                r = await stub(leader, engine).Submit(request, timeout=RPC_TIMEOUT_S)
                return list(r.results)

            res = await asyncio.gather(*(one(e, c) for e, c in engine_calls.items()))
            return [x for part in res for x in part]

        async def step(pairs: list[tuple[str, str, str]]) -> None:
            """One scheduler step's transfers (tid, prefill engine, decode engine)."""
            dec: dict[str, list[Any]] = {}  # engine -> its calls (one Submit each)
            pre: dict[str, list[Any]] = {}
            dec_ids: dict[str, list[str]] = {}  # engine -> the transfer of each call
            pre_ids: dict[str, list[str]] = {}
            for tid, p, d in pairs:
                dec.setdefault(d, []).append(pb.TransferCall(register=_decode_request(tid, d)))
                pre.setdefault(p, []).append(pb.TransferCall(prefill_done=_prefill_request(tid, p)))
                dec_ids.setdefault(d, []).append(tid)
                pre_ids.setdefault(p, []).append(tid)
            # submit() answers the engines' calls in dict order: the ids, flattened alike.
            sides = [(dec, [t for ids in dec_ids.values() for t in ids])]
            sides.append((pre, [t for ids in pre_ids.values() for t in ids]))
            (first, ids1), (second, ids2) = sides if rng.random() < 0.5 else sides[::-1]
            try:
                r1 = dict(zip(ids1, await submit(first), strict=True))
                t_send = time.monotonic()
                r2 = dict(zip(ids2, await submit(second), strict=True))
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += len(pairs)
                return
            except RelayError as exc:
                errors[exc.code.name] += len(pairs)
                return
            finally:
                outstanding[0] -= len(pairs)
            for tid, _, _ in pairs:
                bad = r1[tid] if r1[tid].code else r2[tid] if r2[tid].code else None
                if bad is None:
                    sent[tid] = t_send
                else:
                    errors[code_name.get(bad.code, str(bad.code))] += 1

        n = max(1, int(rate * duration))
        # How late this host's loop runs a timer, in ms: every order and report
        # of its ranks waits behind the same ready callbacks, so this is the
        # host's own share of the latency it measures.
        lags: list[float] = []
        sampler = asyncio.create_task(sample_loop_lag(lambda s: lags.append(s * 1000)))
        t0 = time.monotonic()
        issued = dropped = 0
        while issued + dropped < n:
            due = min(n, int((time.monotonic() - t0) * rate) + 1)
            new: list[tuple[str, str, str]] = []
            while issued + dropped < due:
                if outstanding[0] + len(new) >= cap:
                    dropped += 1
                    continue
                tid = f"{prefix}-h{spec.index}-{issued + dropped}"
                new.append((tid, rng.choice(spec.prefill), rng.choice(spec.decode)))
                issued += 1
            if new:
                outstanding[0] += len(new)
                task = asyncio.create_task(step(new))
                pending.add(task)
                task.add_done_callback(pending.discard)
            # Pacing of the open-loop offer, once per scheduler step (not synchronisation).
            await asyncio.sleep(max(t0 + (issued + dropped) / rate - time.monotonic(), step_s))
        t_end = time.monotonic()
        if pending:
            await asyncio.wait(pending)
        sampler.cancel()
        rpcs, calls = counts
        conn.send(
            ClientReport(t0, t_end, issued, dropped, sent, dict(errors), rpcs, calls, tuple(lags))
        )

    async def spot_check(ends: dict[str, tuple[float, int]]) -> tuple[int, int]:
        """(asked, not COMPLETE per the leader) over a sample counted COMPLETE."""
        counted = sorted(k for k, (_, st) in ends.items() if st == COMPLETE)
        sample = random.Random(len(counted)).sample(counted, min(SPOT_CHECK, len(counted)))
        address = host.leader()  # the ranks may follow a leader no offer went to
        stub(address, "")  # the spot check's own channel
        status: Any = pbg.StatusServiceStub(client[address, ""][0])
        wrong = 0
        for tid in sample:
            try:
                t = await status.GetTransfer(
                    pb.GetTransferRequest(transfer_id=tid), timeout=RPC_TIMEOUT_S
                )
            except grpc.aio.AioRpcError:
                wrong += 1
                continue
            wrong += t.state != pb.TRANSFER_STATE_COMPLETE
        return len(sample), wrong

    conn.send("started")
    while True:
        cmd = await asyncio.to_thread(conn.recv)
        if cmd[0] == "stats":  # (ranks registered, counters, welcomed-by addresses)
            regs = Counter(r.welcomed_by for r in host.ranks.values() if r.registered)
            host.stats.node_streams = sum(u.streams for u in host.upstreams.values())
            host.stats.up_messages = sum(u.up_messages for u in host.upstreams.values())
            host.stats.relayed_submits = sum(u.submits for u in host.upstreams.values())
            if host.upstreams:  # the Upstreams apply the silence rule, not the ranks
                host.stats.silenced = sum(u.silenced for u in host.upstreams.values())
                host.stats.redirected = sum(u.redirected for u in host.upstreams.values())
            conn.send((sum(regs.values()), host.stats, dict(regs)))
        elif cmd[0] == "followed":  # (address, since): welcome times of the ranks there
            conn.send(host.followed(cmd[1], cmd[2]))
        elif cmd[0] == "run":
            await offer(*cmd[1:])
        elif cmd[0] == "count":  # transfers of a prefix ordered on every rank, or failed
            p = cmd[1]
            conn.send(
                sum(1 for k in host.ordered if k.startswith(p))
                + sum(1 for k in host.failed if k.startswith(p))
            )
        elif cmd[0] == "collect":
            ordered, ends = host.collect(cmd[1])
            conn.send((ordered, ends, await spot_check(ends)))
        else:
            break
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    stop.set()  # each Upstream ends its NodeStream and returns
    await asyncio.gather(*up_tasks, return_exceptions=True)
    for ch, _ in client.values():
        await ch.close()
    for ch in host.channels.values():  # the ranks' GetLeadership channels
        await ch.close()
    print(f"host {spec.index}: stopped", file=sys.stderr, flush=True)
