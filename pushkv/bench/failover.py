"""``pushkv bench failover``: how long the replicas stay without a leader after a
``kill -9`` of the leading one (docs/reliability.md, "Replicated coordinators").

A real etcd (started here, ``pushkv/harness/etcd.py``, unless ``--etcd`` names one)
and ``--replicas`` real coordinator processes. Each round finds the leader,
kills it with SIGKILL and polls the others' GetLeadership every 5 ms until one
leads; the killed replica then comes back as a fresh standby. The last line:

    failover_s p50=<s> max=<s> rounds=<n> lease_s=<ttl> replicas=<n>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

from pushkv.harness.coordinator import CoordinatorProcess, leadership
from pushkv.harness.etcd import EtcdServer
from pushkv.v1 import pushkv_pb2 as pb

POLL_S = 0.005
DEADLINE_S = 30.0


def _leader(replicas: Sequence[CoordinatorProcess]) -> CoordinatorProcess:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for r in replicas:
            v = leadership(r.address, timeout=1)
            if v is not None and v.role == pb.LEADER_ROLE_LEADER:
                return r
        time.sleep(POLL_S)
    raise TimeoutError(f"no leader within {DEADLINE_S} s")


def _standbys_ready(replicas: Sequence[CoordinatorProcess], leader: str) -> None:
    """Every replica names `leader` (each holds its lease and polls the key)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if all(
            (v := leadership(r.address, timeout=1)) is not None and v.leader == leader
            for r in replicas
        ):
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"replicas did not agree on {leader} within {DEADLINE_S} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv bench failover", description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--lease-s", type=int, default=1, help="the replicas' --etcd-lease-s")
    ap.add_argument("--etcd", default="", help="an etcd to use (default: start one here)")
    args = ap.parse_args(argv)
    if args.replicas < 2 or args.rounds < 1:
        ap.error("needs --replicas >= 2 and --rounds >= 1")
    server = None if args.etcd else EtcdServer().start()
    url = args.etcd or (server.url if server else "")
    flags = ("--etcd", url, "--etcd-lease-s", str(args.lease_s), "--log-level", "WARNING")
    replicas = [CoordinatorProcess(*flags).start() for _ in range(args.replicas)]
    took: list[float] = []
    try:
        for n in range(args.rounds):
            lead = _leader(replicas)
            _standbys_ready(replicas, lead.address)
            others = [r for r in replicas if r is not lead]
            lead.kill()
            start = time.monotonic()
            new = _leader(others)
            took.append(time.monotonic() - start)
            print(f"round {n + 1}: {lead.address} killed, {new.address} led after {took[-1]:.3f} s")
            replicas[replicas.index(lead)] = CoordinatorProcess(*flags).start()
    finally:
        for r in replicas:
            r.stop()
        if server is not None:
            server.stop()
    print(
        f"failover_s p50={statistics.median(took):.3f} max={max(took):.3f} "
        f"rounds={len(took)} lease_s={args.lease_s} replicas={args.replicas}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
