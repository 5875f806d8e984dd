"""Certificates renewed on disk while everything runs (pushkv/net/tls.py).

cert-manager's CSI driver renews a pod's certificate in place: it writes the
new files to a new folder and swaps the volume's `..data` link to it in one
rename (Kubernetes' atomic writer), and `Volume` below does the same. Every
side runs for real, each certificate from pushkv's dev PKI: a coordinator
process, a prefill agent dialing it directly, a decode agent through a node relay
process, the connector's scheduler client of each engine (prefill's direct,
decode's through the relay), a router process, and `pushkv status`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from pushkv.agent.events import EventKind
from pushkv.cli.main import main as pushkv_main
from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.harness.kvhost import HostSpec, KVHost
from pushkv.harness.vllm_server import RouterProcess
from pushkv.net.tls import ChannelCache, TLSFiles
from pushkv.net.tls import channel as tls_channel
from pushkv.rules.block_groups import of
from pushkv.tools.devpki import make_pki
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from pushkv.vllm_integration.client import Call, CoordinatorClient, Result
from tests.support.waits import poll

WAIT_S = 60.0
IDENTITIES = ("coordinator", "router", "engine-P", "engine-D", "operator-ops")
HANDSHAKES = 16  # fresh handshakes after a renewal, each of which must get the new leaf


class Volume:
    """A certificate volume as cert-manager's CSI driver lays it out: ca.crt,
    tls.crt and tls.key link through `..data` to the current folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.generation = 0

    def publish(self, pki: Path, name: str) -> None:
        """The files of `name` in `pki`, swapped in at once."""
        self.generation += 1
        folder = self.root / f"..gen{self.generation}"
        folder.mkdir()
        shutil.copy(pki / "ca.pem", folder / "ca.crt")
        shutil.copy(pki / f"{name}.pem", folder / "tls.crt")
        shutil.copy(pki / f"{name}.key", folder / "tls.key")
        tmp = self.root / "..data_tmp"
        os.symlink(folder.name, tmp)
        os.replace(tmp, self.root / "..data")  # the one atomic step
        for f in ("ca.crt", "tls.crt", "tls.key"):
            if not (self.root / f).is_symlink():
                os.symlink(f"..data/{f}", self.root / f)

    @property
    def files(self) -> TLSFiles:
        return TLSFiles(*(str(self.root / f) for f in ("ca.crt", "tls.crt", "tls.key")))

    def flags(self) -> tuple[str, ...]:
        f = self.files
        return ("--tls-ca", f.ca, "--tls-cert", f.cert, "--tls-key", f.key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """g1: the first certificates; g2: every leaf renewed from g1's CA (what
    cert-manager does); g3: another CA altogether."""
    d = tmp_path_factory.mktemp("pki")
    make_pki(d / "g1", engines=["P", "D"])
    make_pki(d / "g2", engines=["P", "D"], ca_from=d / "g1")
    make_pki(d / "g3", engines=["P", "D"])
    return d


def leaf_files(pki: Path, name: str, root: Path) -> TLSFiles:
    """`name`'s files of `pki`, copied under `root` (plain files, rewritten in place)."""
    root.mkdir(parents=True, exist_ok=True)
    for src, dst in (("ca.pem", "ca.pem"), (f"{name}.pem", "tls.pem"), (f"{name}.key", "tls.key")):
        shutil.copy(pki / src, root / dst)
    return TLSFiles(str(root / "ca.pem"), str(root / "tls.pem"), str(root / "tls.key"))


def test_a_renewal_written_file_by_file_is_taken_once_whole(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool that writes the certificate, then the key (not cert-manager's
    atomic swap): in between, the pair does not match and the previous set
    stays in use; once the key is in place the renewed set is taken."""
    files = leaf_files(pki / "g1", "router", tmp_path)
    first = files.material()
    assert first.serial == serial(pki / "g1" / "router.pem")
    shutil.copy(pki / "g2" / "router.pem", files.cert)
    with caplog.at_level(logging.WARNING, "pushkv.tls"):
        assert files.material() == files.material() == first  # half renewed: kept
    (warning,) = caplog.records  # once, however often it is asked meanwhile
    assert "the key does not belong to the certificate" in warning.getMessage()
    shutil.copy(pki / "g2" / "router.key", files.key)
    renewed = files.material()
    assert (renewed.version, renewed.serial) == (2, serial(pki / "g2" / "router.pem"))
    Path(files.key).unlink()  # gone for a moment: kept
    assert files.material() == renewed
    shutil.copy(pki / "g2" / "router.key", files.key)
    os.utime(files.cert)  # rewritten with the same contents: the same set
    assert files.material() == renewed


def test_files_that_never_held_together_are_refused_naming_why(pki: Path, tmp_path: Path) -> None:
    files = leaf_files(pki / "g1", "router", tmp_path)
    shutil.copy(pki / "g2" / "router.key", files.key)
    with pytest.raises(ValueError, match="the key does not belong to the certificate"):
        files.material()
    Path(files.ca).write_text("not a certificate\n")
    with pytest.raises(ValueError, match="the CA file holds no PEM certificate"):
        files.material()
    with pytest.raises(ValueError, match="does not exist"):
        TLSFiles(files.ca, files.cert, str(tmp_path / "missing.key")).material()


def test_a_cached_channel_is_replaced_once_the_files_change(pki: Path, tmp_path: Path) -> None:
    files = leaf_files(pki / "g1", "router", tmp_path)
    made: list[str] = []
    retired: list[str] = []

    def make(address: str) -> grpc.Channel:
        made.append(address)
        return tls_channel(address, files)

    cache: ChannelCache[grpc.Channel] = ChannelCache(make, files, lambda c: retired.append("x"))
    first = cache.get("127.0.0.1:1")
    assert cache.get("127.0.0.1:1") is first and made == ["127.0.0.1:1"]
    shutil.copy(pki / "g2" / "router.pem", files.cert)
    shutil.copy(pki / "g2" / "router.key", files.key)
    second = cache.get("127.0.0.1:1")
    assert second is not first and cache.replaced == 1 and retired == ["x"]
    for ch in (first, *cache.take_all()):
        ch.close()


def test_dev_certs_renew_from_an_existing_ca(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    renewed = tmp_path / "renewed"
    assert pushkv_main(["dev-certs", str(renewed), "--ca-from", str(pki / "g1")]) == 0
    assert (renewed / "ca.pem").read_bytes() == (pki / "g1" / "ca.pem").read_bytes()
    old, new = (
        x509.load_pem_x509_certificate((d / "router.pem").read_bytes())
        for d in (pki / "g1", renewed)
    )
    assert new.issuer == old.issuer and new.serial_number != old.serial_number
    capsys.readouterr()
    assert pushkv_main(["dev-certs", str(tmp_path / "x"), "--ca-from", str(tmp_path)]) == 2
    assert f"--ca-from {tmp_path}: no ca.pem there" in capsys.readouterr().err


def serial(pem: Path) -> int:
    return x509.load_pem_x509_certificate(pem.read_bytes()).serial_number


def served_serial(port: int, client: TLSFiles) -> int:
    """The serial of the certificate the coordinator presents to a new connection."""
    ctx = ssl.create_default_context(cafile=client.ca)
    ctx.load_cert_chain(client.cert, client.key)
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@dataclass
class Cluster:
    volumes: dict[str, Volume]
    coord: CoordinatorProcess
    relay: RelayProcess
    p: KVHost
    d: KVHost
    p_client: CoordinatorClient  # the prefill scheduler's: to the coordinator, mutual TLS
    d_client: CoordinatorClient  # the decode scheduler's: through the relay
    router: RouterProcess

    @property
    def address(self) -> str:
        return f"localhost:{self.coord.port}"

    def publish(self, pki: Path) -> None:
        for name, v in self.volumes.items():
            v.publish(pki, name)

    def register(self, tid: str) -> None:
        self.d.call("expect", [tid])
        self.d_client.submit(Call("register", tid, tid, "D", of((1, 2)), 20))
        ok(self.d_client, tid)

    def prefill_done(self, tid: str, seed: int) -> None:
        self.p.fill([3, 4], seed=seed)
        self.p_client.submit(Call("prefill_done", tid, tid, "P", of((3, 4)), 20))
        ok(self.p_client, tid)
        assert self.d.wait_event(tid, timeout=WAIT_S).kind is EventKind.KV_READY
        assert self.d.check([1, 2], seed=seed) == []  # every byte arrived

    def status(self, capsys: pytest.CaptureFixture[str], *cmd: str) -> str:
        capsys.readouterr()
        flags = self.volumes["operator-ops"].flags()
        rc = pushkv_main(["status", "--coordinator", self.address, *flags, "--json", *cmd])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out


def ok(client: CoordinatorClient, tid: str) -> Result:
    r = client.wait_result(lambda r: r.call.transfer_id == tid, WAIT_S)
    assert r is not None, f"no answer for {tid}"
    assert r.ok, r
    return r


def router_view(router: RouterProcess) -> dict[str, Any]:
    """The router's /health answer: the pairs from its last engine list, and
    why its last refresh failed ("" when it did not)."""
    try:
        with urllib.request.urlopen(router.url + "/health", timeout=5) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:  # 503: no pair
        body = exc.read()
    view: dict[str, Any] = json.loads(body)
    return view


def router_pairs(router: RouterProcess) -> bool:
    """Whether the router's last refresh reached the coordinator and listed
    the P -> D pair."""
    view = router_view(router)
    return not view["error"] and view["pairs"] == [["P", "D"]]


@contextlib.contextmanager
def running(pki: Path, root: Path, *coordinator_flags: str) -> Iterator[Cluster]:
    """Everything started with g1's certificates, each from its volume under `root`."""
    volumes = {name: Volume(root / name) for name in IDENTITIES}
    for name, v in volumes.items():
        v.publish(pki / "g1", name)
    api = "http://127.0.0.1:9"  # listed by the router, never called here
    p_tls = volumes["engine-P"].files
    with contextlib.ExitStack() as stack:
        flags = (*coordinator_flags, "--log-level", "WARNING", *volumes["coordinator"].flags())
        coord = CoordinatorProcess(*flags)
        stack.callback(coord.stop)
        coord.start()
        address = f"localhost:{coord.port}"
        relay = RelayProcess(address, *volumes["engine-D"].flags())
        stack.callback(relay.stop)
        relay.start()
        p = KVHost(
            HostSpec(
                address, "P", "prefill", num_blocks=8, api_url=api,
                tls_ca=p_tls.ca, tls_cert=p_tls.cert, tls_key=p_tls.key,
            )
        )  # fmt: skip
        stack.callback(p.stop)
        p.start()
        d = KVHost(HostSpec(relay.address, "D", "decode", num_blocks=8, api_url=api))
        stack.callback(d.stop)
        d.start()
        p_client = CoordinatorClient(address, tls=p_tls)
        stack.callback(p_client.close)
        d_client = CoordinatorClient(relay.address)
        stack.callback(d_client.close)
        router = RouterProcess(address, flags=volumes["router"].flags())
        stack.callback(router.stop)
        router.start()
        yield Cluster(volumes, coord, relay, p, d, p_client, d_client, router)


def test_a_renewed_leaf_serves_new_connections_and_no_transfer_fails(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running(pki, tmp_path) as c:
        renewal(c, pki, capsys)


def renewal(c: Cluster, pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    operator = c.volumes["operator-ops"].files
    assert served_serial(c.coord.port, operator) == serial(pki / "g1" / "coordinator.pem")
    c.register("before")
    c.prefill_done("before", seed=1)
    c.register("across")  # its prefill side comes after the renewal

    c.publish(pki / "g2")  # every leaf renewed at once, same CA

    # Each new connection gets the renewed certificate.
    renewed = serial(pki / "g2" / "coordinator.pem")
    assert renewed != serial(pki / "g1" / "coordinator.pem")
    served = {served_serial(c.coord.port, operator) for _ in range(HANDSHAKES)}
    assert served == {renewed}
    # The transfer registered before it completes after it, the agents'
    # streams and the relay's untouched; the prefill client's next call went
    # on a new channel, made from the renewed files.
    c.prefill_done("across", seed=2)
    assert c.p_client.channels_replaced == 1
    c.register("after")
    c.prefill_done("after", seed=3)
    # Nothing failed: every transfer complete, as an operator's renewed
    # certificate reads it; the router still pairs the engines.
    listed = json.loads(c.status(capsys, "ls"))["transfers"]
    assert {t["transferId"]: t["state"] for t in listed} == {
        tid: "TRANSFER_STATE_COMPLETE" for tid in ("before", "across", "after")
    }
    assert router_pairs(c.router)
    for client in (c.p_client, c.d_client):
        assert [r for r in client.drain() if not r.ok] == []


def test_after_a_new_ca_every_client_reconnects_with_the_new_files(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CA itself replaced, then the coordinator restarted: every client
    must dial again, and only the new CA's certificates are accepted, so each
    reconnects with the files as they are now (a client that kept its first
    credentials, as every cached channel did, would be refused)."""
    with running(pki, tmp_path) as c:
        new_ca(c, pki, capsys)


def new_ca(c: Cluster, pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c.register("first")
    c.prefill_done("first", seed=4)

    c.publish(pki / "g3")
    # The live coordinator trusts only the new CA for new connections now.
    stale = TLSFiles(*(str(pki / "g1" / f) for f in ("ca.pem", "router.pem", "router.key")))
    own_pool = [("grpc.use_local_subchannel_pool", 1)]  # no connection shared with the clients'
    with (
        grpc.secure_channel(c.address, stale.channel_credentials(), own_pool) as ch,
        pytest.raises(grpc.RpcError) as refused,
    ):
        pbg.StatusServiceStub(ch).ListEngines(pb.ListEnginesRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    c.coord.stop()
    poll(
        "the router finds the coordinator gone",
        lambda: "unreachable" in router_view(c.router)["error"],
        WAIT_S,
    )
    c.coord.start()  # the same port: every connection to it is new
    # Both agents registered again (the decode one through the relay), and
    # the router reached it again: it pairs them.
    poll("the router pairs P and D again", lambda: router_pairs(c.router), WAIT_S)
    c.register("second")
    c.prefill_done("second", seed=5)
    engines = json.loads(c.status(capsys, "engines"))["engines"]
    assert sorted(e["engineId"] for e in engines) == ["D", "P"]
    assert c.p_client.channels_replaced == 1
