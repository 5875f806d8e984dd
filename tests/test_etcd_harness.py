"""The test etcd (pushkv/harness/etcd.py) starts again on new ports when another
process took one it picked: caused for real by listening on it first."""

from __future__ import annotations

import socket

from pushkv.harness.etcd import EtcdCluster, EtcdServer
from tests.support.etcd import require_etcd


def _occupy(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_member_whose_port_was_taken_starts_on_new_ports() -> None:
    require_etcd()
    server = EtcdServer()
    taken = server.client_port
    with _occupy(taken):
        try:
            server.start()
            assert server.client_port != taken and server.healthy()
        finally:
            server.stop()


def test_a_cluster_whose_peer_port_was_taken_starts_on_new_ports() -> None:
    require_etcd()
    cluster = EtcdCluster(3)
    taken = cluster.members[1].peer_port
    with _occupy(taken):
        try:
            cluster.start()
            assert taken not in [m.peer_port for m in cluster.members]
            assert all(m.healthy() for m in cluster.members)
            assert cluster.raft_leader() in cluster.members
        finally:
            cluster.stop()
