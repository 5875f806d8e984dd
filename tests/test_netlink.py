"""The emulated two-node link (pushkv/harness/netlink.py): a real transfer crosses it,
its rate cap is in force (tc's counters), and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pushkv.agent.events import EventKind
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.kvhost import HostSpec
from pushkv.harness.netlink import (
    LinkUnavailable,
    NetnsKVHost,
    TwoNodeLink,
    check_available,
    namespaces,
    parse_rate,
)
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

RATE = parse_rate("200mbit")  # slow enough that 2 MiB must wait for the bucket
NB, BLOCK_LEN, REGIONS = 64, 16 * 1024, 2


def _available() -> str:
    try:
        check_available()
    except LinkUnavailable as exc:
        return str(exc)
    return ""


needs_link = pytest.mark.skipif(bool(_available()), reason=_available() or "available")


def _leftovers(link: TwoNodeLink) -> list[str]:
    ns = [n for n in namespaces() if link.tag in n]
    devs = [d for d in os.listdir("/sys/class/net") if link.tag in d]
    return ns + devs


def _spec(addr: str, engine: str, role: str) -> HostSpec:
    return HostSpec(addr, engine, role, num_blocks=NB, block_len=BLOCK_LEN, num_regions=REGIONS)


@pytest.fixture
def link() -> Iterator[TwoNodeLink]:
    with TwoNodeLink(RATE) as lk:
        yield lk
    assert _leftovers(lk) == []


@needs_link
def test_kv_transfer_crosses_the_capped_link(link: TwoNodeLink, tmp_path: Path) -> None:
    coord = CoordinatorProcess(
        "--host",
        link.coordinator_host,
        "--lease-s",
        "5",
        "--log-level",
        "WARNING",
        log_path=str(tmp_path / "coord.log"),
    ).start()
    addr = f"{link.coordinator_host}:{coord.port}"
    p = NetnsKVHost(_spec(addr, "P", "prefill"), link, "a")
    d = NetnsKVHost(_spec(addr, "D", "decode"), link, "b")
    try:
        p.start()
        d.start()
        before = link.qdisc_stats("a")
        src, dst = list(range(NB)), list(reversed(range(NB)))
        d.call("canary", 0x5A)
        p.fill(src, seed=7)
        d.call("expect", ["n1"])
        req = pbg.TransferServiceStub(grpc.insecure_channel(addr))
        req.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="n1",
                decode_engine_id="D",
                block_ids=[pb.BlockIds(ids=dst)],
                num_tokens=NB * 16,
            ),
            timeout=10,
        )
        req.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id="n1",
                prefill_engine_id="P",
                block_ids=[pb.BlockIds(ids=src)],
                num_tokens=NB * 16,
            ),
            timeout=10,
        )
        assert d.wait_event("n1", timeout=30).kind is EventKind.KV_READY
        assert p.wait_event("n1", timeout=30).kind is EventKind.BLOCKS_FREE
        assert d.check(dst, seed=7) == []  # every byte, both regions
        after = link.qdisc_stats("a")
        payload = NB * BLOCK_LEN * REGIONS
        # The KV went through A's token bucket (bytes include TCP/IP headers) ...
        assert after.bytes - before.bytes >= payload
        # ... and the bucket held packets back: the cap was in force.
        assert after.overlimits > before.overlimits
    finally:
        for h in (p, d):
            h.stop()
        coord.stop()


@needs_link
def test_qdisc_has_the_configured_rate(link: TwoNodeLink) -> None:
    for name in ("a", "b"):
        s = link.side(name)
        out = subprocess.run(
            ["ip", "netns", "exec", s.netns, "tc", "qdisc", "show", "dev", s.kv_dev],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in out and "200Mbit" in out, out


@needs_link
def test_teardown_on_failure_leaves_nothing() -> None:
    lk = TwoNodeLink(RATE)
    with pytest.raises(RuntimeError, match="boom"), lk:
        assert len(_leftovers(lk)) >= 4  # two namespaces, two host ends
        raise RuntimeError("boom")
    assert _leftovers(lk) == []


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LinkUnavailable, match="needs root"):
        TwoNodeLink(RATE).open()
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LinkUnavailable, match="iproute2"):
        check_available()


def test_parse_rate() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5Gbit") == 2_500_000_000
    assert parse_rate("500mbit") == 500 * 10**6
    with pytest.raises(ValueError):
        parse_rate("fast")
