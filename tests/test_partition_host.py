"""Partition processes (controlplane/partition_host.py, step 2 of the
partitioned leader): real child processes on real Unix sockets, driven as
the leader's front would drive them (pushkv/bench/partition_procs.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from pushkv.bench.coordinator_workload import CORE_SETTINGS
from pushkv.bench.partition_procs import run_procs
from pushkv.controlplane.partition_host import partition_runtime
from pushkv.controlplane.partition_link import PartitionProcess
from pushkv.controlplane.settings import CoreSettings
from pushkv.net.frames import read_frames
from pushkv.v1 import partition_pb2 as ppb
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import waits

DEADLINE_S = 60.0


def test_rendezvous_through_two_partition_processes_complete_each_in_its_partition() -> None:
    """TP-2 rendezvous through the front over two partition processes, one
    relay carrying the four ranks: each rank is welcomed once (both
    partitions welcome it; the front passes partition 0's); every transfer's
    orders come from its own partition (crc32 of its id), once per prefill
    rank, named by that partition and stamped with the replica's term; every
    transfer ends COMPLETE; both processes exit 0 once the front hangs up."""
    run = asyncio.run(run_procs(2, 64, 2, 16, term=3))
    assert run.welcomes == 2 * 2  # 4 ranks, each welcomed once
    assert run.states == {"TRANSFER_STATE_COMPLETE": 64}, run.states
    assert run.misrouted == 0 and run.repeated == 0
    assert run.order_terms == {3}


def test_one_partition_process_takes_every_transfer() -> None:
    run = asyncio.run(run_procs(1, 32, 1, 8))
    assert run.states == {"TRANSFER_STATE_COMPLETE": 32}
    assert run.misrouted == 0 and run.repeated == 0 and run.order_terms == {0}


def test_a_partition_takes_its_share_of_the_limits_and_its_index_in_order_ids() -> None:
    rt = partition_runtime(CoreSettings(max_inflight=10, max_terminal=7), 1, 4, 5, "c")
    core = rt.core
    assert core.settings.max_inflight == 3 and core.settings.max_terminal == 2
    assert core.settings.partitions == 1 and rt.term == 5
    assert core.coordinator_id == "c"
    with pytest.raises(ValueError, match="partition 4 of 4"):
        partition_runtime(CoreSettings(), 4, 4, 0, "c")


async def _second_connection_refused() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = await PartitionProcess.start(
            d, 0, 1, term=0, coordinator_id="c", settings=CoreSettings(**CORE_SETTINGS)
        )
        try:
            reader, writer = await asyncio.open_unix_connection(os.path.join(d, "partition-0.sock"))
            got = await asyncio.wait_for(reader.read(), DEADLINE_S)  # EOF: closed at once
            writer.close()
            # The first connection still works: a hello is welcomed.
            from pushkv.bench.coordinator_workload import agent_hello

            hello = agent_hello("e", pb.ROLE_DECODE, batched=True)
            up = ppb.PartitionUp()
            up.node.items.add(channel=1, message=pb.AgentMessage(hello=hello))
            p.send(up)
            downs = p.downs()
            first = await asyncio.wait_for(anext(downs), DEADLINE_S)
            assert first.node.takes_submit
            down = await asyncio.wait_for(anext(downs), DEADLINE_S)
            item = down.node.items[0]
            assert item.channel == 1 and item.message.HasField("welcome")
        finally:
            assert await p.close() == 0
        return got


def test_a_partition_serves_its_first_connection_only() -> None:
    assert asyncio.run(_second_connection_refused()) == b""


# A replica that starts a partition process and never connects to it: the
# partition would listen for ever but for PR_SET_PDEATHSIG.
REPLICA = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pushkv.controlplane.partition_host import READY

    sock = os.path.join(sys.argv[1], "p.sock")
    child = subprocess.Popen(
        [sys.executable, "-m", "pushkv.controlplane.partition_host", "--socket", sock,
         "--index", "0", "--partitions", "1", "--coordinator-id", "c",
         "--parent", str(os.getpid())],
        stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline() == READY
    print(child.pid, flush=True)
    time.sleep(3600)  # until killed
    """
)


def test_a_partition_process_dies_with_its_replica(tmp_path: Path) -> None:
    """kill -9 of the replica: the kernel kills its partition, which was
    waiting for a connection (PR_SET_PDEATHSIG), so no partition outlives the
    term that fences its orders."""
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert replica.stdout is not None
        lines = waits.Lines(replica.stdout)
        pid = int(lines.until("\n", DEADLINE_S).strip())
        assert not waits.process_gone(pid)
        replica.send_signal(signal.SIGKILL)
        replica.wait(DEADLINE_S)
        waits.poll("the partition process gone", lambda: waits.process_gone(pid), DEADLINE_S)
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait(DEADLINE_S)


async def _frames_of(data: bytes) -> list[list[bytes]]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return [got async for got in read_frames(reader)]


def test_frames_past_the_bound_are_refused() -> None:
    from pushkv.net.frames import HEADER, MAX_FRAME, FrameError, frame

    assert asyncio.run(_frames_of(frame(b"ab") + frame(b""))) == [[b"ab", b""]]
    with pytest.raises(FrameError):
        asyncio.run(_frames_of(HEADER.pack(MAX_FRAME + 1) + b"x"))
    with pytest.raises(FrameError):
        frame(b"x" * (MAX_FRAME + 1))


def test_a_partition_keeps_only_its_own_held_transfers_of_a_hello() -> None:
    """The front sends every partition an agent's whole hello; each keeps the
    held transfers that hash to it (as the in-process split does), so that
    no transfer is adopted by two partitions."""
    from pushkv.bench.coordinator_workload import agent_hello
    from pushkv.controlplane.partition_host import keep_own_held
    from pushkv.controlplane.partitions import partition_of

    ids = [f"h{i}" for i in range(12)]
    hello = agent_hello("e", pb.ROLE_DECODE, batched=True)
    hello.held.extend(pb.HeldTransfer(transfer_id=t, ready=True) for t in ids)
    up = pb.NodeUp()
    up.items.add(channel=1, message=pb.AgentMessage(hello=hello))
    up.items.add(channel=2, message=pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1)))
    kept = []
    for i in range(3):
        mine = pb.NodeUp()
        mine.CopyFrom(up)
        keep_own_held(mine, i, 3)
        got = [h.transfer_id for h in mine.items[0].message.hello.held]
        assert got == [t for t in ids if partition_of(t, 3) == i]
        assert all(h.ready for h in mine.items[0].message.hello.held)
        kept += got
    assert sorted(kept) == sorted(ids) and len(set(kept)) == len(ids)
