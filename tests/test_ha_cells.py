"""Coordinator cells on one etcd (docs/operations.md, "Coordinator cells").

Two cells, each two real coordinator replicas campaigning on its own election
key (`--cell a`, `--cell b`) on one real etcd, each with its own engines: a
prefill and a decode KV host process whose real agents (NIXL) are given only
their cell's replicas. A kill -9 of cell A's leader fails over within cell A
and touches nothing of cell B. Waits are polls under deadlines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.cli import main as cli
from pushkv.controlplane.leadership import DEFAULT_KEY, election_key
from pushkv.controlplane.server import ServerSettings, start
from pushkv.harness.coordinator import leadership
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.rules.block_groups import of
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient
from tests.support.etcd import EtcdServer, etcd  # noqa: F401  (the fixture)
from tests.support.kvpair import wait_state
from tests.test_ha import DEADLINE_S, NB, Cluster, _events, _submit, poll, running_replicas

# ---------------------------------------------------------------- the name


def test_a_cell_names_its_own_election_key() -> None:
    assert election_key() == DEFAULT_KEY == "/pushkv/coordinator/leader"
    assert election_key("a") == "/pushkv/cells/a/leader"
    assert election_key("eu-west-2") == "/pushkv/cells/eu-west-2/leader"
    assert election_key("x" * 63) == f"/pushkv/cells/{'x' * 63}/leader"


@pytest.mark.parametrize(
    "name", ["A", "a/b", "../b", "-a", "a-", "a_b", "a.b", "x" * 64, " a", "a\n"]
)
def test_a_cell_name_that_is_no_dns_label_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="a cell's name is a DNS label"):
        election_key(name)


async def test_a_cell_without_etcd_is_refused() -> None:
    with pytest.raises(ValueError, match="--cell names an election on etcd"):
        await start(ServerSettings(port=0, cell="a"))


def test_the_flag_refuses_a_bad_name_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["coordinator", "--cell", "Cell_A", "--etcd", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --cell: --cell 'Cell_A': a cell's name is a DNS label" in err, err


# ---------------------------------------------------------------- two cells, one etcd


@dataclass
class CellHosts:
    """A cell's engines: a prefill and a decode KV host given only its replicas."""

    name: str
    cluster: Cluster
    p: KVHost
    d: KVHost
    client: CoordinatorClient

    @property
    def prefill(self) -> str:
        return self.p.spec.engine_id

    @property
    def decode(self) -> str:
        return self.d.spec.engine_id

    def engines_at(self, address: str) -> list[str] | None:
        """The engines ready with every rank connected at `address` (None: no answer)."""
        with grpc.insecure_channel(address) as ch:
            try:
                engines = pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest(), timeout=2)
            except grpc.RpcError:
                return None
        return sorted(
            e.engine_id for e in engines.engines if e.ready and all(r.connected for r in e.ranks)
        )

    def wait_ready(self, address: str) -> None:
        want = sorted([self.prefill, self.decode])
        poll(lambda: self.engines_at(address) == want, f"cell {self.name}'s engines at {address}")

    def order(self, tid: str, src: list[int], dst: list[int], seed: int) -> None:
        """Both sides of a transfer, through the cell's scheduler client."""
        self.p.fill(src, seed=seed)
        self.d.call("expect", [tid])
        _submit(self.client, Call("register", tid + "-d", tid, self.decode, of(dst), 20))
        self.p.call("hold", [tid])  # as the connector's worker half does
        _submit(self.client, Call("prefill_done", tid + "-p", tid, self.prefill, of(src), 20))

    def landed(self, tid: str, dst: list[int], seed: int, leader: str) -> None:
        """The transfer complete: at the agents, in the bytes, at the leader."""
        assert self.d.wait_event(tid, DEADLINE_S).kind is EventKind.KV_READY, tid
        assert self.d.check(dst, seed=seed) == [], tid
        freed = self.p.wait_event(tid, DEADLINE_S)
        assert (freed.kind, freed.detail) == (EventKind.BLOCKS_FREE, "done"), (tid, freed)
        with grpc.insecure_channel(leader) as ch:
            t = wait_state(pbg.StatusServiceStub(ch), tid, pb.TRANSFER_STATE_COMPLETE, DEADLINE_S)
        assert t.state == pb.TRANSFER_STATE_COMPLETE, (tid, t)


@contextlib.contextmanager
def cell_hosts(name: str, cluster: Cluster) -> Iterator[CellHosts]:
    """Engines P<name> and D<name>, their agents and scheduler client given the
    cell's replicas (the leader first), started once the cell has a leader."""
    lead = cluster.leader()
    dial = ",".join([lead.address, *(r.address for r in cluster.standbys())])
    spec = HostSpec(dial, f"P{name}", "prefill", num_blocks=NB, give_up_s=DEADLINE_S)
    p = KVHost(spec)
    d = KVHost(HostSpec(dial, f"D{name}", "decode", num_blocks=NB, give_up_s=DEADLINE_S))
    client = CoordinatorClient(dial, timeout_s=2.0)
    try:
        p.start()
        d.start()
        hosts = CellHosts(name, cluster, p, d, client)
        hosts.wait_ready(lead.address)
        yield hosts
    finally:
        client.close()
        p.stop()
        d.stop()


@pytest.mark.faults
def test_a_failover_in_one_cell_leaves_the_other_untouched(etcd: EtcdServer) -> None:  # noqa: F811
    """Cells A and B on one etcd, two replicas and two engines each. Each
    cell elects its own leader on its own key; each leader knows its own
    engines only. A kill -9 of A's leader: A's standby leads with a newer
    term and A's engines follow it; B's transfers in flight across the kill
    (one ordered with its WRITE held until A's failover is over, one whose
    prefill report is sent right after the kill) and one begun after it all
    complete with their bytes verified, one WRITE each, and nothing failed
    on B's engines; B's leader and term never change, and B's agents never
    leave their stream."""
    with running_replicas(etcd, "--cell", "a") as a, running_replicas(etcd, "--cell", "b") as b:
        lead_a, lead_b = a.leader(), b.leader()
        (standby_a,) = a.standbys()
        view_b = leadership(lead_b.address)
        assert view_b is not None and view_b.term > 0
        term_a = _leader_term(lead_a.address)
        assert term_a != view_b.term  # two elections on two keys, one etcd
        for cell, lead in (("a", lead_a), ("b", lead_b)):
            [won] = _events(lead, "leadership_won")
            assert won["key"] == f"/pushkv/cells/{cell}/leader", won
            [started] = _events(lead, "coordinator_started")
            assert started["cell"] == cell, started

        with cell_hosts("A", a) as ha, cell_hosts("B", b) as hb:
            # Each leader knows its own cell's engines, and only those.
            assert ha.engines_at(lead_a.address) == ["DA", "PA"]
            assert hb.engines_at(lead_b.address) == ["DB", "PB"]
            assert hb.p.call("term") == hb.d.call("term") == (view_b.term, 0)
            links_b = (hb.p.call("link"), hb.d.call("link"))

            ha.order("a-before", [1, 2], [20, 21], seed=60)
            ha.landed("a-before", [20, 21], seed=60, leader=lead_a.address)
            hb.order("b-before", [1, 2], [20, 21], seed=70)
            hb.landed("b-before", [20, 21], seed=70, leader=lead_b.address)

            # In flight in B across the kill: ordered, its WRITE held unposted.
            hb.p.call("pause", True)
            hb.order("b-held", [3, 4], [22, 23], seed=71)

            def unposted() -> bool:
                return any(h[0] == "b-held" and h[2] for h in hb.p.call("held"))

            poll(unposted, "b-held's order held unposted at PB")
            # Decode registered before the kill; the prefill report right after.
            hb.p.fill([5, 6], seed=72)
            hb.d.call("expect", ["b-late"])
            _submit(hb.client, Call("register", "b-late-d", "b-late", "DB", of((24, 25)), 20))

            lead_a.kill()
            hb.p.call("hold", ["b-late"])
            _submit(hb.client, Call("prefill_done", "b-late-p", "b-late", "PB", of((5, 6)), 20))

            # Cell A elects among its own replicas; its engines follow.
            assert a.leader() is standby_a
            assert _leader_term(standby_a.address) > term_a
            ha.wait_ready(standby_a.address)
            hb.p.call("pause", False)  # B's held WRITE goes out after A's failover
            hb.landed("b-held", [22, 23], seed=71, leader=lead_b.address)
            hb.landed("b-late", [24, 25], seed=72, leader=lead_b.address)
            hb.order("b-after", [7, 8], [26, 27], seed=73)
            hb.landed("b-after", [26, 27], seed=73, leader=lead_b.address)
            ha.order("a-after", [3, 4], [22, 23], seed=61)
            ha.landed("a-after", [22, 23], seed=61, leader=standby_a.address)

            # Cell B: the same leader and term on both replicas, the same
            # stream and term at its agents, one WRITE per transfer, nothing
            # failed or left held.
            assert lead_b.proc is not None and lead_b.proc.poll() is None
            assert b.leader() is lead_b
            for r in b.replicas:
                v = leadership(r.address)
                assert v is not None and (v.leader, v.term) == (view_b.leader, view_b.term)
            assert hb.p.call("term") == hb.d.call("term") == (view_b.term, 0)
            assert (hb.p.call("link"), hb.d.call("link")) == links_b
            assert hb.p.call("writes_posted") == 4
            assert hb.p.pending_events() == hb.d.pending_events() == []
            assert hb.p.call("held") == hb.d.call("held") == []
            assert _events(lead_b, "leadership_lost") == []
            # Each new leader knows its own engines only, after the failover too.
            assert ha.engines_at(standby_a.address) == ["DA", "PA"]
            assert hb.engines_at(lead_b.address) == ["DB", "PB"]


def _leader_term(address: str) -> int:
    """The term of a replica that leads (it must say so)."""
    view = leadership(address)
    assert view is not None and view.role == pb.LEADER_ROLE_LEADER, (address, view)
    return view.term
