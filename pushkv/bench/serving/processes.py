"""The serving benchmark's view of its processes: helper processes it starts
(the baselines' proxies), and what ``/proc`` and the engines' ``/metrics`` say
about CPU time, core affinity, run-queue waits and per-request engine times."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from pushkv.harness.vllm_server import metric_value, owned_log
from pushkv.vllm_integration.metrics import read_schedstat


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class ChildProcess:
    """A helper process (proxy) in its own process group, with a log file."""

    def __init__(self, name: str, cmd: list[str], health_url: str) -> None:
        self.name = name
        self.cmd = cmd
        self.health_url = health_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = owned_log(self, f"bench-{name}-")

    def start(self, timeout: float = 60.0) -> ChildProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
            if http_ok(self.health_url):
                return self
            time.sleep(0.2)  # polling a child process's HTTP port
        raise TimeoutError(f"{self.name} not ready in {timeout} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


# =============================================================== /proc


def pgid_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def cpu_ticks(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def worker_schedstat(pids: Sequence[int]) -> tuple[int, int]:
    """(run ns, run-queue wait ns) of the main thread of the vLLM worker processes
    among ``pids``, the thread that runs the forward (``/proc/PID/schedstat``)."""
    run = wait = 0
    for pid in pids:
        try:
            # "VLLM::Worker", or "VLLM::Worker_TP" (a TP rank's title, cut to 15 bytes).
            if not Path(f"/proc/{pid}/comm").read_text().strip().startswith("VLLM::Worker"):
                continue
        except OSError:
            continue
        stat = read_schedstat(pid)
        if stat is not None:
            run += stat[0]
            wait += stat[1]
    return run, wait


def idle_cpu_percent(
    pgids: dict[str, int], window_s: float = 3.0, settle_s: float = 2.0
) -> dict[str, float]:
    """CPU use of each process group over an idle window (spinning threads show here).

    ``settle_s`` first: a vLLM worker spin-polls for about a second after its last step.
    """
    time.sleep(settle_s)  # let the engines go idle
    hz = os.sysconf("SC_CLK_TCK")
    pids = {name: pgid_pids(g) for name, g in pgids.items()}
    before = {name: cpu_ticks(p) for name, p in pids.items()}
    time.sleep(window_s)  # measuring CPU use over a wall-clock window
    return {
        name: round(100.0 * (cpu_ticks(p) - before[name]) / hz / window_s, 1)
        for name, p in pids.items()
    }


def thread_affinity(pgid: int) -> dict[str, str]:
    """Allowed cores of every thread, per process name, in a process group."""
    out: dict[str, set[str]] = {}
    for pid in pgid_pids(pgid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    out.setdefault(name, set()).add(line.split(":", 1)[1].strip())
    return {k: ",".join(sorted(v)) for k, v in sorted(out.items())}


# =============================================================== engines' /metrics

TOKEN_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
ENGINE_TIMES: Final = (
    ("queue", "vllm:request_queue_time_seconds"),
    ("prefill", "vllm:request_prefill_time_seconds"),
    ("decode", "vllm:request_decode_time_seconds"),
)


def _metrics(base_url: str) -> str | None:
    """A server's Prometheus /metrics text; None when it does not answer."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text: str = r.read().decode()
            return text
    except (urllib.error.URLError, OSError):
        return None


def engine_time_sums(base_url: str) -> dict[str, float]:
    """Sums and counts of an engine's per-request time histograms ({} on failure)."""
    text = _metrics(base_url)
    if text is None:
        return {}
    out: dict[str, float] = {}
    for key, name in ENGINE_TIMES:
        out[key + "_sum"] = metric_value(text, name + "_sum")
        out[key + "_count"] = metric_value(text, name + "_count")
    return out


def engine_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    means: dict[str, float] = {}
    for key, _ in ENGINE_TIMES:
        n = after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
        total = after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)
        if n > 0:
            means[key] = round(1000 * total / n, 1)
    return means


def prompt_tokens_by_source(base_url: str) -> dict[str, float]:
    """vLLM's prompt token counter per source, from a server's /metrics ({} on failure)."""
    text = _metrics(base_url)
    if text is None:
        return {}
    return {
        src: metric_value(text, "vllm:prompt_tokens_by_source_total", f'source="{src}"')
        for src in TOKEN_SOURCES
    }
