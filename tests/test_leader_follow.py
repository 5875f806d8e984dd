"""Where clients go among coordinator replicas (pushkv/net/leader.py), and the
coordinator's leadership gate (controlplane/leadership.py): no network."""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest

from pushkv.controlplane.leadership import (
    ElectionSettings,
    Leadership,
    NotLeader,
    Role,
    View,
    endpoints,
)
from pushkv.controlplane.status_map import outcome
from pushkv.net.leader import (
    LEADER_METADATA_KEY,
    STANDBY_RETRY_CAP_S,
    STANDBY_WAIT_S,
    LeaderFollower,
    addresses,
    go_to,
    leader_hint,
)


class Refusal(Exception):
    """Stands in for a grpc.RpcError with trailing metadata."""

    def __init__(self, leader: str) -> None:
        super().__init__("standby")
        self._md = ((LEADER_METADATA_KEY, leader),)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md


def test_addresses_are_split_trimmed_and_deduplicated() -> None:
    assert addresses(" a:1, b:2 ,a:1,,") == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        addresses(" , ")


def test_one_address_never_moves() -> None:
    f = LeaderFollower("a:1")
    assert not f.several
    assert f.follow(Refusal("b:2")) is False
    assert f.follow(None) is False
    assert f.current == "a:1" and f.moves == 0


def test_a_refusal_naming_the_leader_moves_there_else_round_robin() -> None:
    f = LeaderFollower("a:1,b:2,c:3")
    assert f.follow(Refusal("c:3")) is True and f.current == "c:3"
    assert f.follow(None) is False and f.current == "a:1"  # unreachable: next in turn
    assert f.follow(Refusal("a:1")) is False and f.current == "b:2"  # names itself: move on
    # No leader yet, just after a failure: an election is under way, stay.
    assert f.follow(Refusal("")) is False and f.current == "b:2"
    assert f.follow(Refusal("d:4")) is True and f.current == "d:4"  # one not listed
    assert f.addresses == ["a:1", "b:2", "c:3", "d:4"]


def test_a_standby_naming_the_leader_that_just_failed_is_where_to_wait() -> None:
    """The leader is dead; the standby names it until its lease expires, then
    none while it campaigns. The follower stays on that live standby, its
    backoff capped short (it may lead any moment), for STANDBY_WAIT_S after
    the failure; then it tries the named leader again (the failure may have
    been a blip), never at once. Once an address answered, a named leader is
    "at once" again."""
    now = [100.0]
    f = LeaderFollower("a:1,b:2", clock=lambda: now[0])
    assert f.retry_cap(2.0) == 2.0
    assert f.follow(None) is False and f.current == "b:2"  # a:1 does not answer
    while now[0] < 100.0 + STANDBY_WAIT_S - 0.5:
        assert f.follow(Refusal("a:1")) is False and f.current == "b:2"  # stays
        assert f.retry_cap(2.0) == STANDBY_RETRY_CAP_S
        assert f.follow(Refusal("")) is False and f.current == "b:2"  # electing: stays
        now[0] += 0.5
    assert all(f.delay(n, cap_s=2.0) <= 1.5 * STANDBY_RETRY_CAP_S for n in range(12))
    now[0] += 0.5  # still named after the wait: back to a:1, with the usual backoff
    assert f.follow(Refusal("a:1")) is False and f.current == "a:1"
    assert f.retry_cap(2.0) == 2.0
    assert f.follow(None) is False and f.current == "b:2"  # a:1 still does not answer
    assert f.follow(Refusal("a:1")) is False and f.current == "b:2"  # waits again
    f.reached()  # b:2 answered: it leads now
    assert f.retry_cap(2.0) == 2.0
    assert f.follow(Refusal("a:1")) is True and f.current == "a:1"  # nothing failed since
    # No failure before (a fresh client): a standby that knows no leader is
    # left in turn, as before.
    g = LeaderFollower("a:1,b:2")
    assert g.follow(Refusal("")) is False and g.current == "b:2"


def test_a_silent_streams_client_goes_to_a_leader_named_elsewhere_newer_once_answered() -> None:
    # Named elsewhere, on a stream not answered yet: go, whatever the term.
    assert go_to("b:2", 0, dialed="a:1", answered=False, term=7) == "b:2"
    # None named, or the one dialed (slow, not gone): stay.
    assert go_to("", 9, dialed="a:1", answered=False, term=0) == ""
    assert go_to("a:1", 9, dialed="a:1", answered=True, term=3) == ""
    # On an answered stream: only for a newer term than the one followed.
    assert go_to("b:2", 3, dialed="a:1", answered=True, term=3) == ""
    assert go_to("b:2", 2, dialed="a:1", answered=True, term=3) == ""
    assert go_to("b:2", 4, dialed="a:1", answered=True, term=3) == "b:2"


def test_leader_hint_reads_trailing_metadata_only() -> None:
    assert leader_hint(Refusal("x:9")) == "x:9"
    assert leader_hint(RuntimeError("no metadata")) == ""


def test_backoff_is_jittered_exponential_and_capped() -> None:
    f = LeaderFollower("a:1,b:2", rng=random.Random(7))
    delays = [f.delay(n, base_s=0.05, cap_s=1.0) for n in range(10)]
    assert all(0.025 <= d <= 1.5 for d in delays)
    assert len({round(d, 6) for d in delays}) == len(delays)  # spread, not in lockstep
    assert max(delays[6:]) <= 1.5 and min(delays[6:]) >= 0.5  # the cap, jittered


def test_the_gate_refuses_writes_on_a_standby_only() -> None:
    gate = Leadership(View(Role.STANDBY, "lead:1", 42))
    with pytest.raises(NotLeader) as exc:
        gate.check_write("/pushkv.v1.TransferService/BeginTransfer")
    assert exc.value.leader == "lead:1" and "term 42" in str(exc.value)
    with pytest.raises(NotLeader):
        gate.check_write("/pushkv.v1.AgentService/AgentStream")
    gate.check_write("/pushkv.v1.StatusService/ListEngines")  # reads pass
    assert outcome(exc.value, "x") == (grpc.StatusCode.UNAVAILABLE, str(exc.value))
    assert not gate.may_order()


def test_a_leader_may_order_only_until_its_deadline() -> None:
    single = Leadership()
    assert single.may_order() and single.view.role is Role.SINGLE
    gate = Leadership(View(Role.STANDBY))
    seen: list[View] = []
    gate.on_change.append(seen.append)
    gate.update(View(Role.LEADER, "me:1", 7), order_deadline=float("inf"))
    assert gate.may_order() and seen[-1].role is Role.LEADER
    gate.update(View(Role.LEADER, "me:1", 7), order_deadline=0.0)  # lease too old
    assert not gate.may_order()
    gate.extend(float("inf"))  # renewed
    assert gate.may_order()


def test_election_settings_validate() -> None:
    assert endpoints("http://h:1,h2") == [("h", 1), ("h2", 2379)]
    assert endpoints("https://h:1") == [("h", 1)]
    with pytest.raises(ValueError, match="expected http"):
        endpoints("grpc://h:1")
    ok = ElectionSettings(etcd="https://h:1", advertise="h:1", tls_ca="ca.pem")
    assert ok.tls_cert == ""  # a CA alone: etcd without client certificates
    bad_settings: list[tuple[dict[str, Any], str]] = [
        ({"etcd": "https://h:1"}, "need --etcd-ca"),
        ({"etcd": "http://h:1", "tls_ca": "ca.pem"}, "need https://"),
        ({"etcd": "https://h:1,http://h:2", "tls_ca": "ca.pem"}, "mix http:// and https://"),
        ({"etcd": "https://h:1", "tls_ca": "ca.pem", "tls_cert": "c.pem"}, "go together"),
        ({"etcd": "http://h:1", "user": "pushkv"}, "--etcd-password-file go together"),
        ({"etcd": "http://h:1", "password_file": "pw"}, "--etcd-password-file go together"),
        ({"etcd": "http://h:1", "loop_stall_limit_s": 0}, "loop_stall_limit_s must be > 0"),
    ]
    for bad, why in bad_settings:
        with pytest.raises(ValueError, match=why):
            ElectionSettings(advertise="h:1", **bad)
    with pytest.raises(ValueError):
        ElectionSettings(etcd="http://h:1", advertise="nohost")
    with pytest.raises(ValueError):
        ElectionSettings(etcd="http://h:1", advertise="h:1", lease_s=0)


def test_leadership_metrics() -> None:
    from pushkv.controlplane.metrics import LeadershipCollector

    gate = Leadership(View(Role.STANDBY, "lead:1", 9))
    leader, term = LeadershipCollector(gate).collect()
    assert [(s.labels, s.value) for s in leader.samples] == [({"role": "standby"}, 0.0)]
    assert [s.value for s in term.samples] == [9.0]
    gate.update(View(Role.LEADER, "me:1", 11), order_deadline=float("inf"))
    leader, term = LeadershipCollector(gate).collect()
    assert [(s.labels, s.value) for s in leader.samples] == [({"role": "leader"}, 1.0)]
    assert [s.value for s in term.samples] == [11.0]
