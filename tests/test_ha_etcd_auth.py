"""Coordinator replicas on an etcd whose authentication is on (`etcdctl auth
enable`): real etcd 3.4 and real replica processes (`pushkv coordinator
--etcd ... --etcd-user U --etcd-password-file F`).

A replica with the right user elects and fails over as without auth; one
whose password etcd refuses, or whose user may not write the election key,
stops with EXIT_ETCD_REFUSED and says why, instead of retrying for ever as a
standby that can never lead; a leader whose token etcd forgot (etcd restarted)
takes a new one and keeps leading."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess, leadership
from pushkv.harness.etcd import EtcdCluster
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.etcd import EtcdServer, etcd, require_etcd  # noqa: F401  (the fixture)
from tests.test_ha import REPLICA, etcd3, poll, running_replicas  # noqa: F401

pytestmark = pytest.mark.faults

EXIT_ETCD_REFUSED = 4
ELECTION_PREFIX = "/pushkv/"  # the election key: /pushkv/coordinator/leader


# etcd forgets a token unused this long (its --auth-token-ttl; 300 s by default).
TOKEN_TTL_S = 1


@pytest.fixture
def etcd_auth(tmp_path: Path) -> Iterator[tuple[EtcdServer, dict[str, str]]]:
    """etcd with auth on, and password files: `pushkv` may read and write under
    /pushkv/, `reader` may only read there, `wrong` holds a bad password."""
    require_etcd()
    server = EtcdServer(auth_token_ttl_s=TOKEN_TTL_S).start()
    try:
        server.enable_auth(
            "root-secret",
            {
                "pushkv": ("pushkv-secret", "READWRITE", ELECTION_PREFIX),
                "reader": ("reader-secret", "READ", ELECTION_PREFIX),
            },
        )
        files = {}
        for name, text in (
            ("pushkv", "pushkv-secret\n"),  # as a mounted secret often ends
            ("reader", "reader-secret"),
            ("wrong", "not-the-password"),
        ):
            files[name] = str(tmp_path / f"{name}.password")
            Path(files[name]).write_text(text)
        yield server, files
    finally:
        server.stop()


def auth(user: str, password_file: str) -> tuple[str, ...]:
    return ("--etcd-user", user, "--etcd-password-file", password_file)


def leads(replica: CoordinatorProcess) -> bool:
    v = leadership(replica.address)
    return v is not None and v.role == pb.LEADER_ROLE_LEADER


def wait_leads(replica: CoordinatorProcess, what: str) -> pb.Leadership:
    """Poll until `replica` leads; its GetLeadership answer then."""
    poll(lambda: leads(replica), what)
    view = leadership(replica.address)
    assert view is not None
    return view


def events(replica: CoordinatorProcess, name: str) -> list[dict[str, str]]:
    """The replica's log events called `name` (JSON lines)."""
    docs = [json.loads(line) for line in replica.log_text().splitlines() if line.startswith("{")]
    return [{k: str(v) for k, v in d.items()} for d in docs if d.get("event") == name]


def test_replicas_with_an_etcd_user_elect_and_fail_over(
    etcd_auth: tuple[EtcdServer, dict[str, str]],
) -> None:
    server, files = etcd_auth
    with running_replicas(server, *auth("pushkv", files["pushkv"])) as c:
        lead = c.leader()
        (standby,) = c.standbys()
        view = leadership(standby.address)
        assert view is not None and view.leader == lead.address
        lead.kill()
        wait_leads(standby, "the standby leads after the leader's kill -9")
        assert not events(standby, "etcd_refused")


@pytest.mark.parametrize(
    ("user", "why"),
    [
        ("wrong", "etcd refused the user or password"),
        ("reader", "etcd denies the user permission on the election key"),
    ],
)
def test_a_replica_etcd_refuses_stops_and_says_why(
    etcd_auth: tuple[EtcdServer, dict[str, str]], user: str, why: str
) -> None:
    server, files = etcd_auth
    name = "pushkv" if user == "wrong" else user  # `wrong`: pushkv's name, a bad password
    replica = CoordinatorProcess("--etcd", server.url, *auth(name, files[user]), *REPLICA)
    try:
        replica.start()
        assert replica.proc is not None
        assert replica.proc.wait(30) == EXIT_ETCD_REFUSED, replica.log_text()[-2000:]
        (refused,) = events(replica, "etcd_refused")
        assert refused["reason"].startswith(why), refused
        assert refused["endpoint"] == f"127.0.0.1:{server.client_port}"
    finally:
        replica.stop()


def test_a_leader_takes_a_new_token_when_etcd_forgot_its_own(
    etcd_auth: tuple[EtcdServer, dict[str, str]],
) -> None:
    """etcd forgets a token unused for TOKEN_TTL_S (its simple tokens), and then
    answers UNAUTHENTICATED. A leader with a 12 s lease checks its key every
    3 s, so its token lapses between two checks: it authenticates again on the
    same lease and keeps leading, with the same term, instead of stepping down.
    (A standby polls every 0.1 s: its token never lapses.)"""
    server, files = etcd_auth
    flags = ("--etcd", server.url, *auth("pushkv", files["pushkv"]), *REPLICA)
    replica = CoordinatorProcess(*flags, "--etcd-lease-s", "12").start()
    try:
        view = wait_leads(replica, "the replica leads")
        poll(lambda: len(events(replica, "etcd_token_renewed")) >= 2, "two new tokens taken")
        after = leadership(replica.address)
        assert after is not None and leads(replica) and after.term == view.term
        assert replica.proc is not None and replica.proc.poll() is None
        assert not events(replica, "leadership_lost")
        assert not events(replica, "etcd_keepalive_failed")
    finally:
        replica.stop()


def test_a_user_given_for_an_etcd_without_auth_leads_and_warns(
    etcd: EtcdServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    """etcd's authentication off (as etcd's Go client does): calls go without a
    token, the replica leads, and its log says the user was not used."""
    password = tmp_path / "password"
    password.write_text("unused")
    replica = CoordinatorProcess("--etcd", etcd.url, *auth("pushkv", str(password)), *REPLICA)
    try:
        replica.start()
        wait_leads(replica, "the replica leads")
        (warned, *_) = events(replica, "etcd_auth_not_enabled")
        assert warned["endpoint"] == f"127.0.0.1:{etcd.client_port}"
    finally:
        replica.stop()


def test_a_leader_renews_through_the_next_member_with_a_new_token(
    etcd3: EtcdCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Three members with auth on; the replicas dial `first`, then an address
    where no member answers, then the others. `first` killed: the leader moves
    on, its token for the dead address fails like any call there, and it takes
    a token from the next member that answers and keeps its term (a call
    without one would be refused for good)."""
    etcd3.members[0].enable_auth(
        "root-secret", {"pushkv": ("pushkv-secret", "READWRITE", ELECTION_PREFIX)}
    )
    raft = etcd3.raft_leader()
    first, last = [m for m in etcd3.members if m is not raft]
    password = tmp_path / "password"
    password.write_text("pushkv-secret")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    urls = ",".join([first.url, nobody, raft.url, last.url])
    flags = ("--etcd", urls, *auth("pushkv", str(password)), *REPLICA, "--etcd-lease-s", "4")
    replica = CoordinatorProcess(*flags).start()
    try:
        view = wait_leads(replica, "the replica leads")
        first.kill()
        poll(lambda: bool(events(replica, "etcd_keepalive_recovered")), "renewed elsewhere")
        switched = [e["endpoint"] for e in events(replica, "etcd_endpoint_switched")]
        assert nobody.removeprefix("http://") in switched, switched
        after = leadership(replica.address)
        assert after is not None and leads(replica) and after.term == view.term
        assert not events(replica, "etcd_refused") and not events(replica, "leadership_lost")
    finally:
        replica.stop()
