"""The replica's side of one partition process (controlplane/partition_host.py):
start it under the replica's term, wait for it to listen, hold its one
connection, and stop it.

Ownership: a `PartitionProcess` owns the child process and the connection.
`close()` ends the connection (the child then ends on its own), waits for
the child within a deadline and kills it past that; the child also dies with
its parent (PR_SET_PDEATHSIG), so a replica killed with -9 leaves none.
A front process (controlplane/front_host.py) holds a `PartitionConnection`
of its own to each partition, and owns only that.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

from pushkv.controlplane.partition_host import READY, settings_json
from pushkv.controlplane.settings import CoreSettings
from pushkv.net.child import Child
from pushkv.net.frames import frame, read_frames
from pushkv.v1 import partition_pb2 as ppb

START_S = 30.0  # a child imports the coordinator's modules first
STOP_S = 10.0


def partition_socket(socket_dir: str, index: int) -> str:
    """Partition `index`'s socket in the replica's directory."""
    return os.path.join(socket_dir, f"partition-{index}.sock")


class PartitionConnection:
    """One connection to a partition process: PartitionUp frames out,
    PartitionDown frames in."""

    def __init__(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.index = index
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, socket_dir: str, index: int) -> PartitionConnection:
        reader, writer = await asyncio.open_unix_connection(partition_socket(socket_dir, index))
        return cls(index, reader, writer)

    def send(self, up: ppb.PartitionUp) -> None:
        """Queue one PartitionUp (written as the socket takes it; see `drain`)."""
        self._writer.write(frame(up.SerializeToString()))

    async def drain(self) -> None:
        await self._writer.drain()

    async def downs(self) -> AsyncIterator[ppb.PartitionDown]:
        """What the partition sends, in order, until its connection ends."""
        parse = ppb.PartitionDown.FromString
        async for got in read_frames(self._reader):
            for data in got:
                yield parse(data)

    async def end(self) -> None:
        """End the connection (the partition process then ends: one front gone)."""
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


class PartitionProcess(PartitionConnection):
    def __init__(
        self,
        index: int,
        proc: Child,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        super().__init__(index, reader, writer)
        self.proc = proc

    @classmethod
    async def start(
        cls,
        socket_dir: str,
        index: int,
        k: int,
        *,
        term: int,
        coordinator_id: str,
        settings: CoreSettings,
        log_level: str = "WARNING",
        start_s: float = START_S,
        metrics: bool = False,
        rank_metrics: bool = True,
        fronts: int = 1,
    ) -> PartitionProcess:
        """Start partition `index` of `k` with a socket in `socket_dir` (a
        directory only this user may open) and connect to it, the first of
        its `fronts` connections (the others: front processes')."""
        path = partition_socket(socket_dir, index)
        proc = await Child.start(
            [
                sys.executable,
                # As this process's path: -P keeps a compiled core ahead of the
                # source tree (scripts/test.sh, docs/operations.md).
                *(("-P",) if sys.flags.safe_path else ()),
                "-m",
                "pushkv.controlplane.partition_host",
                *("--socket", path, "--index", str(index), "--partitions", str(k)),
                *("--term", str(term), "--coordinator-id", coordinator_id),
                *("--parent", str(os.getpid()), "--log-level", log_level),
                *("--settings", settings_json(settings)),
                *(("--metrics",) if metrics else ()),
                *(() if rank_metrics else ("--no-rank-metrics",)),
                *("--fronts", str(fronts)),
            ]
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), start_s)
            if line.decode() != READY:
                code = await asyncio.wait_for(proc.wait(), STOP_S)
                raise RuntimeError(f"partition {index} did not start (exit code {code})")
            reader, writer = await asyncio.open_unix_connection(path)
        except BaseException:
            proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), STOP_S)
            raise
        return cls(index, proc, reader, writer)

    async def close(self, stop_s: float = STOP_S) -> int:
        """End the connection and the process; its exit code (killed past
        `stop_s`: negative)."""
        await self.end()
        try:
            return await asyncio.wait_for(self.proc.wait(), stop_s)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()
