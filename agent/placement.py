"""Which CPUs pushkv's threads run on.

Linux gives a new thread its creator's CPU affinity. vLLM's CPU workers bind
the engine thread to its OpenMP compute cores (VLLM_CPU_OMP_THREADS_BIND), and
the agent starts from that thread, so without a placement every agent thread
(the link, its watchdog, the NIXL thread, UCX's and gRPC's own threads) would
queue behind the compute thread of one core, whatever cores sit idle. vLLM's
own NIXL connector moves its transfer work off the compute cores for the same
reason.

The setting (the connector's `thread_cpus`):
- "auto" (default): on a CPU engine (vLLM-CPU) whose starting thread is bound
  to fewer CPUs than its NUMA nodes hold, the CPUs of those nodes that the
  engine was given, where the kernel puts the threads on a free core;
  otherwise unchanged. The engine was given what its cgroup allows and what
  it was started on (a taskset or numactl binding of the whole engine, read
  from the parent process, which vLLM does not bind). A GPU worker's threads
  are not bound to compute cores, and a NUMA binding of its process (vLLM's
  --numa-bind) is kept.
- "inherit": the starting thread's CPUs, as Linux does by default.
- a CPU list such as "2-3,6": exactly those (each must be allowed).

The affinity of the starting thread is changed only while the threads start
(`placed`), and restored after: threads started inside inherit it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

AUTO = "auto"
INHERIT = "inherit"

# The CPUs of the cgroup at the mount's root: cgroup v2, then v1.
ROOT_CPUSET_FILES = (
    Path("/sys/fs/cgroup/cpuset.cpus.effective"),
    Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"),
)


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a list such as "0-3,6" (the kernel's and taskset's form)."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        part = item.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,6") from None
        if first < 0 or last < first:
            raise ValueError(f"{text!r}: {part!r} is not a CPU range")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return frozenset(cpus)


def check_setting(text: str) -> str:
    """`text` if it is a `thread_cpus` value (auto, inherit, or a list of CPUs
    this process's cgroup allows), else ValueError."""
    if text not in (AUTO, INHERIT):
        wanted = parse_cpu_list(text)
        allowed = cgroup_cpus()
        if not wanted <= allowed:
            raise ValueError(
                f"CPU(s) {sorted(wanted - allowed)} of {text!r} are not allowed to this "
                f"process (its cgroup allows {_ranges(allowed)}); or auto, or inherit"
            )
    return text


def _ranges(cpus: frozenset[int]) -> str:
    """`cpus` in the list form, e.g. "0-3,6"."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and cpu == int(out[-1].rpartition("-")[2]) + 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)


def cpuset_files(proc_cgroup: str) -> list[Path]:
    """Where this process's cgroup lists its CPUs, from /proc/self/cgroup's
    text: its own cgroup's file (v2 "0::/path", or v1's cpuset line), then
    the mount root's."""
    own: list[Path] = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        rel = path.strip().lstrip("/")
        if controllers == "":
            own.append(Path("/sys/fs/cgroup", rel, "cpuset.cpus.effective"))
        elif "cpuset" in controllers.split(","):
            own.append(Path("/sys/fs/cgroup/cpuset", rel, "cpuset.effective_cpus"))
    return [*own, *ROOT_CPUSET_FILES]


def cgroup_cpus() -> frozenset[int]:
    """The CPUs this process's cgroup allows (all online CPUs without a cpuset)."""
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        proc_cgroup = ""
    for path in cpuset_files(proc_cgroup):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return parse_cpu_list(text)
    return frozenset(range(os.cpu_count() or 1))


NODES_DIR = Path("/sys/devices/system/node")


def numa_nodes() -> list[frozenset[int]]:
    """Each NUMA node's CPUs ([] where the kernel does not say)."""
    nodes = []
    for node in sorted(NODES_DIR.glob("node[0-9]*")):
        try:
            text = (node / "cpulist").read_text().strip()
        except OSError:
            continue
        if text:  # a node with memory and no CPU lists none
            nodes.append(parse_cpu_list(text))
    return nodes


def numa_span(cpus: frozenset[int], nodes: list[frozenset[int]]) -> frozenset[int]:
    """The CPUs of every NUMA node holding one of `cpus` (`cpus` where the
    nodes are unknown)."""
    span = frozenset().union(*[n for n in nodes if n & cpus])
    return span | cpus


def launch_cpus() -> frozenset[int] | None:
    """The CPUs this engine was started on: its parent process's (a worker's
    EngineCore, or the API server), which vLLM leaves unbound and a taskset or
    numactl binding of the whole engine narrows. None where it cannot be read
    (the parent is gone)."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return None


def auto_cpus(
    mine: frozenset[int], given: frozenset[int], nodes: list[frozenset[int]]
) -> frozenset[int] | None:
    """auto on a CPU engine: the CPUs of the NUMA nodes of `mine` (the starting
    thread's) among those the engine was `given`, if that is more than `mine`;
    else None (nothing to move the threads to). Never a CPU outside `given`:
    an operator's binding of the engine holds for pushkv's threads too."""
    span = numa_span(mine, nodes or [given]) & given
    return span if mine < span else None


def resolve(setting: str, *, cpu_engine: bool) -> frozenset[int] | None:
    """The CPUs for pushkv's threads under `setting`, resolved on the thread
    that starts them; None: leave them the starting thread's. `cpu_engine`:
    the engine computes on the CPU (vLLM-CPU), which binds that thread to its
    compute cores."""
    if setting == INHERIT:
        return None
    if setting == AUTO:
        if not cpu_engine:
            return None
        given = cgroup_cpus()
        launched = launch_cpus()
        if launched is not None:
            given &= launched
        return auto_cpus(frozenset(os.sched_getaffinity(0)), given, numa_nodes())
    return parse_cpu_list(check_setting(setting))


@contextmanager
def placed(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside run on `cpus` (None: unchanged). The calling
    thread's own affinity is restored on the way out."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def thread_cpus() -> dict[int, frozenset[int]]:
    """Every thread of this process: native thread id -> the CPUs it may run on."""
    out: dict[int, frozenset[int]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return out
