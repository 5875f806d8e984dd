"""The coordinator under test, as a process of `pushkv bench coordinator`, and
what the controller reads of it: CPU placement, CPU seconds and VmRSS (/proc).

The process runs the real gRPC server with `pushkv coordinator`'s GC policy,
logs at WARNING, serves no metrics, and reports which build of the core it
imported itself (a spawned child could, in principle, import another copy of
the package than its parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import os
from multiprocessing.connection import Connection
from typing import NamedTuple

from pushkv.bench.coordinator_workload import CORE_SETTINGS, core_label


class CoordinatorReady(NamedTuple):
    """What a started coordinator process reports: its port and its core."""

    port: int
    core: str  # a `core:` line (bench.coordinator_workload.core_label)
    core_path: str  # the file controlplane.rendezvous was loaded from


def pin(cpus: set[int] | None) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def cpu_split(leader: int = 1) -> tuple[set[int] | None, set[int] | None]:
    """(coordinator CPUs, load CPUs): the first `leader` of the CPUs this
    process may run on for the coordinator, the others for the load; (None,
    None), nothing pinned, where that would leave the load no CPU."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= leader:
        return None, None
    return set(cpus[:leader]), set(cpus[leader:])


def tcp_connections(pid: int, port: int) -> int:
    """Established TCP connections on local `port` held by the process `pid`."""
    held: set[str] = set()  # its sockets' inodes
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    held.add(link[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)  # the header
            for line in f:
                cols = line.split()  # sl local remote st ... uid timeout inode
                if cols[3] != "01" or int(cols[1].rsplit(":", 1)[1], 16) != port:
                    continue  # 01: ESTABLISHED
                count += cols[9] in held
    return count


def coordinator_main(conn: Connection, cpus: set[int] | None, profile: str | None) -> None:
    """Process entry: serve until the controller sends "stop"."""
    pin(cpus)
    from pushkv.controlplane import logs, rendezvous
    from pushkv.controlplane.core_build import core_build
    from pushkv.controlplane.server import ServerSettings, start, tune_gc
    from pushkv.controlplane.settings import CoreSettings

    logs.configure("WARNING", json=True)
    tune_gc()  # as `pushkv coordinator` does

    async def run() -> None:
        coord = await start(ServerSettings(port=0, core=CoreSettings(**CORE_SETTINGS)))
        conn.send(CoordinatorReady(coord.port, core_label(core_build()), rendezvous.__file__ or ""))
        await asyncio.to_thread(conn.recv)  # "stop"
        await coord.stop(0)

    if profile:
        prof = cProfile.Profile()
        prof.enable()
        try:
            asyncio.run(run())
        finally:
            prof.disable()
            prof.dump_stats(profile)
    else:
        asyncio.run(run())
    conn.send("stopped")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
