"""Replicated coordinators on a real etcd (docs/reliability.md, "Replicated coordinators").

Real etcd (tests/support/etcd.py), real coordinator processes, real KV hosts
with their agents and NIXL. Waits are polls or watches under deadlines; the
failover time is measured and printed, never asserted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess, leadership
from pushkv.harness.etcd import EtcdCluster
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.net.tls import TLSFiles
from pushkv.rules import block_groups
from pushkv.tools import status as status_cli
from pushkv.tools.devpki import make_pki
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient, Result
from tests.support.etcd import EtcdServer, etcd, require_etcd  # noqa: F401  (the fixture)
from tests.support.kvpair import wait_state

pytestmark = pytest.mark.faults

# etcd in the tests grants 1 s leases (tests/support/etcd.py shortens its raft timings).
REPLICA = ["--etcd-lease-s", "1", "--lease-s", "2", "--heartbeat-interval-s", "0.5"]
REPLICA += ["--write-timeout-s", "3", "--log-level", "INFO"]
DEADLINE_S = 20.0  # generous: a loaded 2-core box; the measured figures are printed
NB = 32
CANARY = 0x77
GIVE_UP_S = 6.0
# Agents that rebuild: they must still be waiting for a leader when the new
# one welcomes them (the agents' default is 30 s). With 6 s, one agent on a
# loaded box was welcomed after its give-up and resolved locally.
REBUILD_GIVE_UP_S = 20.0
EXIT_LEADERSHIP_LOST = 3


def relay_went_to(relay: RelayProcess, leader: str) -> bool:
    """The relay's JSON log says another replica named `leader` and it went
    there (pushkv/relay/upstream.py, `leader_elsewhere`)."""
    for line in relay.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "leader_elsewhere" and entry.get("leader") == leader:
            return True
    return False


def poll(cond: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> float:
    """Poll `cond` (another process's state) until it holds; the seconds it took."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(0.01)  # polling other processes under a deadline
    return time.monotonic() - start


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return int(reply.status)


@dataclass
class Cluster:
    etcd: Any  # EtcdServer or EtcdCluster
    replicas: list[CoordinatorProcess]

    @property
    def addresses(self) -> str:
        return ",".join(r.address for r in self.replicas)

    def leader(self) -> CoordinatorProcess:
        """The replica that leads, once every live replica agrees on it."""
        found: list[CoordinatorProcess] = []

        def agreed() -> bool:
            live = [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]
            views = [leadership(r.address) for r in live]
            leaders = [
                r for r, v in zip(live, views, strict=True) if v and v.role == pb.LEADER_ROLE_LEADER
            ]
            if len(leaders) != 1 or any(v is None for v in views):
                return False
            found[:] = leaders
            return all(v is not None and v.leader == leaders[0].address for v in views)

        poll(agreed, "one leader that every replica names")
        return found[0]

    def standbys(self) -> list[CoordinatorProcess]:
        lead = self.leader()
        return [r for r in self.replicas if r is not lead and r.proc and r.proc.poll() is None]


@contextlib.contextmanager
def running_replicas(etcd: EtcdServer, *extra: str) -> Iterator[Cluster]:  # noqa: F811
    """Two replicas on `etcd` with the REPLICA flags (and `extra`), stopped after."""
    replicas = [CoordinatorProcess("--etcd", etcd.url, *REPLICA, *extra).start() for _ in range(2)]
    try:
        yield Cluster(etcd, replicas)
    finally:
        for r in replicas:
            r.stop()


@pytest.fixture
def cluster(etcd: EtcdServer) -> Iterator[Cluster]:  # noqa: F811
    with running_replicas(etcd) as c:
        yield c


def begin(address: str, tid: str) -> pb.TransferStatus:
    with grpc.insecure_channel(address) as ch:
        status: pb.TransferStatus = pbg.TransferServiceStub(ch).BeginTransfer(
            pb.BeginTransferRequest(transfer_id=tid, prefill_engine_id="P", decode_engine_id="D"),
            timeout=5,
        )
        return status


# ---------------------------------------------------------------- election and standbys


def test_one_leader_standby_refuses_writes_naming_it_and_serves_reads(cluster: Cluster) -> None:
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    view = leadership(standby.address)
    assert view is not None and view.role == pb.LEADER_ROLE_STANDBY
    assert view.leader == lead.address and view.term > 0 and view.etcd == cluster.etcd.url
    assert view.advertise == standby.address

    # Writes: refused with UNAVAILABLE, the leader named in details and metadata.
    with pytest.raises(grpc.RpcError) as refused:
        begin(standby.address, "ha-1")
    # The sync API's RpcError is also its Call (an intersection the stubs cannot name).
    exc = cast(grpc.Call, refused.value)
    assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert lead.address in (exc.details() or "")
    assert ("pushkv-leader", lead.address) in tuple(exc.trailing_metadata() or ())
    # The agent stream too: a hello to a standby is refused the same way.
    with grpc.insecure_channel(standby.address) as ch:
        hello = pb.AgentMessage(hello=pb.AgentHello(protocol_version=1))
        stream = pbg.AgentServiceStub(ch).AgentStream(iter([hello]), timeout=5)
        with pytest.raises(grpc.RpcError) as agent_refused:
            next(iter(stream))
        assert agent_refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # Reads: served.
    with grpc.insecure_channel(standby.address) as ch:
        st = pbg.StatusServiceStub(ch)
        assert st.ListEngines(pb.ListEnginesRequest(), timeout=5).engines == []
        assert st.ListTransfers(pb.ListTransfersRequest(), timeout=5).total_matching == 0

    # Health: the write services are NOT_SERVING on the standby, SERVING on the leader.
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        (health_pb2.HealthCheckResponse.NOT_SERVING),
    )
    for service in ("pushkv.v1.AgentService", "pushkv.v1.TransferService"):
        assert health(standby.address, service) == not_serving
        assert health(lead.address, service) == serving
    for address in (standby.address, lead.address):
        assert health(address, "pushkv.v1.StatusService") == serving
        assert health(address, "") == serving

    # The leader takes the write; `pushkv status` reads from it through either address.
    assert begin(lead.address, "ha-1").transfer_id == "ha-1"
    out = io.StringIO()
    assert status_cli.main(["--coordinator", cluster.addresses, "get", "ha-1", "--json"], out) == 0
    assert json.loads(out.getvalue())["transferId"] == "ha-1"
    out = io.StringIO()
    assert status_cli.main(["--coordinator", cluster.addresses, "leader"], out) == 0
    print(out.getvalue())
    rows = out.getvalue().splitlines()[2:]
    assert len(rows) == 2
    for row in rows:
        assert lead.address in row and str(view.term) in row
    assert sum(" leader " in row for row in rows) == 1
    # `pushkv status` alone: the same election table, then the leader's
    # engines and transfers in flight (ha-1 waits for its sides), read from
    # the leader though the standby is named first.
    out = io.StringIO()
    standby_first = f"{standby.address},{lead.address}"
    assert status_cli.main(["--coordinator", standby_first], out) == 0
    election, _, in_flight = out.getvalue().strip().split("\n\n")
    cells = [row.split() for row in election.splitlines()[2:]]
    assert [c[:4] for c in cells] == [
        [standby.address, "standby", lead.address, str(view.term)],
        [lead.address, "leader", lead.address, str(view.term)],
    ], out.getvalue()
    assert in_flight == "transfers in flight: 1", out.getvalue()

    # Asking "who leads?" (pushkv/net/leader_ask.py): the standby names the leader
    # and its term; an address that refuses, and the one dialed, are passed.
    import asyncio

    from pushkv.net.leader_ask import ask, ask_aio

    opened: list[str] = []

    def channel_for(address: str) -> grpc.Channel:
        opened.append(address)
        return grpc.insecure_channel(address)

    dead = "127.0.0.1:1"
    addrs = [dead, lead.address, standby.address]
    assert ask(addrs, lead.address, channel_for) == (lead.address, view.term)
    assert opened == [dead, standby.address]
    assert ask([standby.address], standby.address, channel_for) == ("", 0)
    assert ask(addrs, lead.address, channel_for, stop=lambda: True) == ("", 0)
    assert opened == [dead, standby.address]
    aio = asyncio.run(ask_aio(addrs, lead.address, grpc.aio.insecure_channel))
    assert aio == (lead.address, view.term)


def test_router_and_scheduler_client_follow_the_leader(cluster: Cluster) -> None:
    import asyncio

    from pushkv.router.app import Router, RouterSettings
    from pushkv.router.engines import Engine

    lead = cluster.leader()
    (standby,) = cluster.standbys()
    standby_first = f"{standby.address},{lead.address}"

    async def router_follows() -> tuple[str, str]:
        # BeginTransfer sent to the standby first: refused, the router moves and retries.
        router = Router(RouterSettings(coordinator=standby_first, connect_timeout_s=5))
        try:
            await router._begin("ha-router-1", Engine("P", "http://p"), Engine("D", "http://d"))
            after_begin = router._follower.current
            router._follower.move_to(standby.address)
            router._use_current()
            await router._follow_leader()  # GetLeadership: the standby names the leader
            return after_begin, router._follower.current
        finally:
            await router.close_channels()

    assert asyncio.run(router_follows()) == (lead.address, lead.address)
    with grpc.insecure_channel(lead.address) as ch:
        t = pbg.StatusServiceStub(ch).GetTransfer(
            pb.GetTransferRequest(transfer_id="ha-router-1"), timeout=5
        )
        assert t.state == pb.TRANSFER_STATE_AWAITING

    client = CoordinatorClient(standby_first, timeout_s=2.0)
    try:
        client.submit(Call("cancel", "r1", "ha-client-1", reason="test"))
        res = client.wait_result(lambda r: r.call.transfer_id == "ha-client-1", DEADLINE_S)
        assert res is not None
        # Answered by the leader (a cancel of an unknown transfer is NOT_FOUND
        # there; the standby would have refused with UNAVAILABLE).
        assert "UNAVAILABLE" not in res.error, res
        assert client._follower.current == lead.address
    finally:
        client.close()


def test_router_and_scheduler_client_leave_a_frozen_leader(cluster: Cluster) -> None:
    """A leader frozen by SIGSTOP keeps its connections open and silent: the
    router's BeginTransfer and the scheduler client's calls are not answered
    UNAVAILABLE but time out. Both move to the replica that leads next, within
    their own deadline; the thawed leader, deposed, exits without ordering."""
    import asyncio

    from pushkv.router.app import Router, RouterSettings
    from pushkv.router.engines import Engine

    lead = cluster.leader()
    (standby,) = cluster.standbys()
    lead_first = f"{lead.address},{standby.address}"
    lead.freeze()
    try:
        poll(
            lambda: (
                (v := leadership(standby.address)) is not None and v.role == pb.LEADER_ROLE_LEADER
            ),
            "the standby leads after the leader froze",
        )

        async def router_begins() -> str:
            # The frozen replica first: an attempt times out, GetLeadership
            # moves off it, all within the default connect_timeout_s (10 s).
            router = Router(RouterSettings(coordinator=lead_first))
            try:
                await router._begin("ha-frozen-1", Engine("P", "http://p"), Engine("D", "http://d"))
                return router._follower.current
            finally:
                await router.close_channels()

        assert asyncio.run(router_begins()) == standby.address
        with grpc.insecure_channel(standby.address) as ch:
            t = pbg.StatusServiceStub(ch).GetTransfer(
                pb.GetTransferRequest(transfer_id="ha-frozen-1"), timeout=5
            )
            assert t.state == pb.TRANSFER_STATE_AWAITING

        # The connector's default deadline (rpc_timeout_s, 5 s, as long as the
        # failover window): an attempt at the frozen leader must not spend it.
        client = CoordinatorClient(lead_first)
        try:
            client.submit(Call("cancel", "r1", "ha-frozen-1", reason="test"))
            res = client.wait_result(lambda r: r.call.transfer_id == "ha-frozen-1", DEADLINE_S)
            assert res is not None and res.ok, res  # the new leader cancelled it
            assert client._follower.current == standby.address
        finally:
            client.close()
    finally:
        lead.thaw()
    assert lead.proc is not None
    lead.proc.wait(DEADLINE_S)
    assert lead.proc.returncode == EXIT_LEADERSHIP_LOST, lead.log_text()[-4000:]
    with grpc.insecure_channel(standby.address) as ch:
        t = pbg.StatusServiceStub(ch).GetTransfer(
            pb.GetTransferRequest(transfer_id="ha-frozen-1"), timeout=5
        )
    assert t.state == pb.TRANSFER_STATE_CANCELLED


@pytest.mark.parametrize("via", ["direct", "relay"])
def test_an_agent_starting_leaves_a_frozen_replica_for_the_leader_another_names(
    cluster: Cluster, via: str
) -> None:
    """An agent (or, with `relay`, the node relay it dials) that starts while
    the replica first in its list is frozen (a host that is down looks the
    same: a connection that never answers) asks the other replica which one
    leads once its hello (the relay's stream) has waited a limit, and goes
    there. Without that it would wait out an unanswered stream's four limits
    (20 s before any welcome) or gRPC's 20 s connect timeout: the agent's
    start bound, 14 s, is under both."""
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    lead.freeze()
    relay: RelayProcess | None = None
    try:
        poll(
            lambda: (
                (v := leadership(standby.address)) is not None and v.role == pb.LEADER_ROLE_LEADER
            ),
            "the standby leads after the leader froze",
        )
        both = f"{lead.address},{standby.address}"  # the frozen replica first
        relay = RelayProcess(both).start() if via == "relay" else None
        dial = relay.address if relay else both
        p = KVHost(HostSpec(dial, "P", "prefill", num_blocks=NB, give_up_s=GIVE_UP_S))
        try:
            started = time.monotonic()
            p.start(timeout=14.0)
            print(f"{via}: registered {time.monotonic() - started:.2f} s after the host's start")
            # The relay's agent has one address, the relay's: it asks no one.
            assert p.call("link") == ((0, 0) if relay else (0, 1))
            if relay:
                assert relay_went_to(relay, standby.address), relay.log_text()
            with grpc.insecure_channel(standby.address) as ch:
                engines = pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest(), timeout=5)
            assert [e.engine_id for e in engines.engines] == ["P"]
        finally:
            p.stop()
    finally:
        lead.thaw()
        if relay:
            relay.stop()
    assert lead.proc is not None
    lead.proc.wait(DEADLINE_S)
    assert lead.proc.returncode == EXIT_LEADERSHIP_LOST, lead.log_text()[-4000:]


@pytest.mark.parametrize("via", ["direct", "relay"])
def test_agents_leave_a_frozen_leader_once_another_replica_leads(
    etcd: EtcdServer,  # noqa: F811
    via: str,
) -> None:
    """Agents of a leader frozen by SIGSTOP, whose lease (10 s here) would
    keep them on it that long, ask the standby which replica leads after two
    heartbeat intervals (0.5 s each) of silence and each interval after: once
    it leads (an etcd lease, 1 s, after the freeze) and names itself with a
    newer term, they (with `relay`, their node relay) go there, well within
    the lease. The thawed leader exits 3."""
    with running_replicas(etcd, "--lease-s", "10") as cluster:
        lead = cluster.leader()
        (standby,) = cluster.standbys()
        both = f"{lead.address},{standby.address}"
        relay = RelayProcess(both).start() if via == "relay" else None
        p, d = rebuilding_hosts(relay.address if relay else both)
        try:
            p.start()
            d.start()
            _wait_ready(lead.address)
            lead.freeze()
            try:
                took = poll(
                    lambda: _ready_at(standby.address),
                    "P and D ready at the standby within half the lease",
                    deadline_s=5.0,
                )
                print(f"{via}: agents registered with the new leader {took:.2f} s after the freeze")
                if relay:
                    assert relay_went_to(relay, standby.address), relay.log_text()
                else:
                    assert p.call("link") == d.call("link") == (0, 1)
            finally:
                lead.thaw()
            assert lead.proc is not None
            lead.proc.wait(DEADLINE_S)
            assert lead.proc.returncode == EXIT_LEADERSHIP_LOST, lead.log_text()[-4000:]
        finally:
            p.stop()
            d.stop()
            if relay:
                relay.stop()


def test_a_standby_names_the_leader_to_many_aio_streams_at_once(cluster: Cluster) -> None:
    """grpc.aio clients (a node relay's NodeStream, the bench's agents) whose
    first send finds the call already refused report INTERNAL "Internal error
    from Core", without the status or the leader named: the standby reads a
    refused stream's first message before refusing it (status_map.py). Before
    that, 117 and 175 of these 384 streams got INTERNAL in two runs."""
    import asyncio
    from collections import Counter

    lead = cluster.leader()
    (standby,) = cluster.standbys()

    async def one(i: int) -> str:
        hello = pb.AgentMessage(
            hello=pb.AgentHello(
                protocol_version=1, identity=pb.AgentIdentity(engine_id=f"e{i}", tp_size=1)
            )
        )

        async def requests() -> Any:
            yield hello
            await asyncio.Event().wait()  # open until refused (cancelled with the call)

        async with grpc.aio.insecure_channel(standby.address) as ch:
            call = pbg.AgentServiceStub(ch).AgentStream(requests())
            try:
                await call.read()
            except grpc.aio.AioRpcError as e:
                # grpc-stubs give AioRpcError the sync RpcError's metadata type.
                md = cast("grpc.aio.Metadata | None", e.trailing_metadata())
                named = dict(md or ()).get("pushkv-leader")
                return f"{e.code().name} {named}"
            finally:
                call.cancel()
        return "answered"

    async def rounds() -> Counter[str]:
        got: Counter[str] = Counter()
        for _ in range(3):
            got.update(await asyncio.gather(*(one(i) for i in range(128))))
        return got

    assert asyncio.run(rounds()) == Counter({f"UNAVAILABLE {lead.address}": 3 * 128})


def test_leader_kill9_a_standby_leads(cluster: Cluster) -> None:
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    term = _term(lead.address)
    lead.kill()
    took = poll(
        lambda: (v := leadership(standby.address)) is not None and v.role == pb.LEADER_ROLE_LEADER,
        "the standby leads after the leader's kill -9",
    )
    print(f"failover after kill -9: {took:.3f} s (etcd lease TTL 1 s)")
    view = leadership(standby.address)
    assert view is not None and view.term > term and view.leader == standby.address
    assert begin(standby.address, "ha-after").state == pb.TRANSFER_STATE_AWAITING


def test_leader_sigterm_hands_over_at_once(cluster: Cluster) -> None:
    """A clean shutdown revokes the leader's lease: no wait for it to expire."""
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    assert lead.proc is not None
    lead.proc.terminate()
    started = time.monotonic()
    lead.proc.wait(DEADLINE_S)
    assert lead.proc.returncode == 0, lead.log_text()[-4000:]
    _event(lead, "leadership_resigned")
    poll(
        lambda: (v := leadership(standby.address)) is not None and v.role == pb.LEADER_ROLE_LEADER,
        "the standby leads after the leader's SIGTERM",
    )
    print(f"handover after SIGTERM: {time.monotonic() - started:.3f} s")


def test_leader_cut_off_from_etcd_steps_down(cluster: Cluster) -> None:
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    cluster.etcd.pause()  # SIGSTOP: every etcd call of the leader times out
    try:
        assert lead.proc is not None
        lead.proc.wait(DEADLINE_S)  # it stops ordering, then ends
        assert lead.proc.returncode == EXIT_LEADERSHIP_LOST
        lost = _event(lead, "leadership_lost")
        assert "not renewed" in lost["reason"]
        # No leader while etcd is away: the standby still refuses writes.
        with pytest.raises(grpc.RpcError) as refused:
            begin(standby.address, "ha-cut")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.etcd.resume()
    took = poll(
        lambda: (v := leadership(standby.address)) is not None and v.role == pb.LEADER_ROLE_LEADER,
        "the standby leads once etcd is back",
    )
    print(f"standby led {took:.3f} s after etcd resumed")
    # The old leader stepped down before the new one was elected (same host clock).
    assert lost["timestamp"] < _event(standby, "leadership_won")["timestamp"]


# ---------------------------------------------------------------- TLS to etcd


def test_replicas_reach_an_etcd_that_demands_tls_client_certificates(
    tmp_path: Path,
) -> None:
    """etcd on https only, with --client-cert-auth: replicas given the CA and a
    client certificate elect a leader, and a standby takes over after its kill
    -9; a replica given only the CA is refused by etcd (the handshake fails),
    and says so in its log, naming the endpoint."""
    require_etcd()
    certs = make_pki(tmp_path / "pki")
    ca, cert = str(tmp_path / "pki" / "ca.pem"), certs["coordinator"]
    key = str(cert.with_suffix(".key"))
    server = EtcdServer(tls=TLSFiles(ca, str(cert), key)).start()
    tls = ("--etcd-ca", ca, "--etcd-cert", str(cert), "--etcd-key", key)
    replicas = [CoordinatorProcess("--etcd", server.url, *tls, *REPLICA) for _ in range(2)]
    no_cert = CoordinatorProcess("--etcd", server.url, "--etcd-ca", ca, *REPLICA)
    try:
        assert server.url.startswith("https://")
        for r in (*replicas, no_cert):
            r.start()
        c = Cluster(server, replicas)
        lead = c.leader()
        (standby,) = c.standbys()
        lead.kill()
        poll(
            lambda: (
                (v := leadership(standby.address)) is not None and v.role == pb.LEADER_ROLE_LEADER
            ),
            "the standby leads over TLS after the leader's kill -9",
        )
        poll(lambda: "etcd_session_failed" in no_cert.log_text(), "the refused replica's log")
        failed = _event(no_cert, "etcd_session_failed")
        assert failed["endpoint"] == f"127.0.0.1:{server.client_port}"
        assert failed["error"].startswith("UNAVAILABLE"), failed
        view = leadership(no_cert.address)
        assert view is not None and view.role == pb.LEADER_ROLE_STANDBY
    finally:
        for r in (*replicas, no_cert):
            r.stop()
        server.stop()


# ---------------------------------------------------------------- three etcd members


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    require_etcd()
    members = EtcdCluster(3).start()
    try:
        yield members
    finally:
        members.stop()


def test_three_etcd_members_leader_survives_one_loss_and_steps_down_on_quorum_loss(
    etcd3: EtcdCluster,
) -> None:
    raft = etcd3.raft_leader()
    first, last = [m for m in etcd3.members if m is not raft]
    # Every replica dials `first` first; its loss leaves the raft leader alone.
    urls = ",".join(m.url for m in (first, raft, last))
    replicas = [CoordinatorProcess("--etcd", urls, *REPLICA).start() for _ in range(2)]
    try:
        cluster = Cluster(etcd3, replicas)
        lead = cluster.leader()
        term = _term(lead.address)

        first.kill()  # one member of three: the cluster keeps its quorum
        poll(
            lambda: "etcd_keepalive_recovered" in lead.log_text(),
            "the leader renews its lease through another member",
        )
        assert _event(lead, "etcd_endpoint_switched")["endpoint"] != first.url.removeprefix(
            "http://"
        )
        assert lead.proc is not None and lead.proc.poll() is None
        assert cluster.leader() is lead  # the same leadership, every replica agrees
        assert _term(lead.address) == term

        raft.kill()  # two of three gone: no quorum, no lease can be renewed
        lead.proc.wait(DEADLINE_S)
        assert lead.proc.returncode == EXIT_LEADERSHIP_LOST
        (standby,) = [r for r in replicas if r is not lead]
        with pytest.raises(grpc.RpcError) as refused:
            begin(standby.address, "ha-no-quorum")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for r in replicas:
            r.stop()


# ---------------------------------------------------------------- agents follow


def test_kv_host_agents_follow_the_new_leader_after_kill9(cluster: Cluster) -> None:
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    # Each agent is given both addresses, the dead-to-be leader first.
    both = f"{lead.address},{standby.address}"
    p = KVHost(HostSpec(both, "P", "prefill", num_blocks=NB, give_up_s=GIVE_UP_S))
    d = KVHost(HostSpec(both, "D", "decode", num_blocks=NB, give_up_s=GIVE_UP_S))
    client = CoordinatorClient(both, timeout_s=2.0)
    try:
        p.start()
        d.start()
        d.call("canary", CANARY)
        _wait_ready(lead.address)
        old_term = _term(lead.address)
        assert p.call("term") == d.call("term") == (old_term, 0)  # from the welcome
        _transfer(client, lead.address, p, d, "ha-before", seed=41)

        # In flight at the failover (the WRITE held back): resolves as after a
        # coordinator restart today (phase 1; docs/reliability.md).
        written = p.call("writes_posted")
        p.call("pause", True)
        d.call("expect", ["ha-inflight"])
        _register_and_done(client, p, "ha-inflight", [1, 2], [5, 6])
        started = time.monotonic()
        lead.kill()
        _wait_ready(standby.address)
        took = time.monotonic() - started
        print(f"agents registered with the new leader {took:.3f} s after the kill -9")
        assert p.wait_event("ha-inflight", DEADLINE_S).kind is EventKind.BLOCKS_FREE
        assert d.wait_event("ha-inflight", DEADLINE_S).kind is EventKind.KV_FAILED
        p.call("pause", False)
        assert p.call("writes_posted") == written  # nothing of ha-inflight was written
        # The agents follow the new leader's term (orders are stamped with it).
        new_term = _term(standby.address)
        assert new_term > old_term
        assert p.call("term")[0] == d.call("term")[0] == new_term
        untouched = [b for b in range(NB) if b not in (20, 21)]  # ha-before wrote 20, 21
        assert d.call("check_canary", untouched, CANARY) == []

        _transfer(client, standby.address, p, d, "ha-after", seed=42)
        assert client._follower.current == standby.address
    finally:
        client.close()
        p.stop()
        d.stop()


@pytest.mark.parametrize("how", ["kill9", "freeze"])
@pytest.mark.parametrize("via", ["direct", "relay"])
def test_in_flight_transfers_complete_through_the_new_leader(
    cluster: Cluster, via: str, how: str
) -> None:
    """Failover rebuild: agents that rebuild re-send their live transfers, the
    new leader adopts them, and the transfers of every stage complete through
    it with their bytes verified and one WRITE each. With `relay`, both agents
    dial one `pushkv relay` (given both replicas), which follows the leader.

    `kill9` crashes the leader (its peers' connections are reset). `freeze`
    stops it with SIGSTOP (a long pause, a frozen VM): its connections stay
    open and silent, so its clients must notice the silence themselves; once
    thawed, the deposed leader orders nothing and exits."""
    lead = cluster.leader()
    (standby,) = cluster.standbys()
    both = f"{lead.address},{standby.address}"
    relay = RelayProcess(both).start() if via == "relay" else None
    dial = relay.address if relay else both
    p, d = rebuilding_hosts(dial)
    client = CoordinatorClient(both, timeout_s=2.0)
    # transfer -> (prefill blocks, decode blocks, seed); 20 tokens: 2 blocks each.
    stages = {
        "ha-registered": ([1, 2], [22, 23], 51),  # decode registered only
        "ha-arrived": ([3, 4], [24, 25], 52),  # both there; prefill reports after the kill
        "ha-ordered": ([5, 6], [26, 27], 53),  # ordered, the WRITE held unposted
    }
    try:
        p.start()
        d.start()
        d.call("canary", CANARY)
        _wait_ready(lead.address)
        # Ordered and written before the kill: complete at the agents already.
        _transfer(client, lead.address, p, d, "ha-written", seed=50)
        for tid, (src, _, seed) in stages.items():
            p.fill(src, seed=seed)
            d.call("expect", [tid])
        _submit(client, Call("register", "r1", "ha-registered", "D", block_groups.of((22, 23)), 20))
        _submit(client, Call("register", "r2", "ha-arrived", "D", block_groups.of((24, 25)), 20))
        p.call("hold", ["ha-arrived"])
        p.call("pause", True)
        _register_and_done(client, p, "ha-ordered", [26, 27], [5, 6])

        def unposted() -> bool:
            return any(h[0] == "ha-ordered" and h[2] for h in p.call("held"))

        poll(unposted, "the old leader's order held unposted at the prefill agent")
        held = {h[0]: h for h in p.call("held")}
        assert set(held) == {"ha-arrived", "ha-ordered"} and not held["ha-ordered"][1]
        assert {h[0] for h in d.call("held")} == set(stages)  # expected, nothing counted
        written = p.call("writes_posted")
        old_term = _term(lead.address)

        killed = time.monotonic()
        lead.kill() if how == "kill9" else lead.freeze()
        _wait_ready(standby.address)
        followed = time.monotonic() - killed
        with grpc.insecure_channel(standby.address) as ch:
            st = pbg.StatusServiceStub(ch)
            for tid in stages:  # adopted from the hellos (the client resubmits their sides)
                t = st.GetTransfer(pb.GetTransferRequest(transfer_id=tid), timeout=5)
                assert "adopted" in [e.stage for e in t.timeline], (tid, t)
        # Registered there once the welcome is queued; followed once the link read it.
        poll(lambda: p.call("term")[0] == d.call("term")[0] > old_term, "the new term followed")
        assert p.call("writes_posted") == written  # posting held from the loss to the welcome
        p.call("pause", False)
        # The old term's order is refused, not posted (one WRITE per transfer in
        # all, below); nothing was resolved locally.
        poll(lambda: p.call("term")[1] == 1, "the old leader's order refused")
        # (ha-ordered's sides, resubmitted by the client on its own, may already
        # have completed through the new leader: KV_READY and "done" are no
        # local resolution.)
        completed = {(EventKind.KV_READY, ""), (EventKind.BLOCKS_FREE, "done")}
        events = p.pending_events() + d.pending_events()
        resolved = [e for e in events if e.transfer_id in stages]
        assert [e for e in resolved if (e.kind, e.detail) not in completed] == []

        # The client resubmits on its own the sides the old leader accepted
        # (both registrations, both sides of ha-ordered: open calls); the
        # prefill reports that come after the kill are new calls.
        p.call("hold", ["ha-registered"])
        _submit(
            client, Call("prefill_done", "p1", "ha-registered", "P", block_groups.of((1, 2)), 20)
        )
        _submit(client, Call("prefill_done", "p2", "ha-arrived", "P", block_groups.of((3, 4)), 20))
        for tid, (_, dst, seed) in stages.items():
            assert d.wait_event(tid, DEADLINE_S).kind is EventKind.KV_READY, tid
            assert d.check(dst, seed=seed) == [], tid
            assert p.wait_event(tid, DEADLINE_S).kind is EventKind.BLOCKS_FREE, tid
            with grpc.insecure_channel(standby.address) as ch:
                t = wait_state(pbg.StatusServiceStub(ch), tid, pb.TRANSFER_STATE_COMPLETE, 10)
            assert t.state == pb.TRANSFER_STATE_COMPLETE, (tid, t)
        completed_s = time.monotonic() - killed
        print(
            f"agents registered with the new leader {followed:.3f} s after the {how}; "
            f"the three transfers in flight complete {completed_s:.3f} s after it"
        )
        if how == "freeze":  # the deposed leader, thawed, orders nothing and exits
            lead.thaw()
            assert lead.proc is not None
            lead.proc.wait(DEADLINE_S)
            assert lead.proc.returncode == EXIT_LEADERSHIP_LOST, lead.log_text()[-4000:]
            assert _events(lead, "leadership_lost")
            assert p.call("term")[0] == d.call("term")[0] == _term(standby.address)
        assert p.call("writes_posted") == written + len(stages)  # one WRITE per transfer
        assert d.check([20, 21], seed=50) == []  # ha-written: not written again
        used = {20, 21} | {b for _, dst, _ in stages.values() for b in dst}
        assert d.call("check_canary", [b for b in range(NB) if b not in used], CANARY) == []
        assert p.call("held") == d.call("held") == []
        if relay is not None:  # the agents reached the new leader through the relay
            opened = _events(standby, "node_channel_opened")
            assert {(e["engine_id"], e["rank"]) for e in opened} == {("P", "0"), ("D", "0")}
    finally:
        client.close()
        p.stop()
        d.stop()
        if relay is not None:
            relay.stop()


# ---------------------------------------------------------------- helpers


def _submit(client: CoordinatorClient, call: Call) -> None:
    client.submit(call)
    res = client.wait_result(lambda r: r.call.request_id == call.request_id, DEADLINE_S)
    assert res is not None and res.ok, res


def _events(replica: CoordinatorProcess, name: str) -> list[dict[str, str]]:
    out = []
    for line in replica.log_text().splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("event") == name:
                out.append({k: str(v) for k, v in doc.items()})
    return out


def _event(replica: CoordinatorProcess, name: str) -> dict[str, str]:
    found = _events(replica, name)
    if not found:
        raise AssertionError(f"no {name} in the log of {replica.address}")
    return found[0]


def rebuilding_hosts(dial: str) -> tuple[KVHost, KVHost]:
    """Prefill P and decode D (not started) whose agents dial `dial` and
    rebuild on a failover, as the connector's default."""
    spec = HostSpec(dial, "P", "prefill", num_blocks=NB, give_up_s=REBUILD_GIVE_UP_S, rebuild=True)
    return KVHost(spec), KVHost(dataclasses.replace(spec, engine_id="D", role="decode"))


def _term(address: str) -> int:
    """The leadership term a replica reports (it must answer)."""
    view = leadership(address)
    assert view is not None, f"no leadership view from {address}"
    return view.term


def _ready_at(address: str) -> bool:
    """Whether both engines' agents are registered and connected at `address`."""
    with grpc.insecure_channel(address) as ch:
        try:
            engines = pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest(), timeout=2)
        except grpc.RpcError:
            return False
    # Connected too: an engine stays ready while a rank is within its reconnect grace.
    ready = (e for e in engines.engines if e.ready and all(r.connected for r in e.ranks))
    return sorted(e.engine_id for e in ready) == ["D", "P"]


def _wait_ready(address: str) -> None:
    poll(lambda: _ready_at(address), f"P and D ready at {address}")


def _register_and_done(
    client: CoordinatorClient, p: KVHost, tid: str, dst: list[int], src: list[int]
) -> None:
    """The scheduler halves' calls, through the client given both addresses."""
    client.submit(Call("register", tid + "-d", tid, "D", block_groups.of(dst), 20))
    p.call("hold", [tid])  # as the connector's worker half does
    client.submit(Call("prefill_done", tid + "-p", tid, "P", block_groups.of(src), 20))
    for kind in ("register", "prefill_done"):

        def match(r: Result, k: str = kind) -> bool:
            return r.call.transfer_id == tid and r.call.kind == k

        res = client.wait_result(match, DEADLINE_S)
        assert res is not None and res.ok, res


def _transfer(
    client: CoordinatorClient, leader: str, p: KVHost, d: KVHost, tid: str, seed: int
) -> None:
    """A fresh transfer through the leader, bytes verified."""
    p.fill([9, 10], seed=seed)
    d.call("expect", [tid])
    _register_and_done(client, p, tid, [20, 21], [9, 10])
    assert d.wait_event(tid, DEADLINE_S).kind is EventKind.KV_READY
    assert d.check([20, 21], seed=seed) == []
    assert p.wait_event(tid, DEADLINE_S).kind is EventKind.BLOCKS_FREE
    with grpc.insecure_channel(leader) as ch:
        t = wait_state(pbg.StatusServiceStub(ch), tid, pb.TRANSFER_STATE_COMPLETE, DEADLINE_S)
    assert t.state == pb.TRANSFER_STATE_COMPLETE
