"""Every grpcurl command in docs/operations.md runs against a real coordinator.

grpcurl itself is not installed here, so each command is parsed (the flags
the cookbook uses: -plaintext, -d, -max-time; verbs list, describe, or a
method) and executed through pushkv/tools/reflection.py, which, like
grpcurl, knows nothing but what server reflection tells it. The coordinator
holds transfers named like the ones the cookbook uses.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pushkv.tools import reflection as rc
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg
from tests.support.sim_agent import SimCluster, ThreadedCoordinator, rendezvous

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
DOC_ADDRESS = "localhost:50151"
STREAM_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Command:
    line: str
    data: str | None
    max_time: float | None
    verb: str  # "list", "describe" or "call"
    target: str  # service / symbol / method ("" for a bare list)


def parse(line: str) -> Command:
    words = shlex.split(line)
    if "|" in words:  # `... | jq ...`: only grpcurl's part runs here
        words = words[: words.index("|")]
    assert words[0] == "grpcurl", line
    data: str | None = None
    max_time: float | None = None
    plaintext = False
    rest: list[str] = []
    it = iter(words[1:])
    for w in it:
        if w == "-plaintext":
            plaintext = True
        elif w == "-d":
            data = next(it)
        elif w == "-max-time":
            max_time = float(next(it))
        elif w.startswith("-"):
            raise AssertionError(f"cookbook uses a flag this test does not know: {w} ({line})")
        else:
            rest.append(w)
    assert plaintext, f"cookbook commands run against a plaintext coordinator: {line}"
    assert rest and rest[0] == DOC_ADDRESS, f"address must be {DOC_ADDRESS}: {line}"
    if rest[1:2] == ["list"]:
        return Command(line, data, max_time, "list", rest[2] if len(rest) > 2 else "")
    if rest[1:2] == ["describe"]:
        assert len(rest) == 3, line
        return Command(line, data, max_time, "describe", rest[2])
    assert len(rest) == 2, f"expected ADDRESS METHOD: {line}"
    return Command(line, data, max_time, "call", rest[1])


def cookbook_lines(text: str) -> list[str]:
    """grpcurl command lines of the ```bash blocks (continuations joined)."""
    lines: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        joined = block.replace("\\\n", " ")
        lines += [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("grpcurl ")]
    return lines


COMMANDS = [parse(line) for line in cookbook_lines(DOC.read_text())]


def execute(cmd: Command, channel: grpc.Channel) -> str:
    r = rc.Reflector(channel)
    if cmd.verb == "list":
        if not cmd.target:
            return "\n".join(r.services())
        return "\n".join(m.full_name for m in r.service(cmd.target).methods)
    if cmd.verb == "describe":
        return r.describe(cmd.target)
    method = r.method(cmd.target)
    if method.server_streaming:
        # grpcurl streams until the server ends or -max-time; here: the first message.
        return r.call_json(
            cmd.target,
            cmd.data or "{}",
            timeout=cmd.max_time or STREAM_TIMEOUT_S,
            max_messages=1,
        )
    return r.call_json(cmd.target, cmd.data or "{}", timeout=cmd.max_time or 10.0)


# ---------------------------------------------------------------- the coordinator


async def _populate(address: str, cluster: SimCluster) -> None:
    """tx-0001 complete, tx-0002 stuck in REGISTERED, tx-0003 failed (mismatch)."""
    await cluster.start()
    async with grpc.aio.insecure_channel(address) as ch:
        await rendezvous(ch, "tx-0001", prefill_engine="prefill-0", decode_engine="decode-0")
        stub = pbg.TransferServiceStub(ch)
        await stub.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="tx-0002",
                decode_engine_id="decode-0",
                block_ids=[pb.BlockIds(ids=[20, 21])],
                num_tokens=20,
            )
        )
        await stub.RegisterDecodeBlocks(
            pb.RegisterDecodeBlocksRequest(
                transfer_id="tx-0003",
                decode_engine_id="decode-0",
                block_ids=[pb.BlockIds(ids=[30, 31, 32])],
                num_tokens=41,
            )
        )
        failed = await stub.ReportPrefillDone(
            pb.ReportPrefillDoneRequest(
                transfer_id="tx-0003",
                prefill_engine_id="prefill-0",
                block_ids=[pb.BlockIds(ids=[1, 2, 3])],
                num_tokens=40,
            )
        )
        assert failed.state == pb.TRANSFER_STATE_FAILED and failed.reason == pb.REASON_MISMATCH
        watch = pbg.StatusServiceStub(ch).WatchTransfers(
            pb.WatchTransfersRequest(states=[pb.TRANSFER_STATE_COMPLETE], include_existing=True),
            timeout=STREAM_TIMEOUT_S,
        )
        event = await watch.read()
        watch.cancel()
        assert isinstance(event, pb.TransferEvent) and event.transfer.transfer_id == "tx-0001"


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedCoordinator]:
    with ThreadedCoordinator() as tc:
        cluster = SimCluster(
            tc.address, prefill_engine="prefill-0", decode_engine="decode-0", auto_complete=True
        )
        tc.run(_populate(tc.address, cluster))
        yield tc
        tc.run(cluster.close())


@pytest.fixture(scope="module")
def channel(server: ThreadedCoordinator) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


# ---------------------------------------------------------------- tests


def test_the_cookbook_covers_the_status_api() -> None:
    targets = {c.target for c in COMMANDS}
    for needed in (
        "grpc.health.v1.Health/Check",
        "pushkv.v1.StatusService/ListTransfers",
        "pushkv.v1.StatusService/GetTransfer",
        "pushkv.v1.StatusService/WatchTransfers",
        "pushkv.v1.StatusService/ListEngines",
    ):
        assert needed in targets, f"the cookbook lacks {needed}"
    assert {"list", "describe", "call"} <= {c.verb for c in COMMANDS}


def test_every_cookbook_command_succeeds(channel: grpc.Channel) -> None:
    """In document order, as an operator would paste them."""
    for cmd in COMMANDS:
        try:
            out = execute(cmd, channel)
        except Exception as exc:  # report which line broke
            raise AssertionError(f"{cmd.line}\n  failed: {exc!r}") from exc
        assert out.strip(), f"{cmd.line}\n  printed nothing"
        if cmd.verb == "call":
            docs = [json.loads(doc) for doc in _documents(out)]
            check(cmd, docs)


def _documents(out: str) -> list[str]:
    """Split grpcurl-style output (pretty JSON documents one after another)."""
    decoder = json.JSONDecoder()
    docs, i = [], 0
    while i < len(out):
        while i < len(out) and out[i].isspace():
            i += 1
        if i >= len(out):
            break
        obj, end = decoder.raw_decode(out, i)
        docs.append(json.dumps(obj))
        i = end
    return docs


def check(cmd: Command, docs: list[dict[str, object]]) -> None:
    """What each kind of call must show against the populated coordinator."""
    assert docs, cmd.line
    first = docs[0]
    method = cmd.target.rsplit("/", 1)[1]
    request = json.loads(cmd.data or "{}")
    if method == "Check":
        assert first == {"status": "SERVING"}, cmd.line
    elif method == "ListTransfers":
        transfers = first.get("transfers", [])
        assert isinstance(transfers, list)
        states = set(request.get("states", []))
        assert all(not states or t["state"] in states for t in transfers), cmd.line
        if not states:
            ids = {t["transferId"] for t in transfers}
            assert {"tx-0001", "tx-0003"} <= ids, cmd.line
    elif method == "GetTransfer":
        assert first["transferId"] == request["transfer_id"], cmd.line
        assert first["timeline"], cmd.line
    elif method == "WatchTransfers":
        transfer = first["transfer"]
        assert isinstance(transfer, dict)
        assert not request.get("states") or transfer["state"] in request["states"], cmd.line
    elif method == "ListEngines":
        engines = first["engines"]
        assert isinstance(engines, list) and engines, cmd.line
        if request.get("role"):
            assert all(e["role"] == request["role"] for e in engines), cmd.line
    elif method == "Cancel":
        assert first["state"] == "TRANSFER_STATE_CANCELLED", cmd.line
        assert first["detail"] == request["reason"], cmd.line


def test_parser_rejects_what_it_cannot_run() -> None:
    with pytest.raises(AssertionError):
        parse("grpcurl -insecure localhost:50151 list")
    with pytest.raises(AssertionError):
        parse("grpcurl -plaintext other:1 list")
    cmd = parse(
        "grpcurl -plaintext -d '{\"limit\": 1}' localhost:50151 "
        "pushkv.v1.StatusService/ListTransfers | jq ."
    )
    assert (cmd.verb, cmd.target, cmd.data) == (
        "call",
        "pushkv.v1.StatusService/ListTransfers",
        '{"limit": 1}',
    )
