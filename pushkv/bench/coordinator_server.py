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


def process_name(pid: int, root: int) -> str:
    """A coordinator's process by what it runs: "replica" (the coordinator
    `root` itself), "partition-<i>" or "front-<i>" (its --partition-procs and
    --fronts children, by their --index), else "pid-<pid>"."""
    if pid == root:
        return "replica"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return f"pid-{pid}"
    index = argv[argv.index("--index") + 1] if "--index" in argv[:-1] else "?"
    for module, name in (("partition_host", "partition"), ("front_host", "front")):
        if f"controlplane.{module}" in argv:
            return f"{name}-{index}"
    return f"pid-{pid}"


def tcp_connections(pid: int, port: int) -> dict[str, int]:
    """Established TCP connections on local `port` held by the coordinator
    `pid` and its children, by `process_name` (each front process ends the
    connections the kernel handed it: SO_REUSEPORT)."""
    procs = {process_name(p, pid): p for p in (pid, *children(pid))}
    owner: dict[str, str] = {}  # socket inode -> process name
    for name, p in procs.items():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                    if link.startswith("socket:["):
                        owner[link[8:-1]] = name
    counts = dict.fromkeys(procs, 0)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)  # the header
            for line in f:
                cols = line.split()  # sl local remote st ... uid timeout inode
                if cols[3] != "01" or int(cols[1].rsplit(":", 1)[1], 16) != port:
                    continue  # 01: ESTABLISHED
                held_by = owner.get(cols[9])
                if held_by is not None:
                    counts[held_by] += 1
    return counts


def cpu_by_process(pid: int) -> dict[str, float]:
    """`cpu_seconds` of the coordinator `pid` and of each live child, by
    `process_name`."""
    return {process_name(p, pid): cpu_seconds(p) for p in (pid, *children(pid))}


def coordinator_main(
    conn: Connection, cpus: set[int] | None, profile: str | None, partition_procs: int = 0
) -> None:
    """Process entry: serve until the controller sends "stop"."""
    pin(cpus)
    from pushkv.controlplane import logs, rendezvous
    from pushkv.controlplane.core_build import core_build
    from pushkv.controlplane.server import ServerSettings, start, tune_gc
    from pushkv.controlplane.settings import CoreSettings

    logs.configure("WARNING", json=True)
    tune_gc()  # as `pushkv coordinator` does

    async def run() -> None:
        coord = await start(
            ServerSettings(
                port=0, core=CoreSettings(**CORE_SETTINGS), partition_procs=partition_procs
            )
        )
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


def children(pid: int) -> list[int]:
    """The live children of a process (a coordinator's partition processes)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(k) for k in f.read().split()]
    except (OSError, ValueError):
        return []


def tree_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` of a process and its live children (--partition-procs)."""
    return cpu_seconds(pid) + sum(cpu_seconds(k) for k in children(pid))


def tree_rss_bytes(pid: int) -> int:
    """`rss_bytes` of a process and its live children (--partition-procs)."""
    return rss_bytes(pid) + sum(rss_bytes(k) for k in children(pid))


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
