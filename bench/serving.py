"""`pushkv bench serving`: pushkv against vLLM's own NIXL connectors on real vLLM.

One invocation runs, with the same locally built model, the same prompts and
the same load generator:

- ``pull``: vLLM ``NixlConnector`` (pull), with the standard sequential proxy
  (prefill, relay the returned ``kv_transfer_params``, then decode);
- ``vllm-push``: vLLM ``NixlPushConnector``, with concurrent dispatch of both legs;
- ``pushkv``: pushkv's connector, coordinator and ``pushkv router``;
- ``single``: one engine, no disaggregation (reference line).

Core layout: the prefill engine's worker on core 0 and the decode engine's on
core 1 for every disaggregated system (``VLLM_CPU_OMP_THREADS_BIND``); the
single engine on core 0. vLLM's NIXL connectors re-pin their workers to the
last core of each NUMA node; for those two baselines a ``sitecustomize`` shim
(on ``PYTHONPATH`` for those servers only) skips that call, exactly as in
``shared/reference/vllm-push-cpu.md``. The installed vLLM is not modified.

Load: Poisson arrivals at each rate, random-token prompts of uniformly random
length, a fixed output length (``ignore_eos``), streamed, so TTFT is the time
to the first streamed token at the client and TPOT is (last - first) / (n - 1).

Each system's servers start once per scenario and run all rates (a start costs
about a minute on this 2-core box, so alternating systems per rate would cost
more than the measurements). Scenarios: ``nocache`` (prefix caching off on
every engine, isolating the transfer) and ``prefixhit`` (prefix caching on; the
decode engine, or the single engine, is first warmed with the very prompts of
the rate, so it has a full prefix hit and only the tail is transferred).

The proxies of the two vLLM baselines are small aiohttp apps in this module,
run as separate processes (``python -m bench.serving proxy``),
like the pushkv router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from aiohttp import web

from vllm_integration.metrics import read_schedstat

SYSTEMS: Final = ("pull", "vllm-push", "pushkv", "single")
# Controls, run only when named in --systems: vLLM's NIXL connectors with NIXL's
# progress thread switched off (not vLLM's default; see _NOPROG_PATCH).
CONTROLS: Final = ("pull-noprog", "vllm-push-noprog")
COMPARED: Final = ("pull", "vllm-push", "pushkv")  # "sustained by all systems" uses these
LABELS: Final = {
    "pull": "vLLM NixlConnector (pull, sequential proxy)",
    "vllm-push": "vLLM NixlPushConnector (concurrent dispatch)",
    "pushkv": "pushkv (connector + coordinator + router)",
    "single": "single engine (no disaggregation)",
    "pull-noprog": "control: pull with NIXL's progress thread off",
    "vllm-push-noprog": "control: vLLM push with NIXL's progress thread off",
}
SCENARIOS: Final = ("nocache", "prefixhit")
SCENARIO_LABELS: Final = {
    "nocache": "prefix caching off (transfer isolated)",
    "prefixhit": "prefix caching on, decode side warmed: full prefix hit",
}
PREFILL_ENGINE_ID: Final = "prefill-0"
DECODE_ENGINE_ID: Final = "decode-0"
SUSTAINED_FRACTION: Final = 0.85  # achieved / offered throughput, with no failures

# The unpinning shim from shared/reference/vllm-push-cpu.md (verbatim logic):
# skip the NIXL worker's "last core per NUMA node" sched_setaffinity.
UNPIN_SHIM: Final = """\
import os, sys
_orig = os.sched_setaffinity
def _patched(pid, cpus):
    f = sys._getframe(1)
    if "kv_connector" in f.f_code.co_filename and "nixl" in f.f_code.co_filename:
        return None          # skip the NIXL worker's "last core per NUMA node" pin
    return _orig(pid, cpus)
os.sched_setaffinity = _patched
"""

# Defines _after_import(names, patch): patch(module) runs right after any of
# `names` is imported, by wrapping the loader the other finders return.
_AFTER_IMPORT: Final = """
import importlib.abc as _abc, sys as _sys
class _AfterImport(_abc.MetaPathFinder):
    def __init__(self, names, patch):
        self.names, self.patch = names, patch
    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        for finder in _sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module, patch = spec.loader.exec_module, self.patch
        def patched_exec(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = patched_exec
        return spec
def _after_import(names, patch):
    _sys.meta_path.insert(0, _AfterImport(frozenset(names), patch))
"""

# Control only (not vLLM's default): also construct NIXL agents without their UCX
# progress thread (``nixl_agent_config.enable_prog_thread``), which otherwise spins
# on the engine's own core. vLLM 0.32 offers no setting for it; the worker then
# progresses UCX when it polls its transfers each step, as pushkv's agent does.
_NOPROG_PATCH: Final = """
def _no_progress_thread(module):
    cls = module.nixl_agent_config
    init = cls.__init__
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.enable_pthread = False
    cls.__init__ = __init__
_after_import(("nixl._api", "nixl_cu12._api", "nixl_cu13._api"), _no_progress_thread)
"""

# Only with --vllm-spin-ms, and then for every vLLM server of every system alike:
# vLLM 0.32's shm message queues (EngineCore <-> worker) busy-poll with
# sched_yield for 1 s after each read (SpinCondition's busy_loop_s, hard-coded)
# before they block on a notification socket. On 2 cores, a spinning EngineCore
# shares the other engine's worker core. This bounds that window.
_SPIN_PATCH: Final = """
def _bound_spin(module, spin_s={spin_s!r}):
    init = module.SpinCondition.__init__
    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
        init(self, is_reader, context, notify_address, busy_loop_s=spin_s)
    module.SpinCondition.__init__ = __init__
_after_import(("vllm.distributed.device_communicators.shm_broadcast",), _bound_spin)
"""


def sitecustomize(*, unpin: bool, noprog: bool = False, spin_ms: float | None = None) -> str:
    """The sitecustomize.py a system's vLLM servers get ("": none)."""
    patches = (_NOPROG_PATCH if noprog else "") + (
        _SPIN_PATCH.format(spin_s=spin_ms / 1000) if spin_ms is not None else ""
    )
    return (UNPIN_SHIM if unpin else "") + (_AFTER_IMPORT + patches if patches else "")


MIN_SPIN_MS: Final = 1.0  # 0 hung a server's first request in a trial


def _say(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# =============================================================== configuration


@dataclass(frozen=True)
class BenchConfig:
    model_dir: Path
    layers: int = 4
    hidden: int = 256
    block_size: int = 128
    min_prompt: int = 256
    max_prompt: int = 3072
    output_len: int = 64
    rates: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0)
    duration_s: float = 30.0  # requests per rate = max(min_requests, rate * duration)
    min_requests: int = 40
    timeout_s: float = 120.0  # per request, client side
    max_num_seqs: int = 32
    kvcache_gib: int = 2
    seed: int = 0
    kv_lease_s: int | None = None  # vLLM NIXL kv_lease_duration; None: vLLM's default (30 s)
    startup_timeout_s: float = 300.0
    # pushkv connector settings to override (kv_connector_extra_config), e.g.
    # {"idle_wait_ms": 0}; empty: the connector's defaults.
    pushkv_extra: tuple[tuple[str, str], ...] = ()
    warmup_requests: int = 3
    systems: tuple[str, ...] = SYSTEMS
    scenarios: tuple[str, ...] = SCENARIOS
    quick: bool = False
    # "workers": only each engine's worker threads are bound to its core;
    # "engines": every process of an engine (API server, EngineCore, worker).
    pin: str = "workers"
    # vLLM's shm queue busy-poll window (_SPIN_PATCH), every system alike; None:
    # vLLM's own (1 s).
    vllm_spin_ms: float | None = None

    @property
    def max_model_len(self) -> int:
        need = self.max_prompt + self.output_len + 1
        return -(-need // self.block_size) * self.block_size

    def requests_for(self, rate: float) -> int:
        return max(self.min_requests, round(rate * self.duration_s))


# =============================================================== workload


@dataclass(frozen=True)
class Workload:
    rate: float
    prompts: tuple[tuple[int, ...], ...]
    arrivals: tuple[float, ...]  # seconds after the start of the run


def make_workload(cfg: BenchConfig, scenario: str, rate_index: int, rate: float) -> Workload:
    """Prompts and Poisson arrivals; identical for every system (seeded per scenario/rate)."""
    rng = random.Random(f"{cfg.seed}/{scenario}/{rate_index}/{rate}")
    n = cfg.requests_for(rate)
    prompts = []
    for _ in range(n):
        length = rng.randint(cfg.min_prompt, cfg.max_prompt)
        prompts.append(tuple(rng.randrange(4, 1024) for _ in range(length)))
    # Exponential gaps (Poisson arrivals), rescaled so that the n arrivals span exactly
    # (n - 1) / rate: short runs then offer the nominal rate, not a random one.
    gaps = [rng.expovariate(rate) for _ in range(n - 1)]
    scale = (n - 1) / rate / sum(gaps) if gaps else 1.0
    arrivals, t = [0.0], 0.0
    for g in gaps:
        t += g * scale
        arrivals.append(t)
    return Workload(rate, tuple(prompts), tuple(arrivals))


def warmup_prompts(cfg: BenchConfig) -> list[list[int]]:
    rng = random.Random(f"{cfg.seed}/warmup")
    return [
        [rng.randrange(4, 1024) for _ in range(rng.randint(cfg.min_prompt, cfg.min_prompt * 2))]
        for _ in range(cfg.warmup_requests)
    ]


# =============================================================== load generator


@dataclass
class ReqRecord:
    index: int
    prompt_len: int
    sent: float  # seconds after the start of the run
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    chunks: int = 0
    error: str = ""
    timed_out: bool = False
    sent_unix: float = 0.0
    first_unix: float | None = None
    response_id: str = ""  # the router's transfer id shows here as "cmpl-<transfer id>"

    @property
    def ok(self) -> bool:
        return not self.error and not self.timed_out and self.first is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def completion_body(prompt: Sequence[int], max_tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    rec: ReqRecord,
    body: dict[str, Any],
    t0: float,
    timeout_s: float,
    expect_tokens: int,
) -> None:
    rec.sent_unix = time.time()
    try:
        async with asyncio.timeout(timeout_s), session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                if chunk.get("choices"):
                    now = time.perf_counter() - t0
                    if rec.first is None:
                        rec.first = now
                        rec.first_unix = time.time()
                        rec.response_id = str(chunk.get("id", ""))
                    rec.last = now
                    rec.chunks += 1
                usage = chunk.get("usage")
                if usage:
                    rec.tokens = int(usage.get("completion_tokens") or 0)
            if not rec.tokens:
                rec.tokens = rec.chunks
            if not done:
                rec.error = "stream ended without [DONE]"
            elif rec.tokens != expect_tokens:
                rec.error = f"got {rec.tokens} tokens, expected {expect_tokens}"
    except TimeoutError:
        rec.timed_out = True
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def _run_load(url: str, wl: Workload, output_len: int, timeout_s: float) -> list[ReqRecord]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    records = [ReqRecord(i, len(p), wl.arrivals[i]) for i, p in enumerate(wl.prompts)]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for rec, prompt in zip(records, wl.prompts, strict=True):
            delay = t0 + rec.sent - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.sent = time.perf_counter() - t0
            body = completion_body(prompt, output_len, stream=True)
            tasks.append(
                asyncio.create_task(
                    _one(session, url, rec, body, t0, timeout_s, expect_tokens=output_len)
                )
            )
        await asyncio.gather(*tasks)
    return records


def run_load(base_url: str, wl: Workload, output_len: int, timeout_s: float) -> list[ReqRecord]:
    url = base_url.rstrip("/") + "/v1/completions"
    return asyncio.run(_run_load(url, wl, output_len, timeout_s))


async def _post_many(
    url: str, prompts: Sequence[Sequence[int]], concurrency: int, timeout_s: float
) -> list[str]:
    """Non-streamed one-token completions; returns an error string per failed prompt."""
    sem = asyncio.Semaphore(concurrency)
    errors: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:

        async def one(p: Sequence[int]) -> None:
            async with sem:
                try:
                    async with s.post(url, json=completion_body(p, 1, stream=False)) as r:
                        if r.status != 200:
                            errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                        else:
                            await r.read()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(one(p) for p in prompts))
    return errors


# =============================================================== statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RateResult:
    rate: float
    n: int
    ok: int
    failed: int
    timed_out: int
    offered_rps: float
    throughput_rps: float  # ok / (last finish - first send)
    completion_rps: float  # (ok - 1) / (last finish - first finish)
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms_p50: float
    sustained: bool
    errors: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    loadavg_before: float = math.nan  # 1-min load average of the whole box (noise)
    loadavg_after: float = math.nan
    # pushkv only: medians (ms) of each stage of the request, from the coordinator's
    # per-transfer timeline matched to the client's clock (same host).
    stages_ms: dict[str, float] = field(default_factory=dict)
    # The decode engine's (single: the engine's) prompt tokens by source during the
    # rate: local_compute, local_cache_hit, external_kv_transfer (vLLM's counter).
    decode_prompt_tokens: dict[str, float] = field(default_factory=dict)
    # CPU seconds used during the rate by each process group (engines, front,
    # coordinator) and by this load generator: where the 2 cores went.
    cpu_s: dict[str, float] = field(default_factory=dict)
    # Per engine: seconds its worker's main thread (the one that runs the forward)
    # ran, and waited in the run queue for its core while runnable (schedstat):
    # {"prefill": {"run": .., "wait": ..}, ...}. Waiting is time other threads took.
    worker_sched_s: dict[str, dict[str, float]] = field(default_factory=dict)
    # Mean per-request times (ms) from each engine's own histograms during the rate:
    # {"prefill": {"queue": .., "prefill": .., "decode": ..}, "decode": {...}}.
    engine_ms: dict[str, dict[str, float]] = field(default_factory=dict)


def summarize(rate: float, recs: Sequence[ReqRecord]) -> RateResult:
    """Percentiles over the successful requests, and whether the rate was sustained.

    Sustained: no failed or timed-out request, and the achieved throughput,
    ok / (last finish - first send), is at least 0.85 x the offered rate,
    (n - 1) / (last send - first send). A saturated system finishes requests at
    its capacity, below the arrival rate, while its queue grows; an unsaturated
    one loses only the last request's latency (a few %).
    """
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    e2e = [(r.last - r.sent) * 1000 for r in ok if r.last is not None]
    sent = [r.sent for r in recs]
    span = max(sent) - min(sent) if len(sent) > 1 else 0.0
    offered = (len(recs) - 1) / span if span > 0 else math.nan
    ends = sorted(r.last for r in ok if r.last is not None)
    makespan = ends[-1] - min(sent) if ends else 0.0
    throughput = len(ok) / makespan if makespan > 0 else 0.0
    finish_span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    completion_rps = (len(ends) - 1) / finish_span if finish_span > 0 else math.nan
    failed = sum(1 for r in recs if r.error)
    timed_out = sum(1 for r in recs if r.timed_out)
    sustained = (
        failed == 0
        and timed_out == 0
        and len(ok) == len(recs)
        and not math.isnan(offered)
        and throughput >= SUSTAINED_FRACTION * offered
    )
    errors = sorted({r.error or "timed out" for r in recs if not r.ok})[:5]
    return RateResult(
        rate=rate,
        n=len(recs),
        ok=len(ok),
        failed=failed,
        timed_out=timed_out,
        offered_rps=offered,
        throughput_rps=throughput,
        completion_rps=completion_rps,
        ttft_ms={f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        tpot_ms={f"p{q}": percentile(tpot, q) for q in (50, 90, 99)},
        e2e_ms_p50=percentile(e2e, 50),
        sustained=sustained,
        errors=errors,
        records=[asdict(r) for r in recs],
    )


# =============================================================== processes


def _free_port() -> int:
    from harness.vllm_server import free_port

    return free_port()


def _http_ok(url: str, timeout: float = 2.0) -> bool:
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
        self.log_path = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])

    def start(self, timeout: float = 60.0) -> ChildProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
            if _http_ok(self.health_url):
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


def _pgid_pids(pgid: int) -> list[int]:
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


def _cpu_ticks(pids: Sequence[int]) -> int:
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
            if Path(f"/proc/{pid}/comm").read_text().strip() != "VLLM::Worker":
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
    pids = {name: _pgid_pids(g) for name, g in pgids.items()}
    before = {name: _cpu_ticks(p) for name, p in pids.items()}
    time.sleep(window_s)  # measuring CPU use over a wall-clock window
    return {
        name: round(100.0 * (_cpu_ticks(p) - before[name]) / hz / window_s, 1)
        for name, p in pids.items()
    }


def thread_affinity(pgid: int) -> dict[str, str]:
    """Allowed cores of every thread, per process name, in a process group."""
    out: dict[str, set[str]] = {}
    for pid in _pgid_pids(pgid):
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


# =============================================================== deployments


@dataclass
class Deployment:
    system: str
    scenario: str
    front_url: str = ""  # base URL the load goes to
    warm_url: str = ""  # the engine whose prefix cache the prefixhit scenario warms
    coordinator: str = ""  # pushkv only
    servers: list[Any] = field(default_factory=list)  # VllmServer
    helpers: list[Any] = field(default_factory=list)  # ChildProcess / RouterProcess / Coordinator
    workdir: Path | None = None

    def stop(self) -> None:
        # A second Ctrl-C or SIGTERM must not interrupt the cleanup and orphan servers.
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for h in reversed(self.helpers):
                with contextlib.suppress(Exception):
                    h.stop()
            for s in self.servers:
                with contextlib.suppress(Exception):
                    s.stop()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def pgids(self) -> dict[str, int]:
        return {s.name: s.proc.pid for s in self.servers if s.proc is not None}

    def all_pgids(self) -> dict[str, int]:
        """Servers, plus the router / proxy / coordinator (each leads its own session)."""
        out = self.pgids()
        for h in self.helpers:
            proc = getattr(h, "proc", None)
            if proc is not None:
                name = type(h).__name__.removesuffix("Process").lower() or "helper"
                out[getattr(h, "name", name) if name == "child" else name] = proc.pid
        return out


def _server(cfg: BenchConfig, name: str, core: int, scenario: str, **kw: Any) -> Any:
    from harness.vllm_server import VllmServer

    caching = "--enable-prefix-caching" if scenario == "prefixhit" else "--no-enable-prefix-caching"
    return VllmServer(
        cfg.model_dir,
        name,
        cpu_core=core,
        pin_process=cfg.pin == "engines",
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        kvcache_gib=cfg.kvcache_gib,
        extra_args=(caching,),
        **kw,
    )


def _nixl_config(cfg: BenchConfig, connector: str, role: str, engine_id: str) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }
    if cfg.kv_lease_s is not None:
        conf["kv_connector_extra_config"] = {"kv_lease_duration": cfg.kv_lease_s}
    return conf


def deploy(cfg: BenchConfig, system: str, scenario: str) -> Deployment:
    """Start one system's processes and wait until they serve (bounded)."""
    from harness.coordinator import CoordinatorProcess
    from harness.vllm_server import RouterProcess, pushkv_config

    dep = Deployment(system, scenario)
    nixl = system not in ("single", "pushkv")  # vLLM's NIXL connectors: unpinned
    shim = sitecustomize(unpin=nixl, noprog=system.endswith("-noprog"), spin_ms=cfg.vllm_spin_ms)
    try:
        shim_env: dict[str, str] = {}
        if shim:
            dep.workdir = Path(tempfile.mkdtemp(prefix="bench-shim-"))
            (dep.workdir / "sitecustomize.py").write_text(shim)
            shim_env["PYTHONPATH"] = os.pathsep.join(
                x for x in (str(dep.workdir), os.environ.get("PYTHONPATH", "")) if x
            )
        if system == "single":
            s = _server(cfg, "single", 0, scenario, env=shim_env)
            dep.servers.append(s)
            s.start()
            s.wait_ready(cfg.startup_timeout_s)
            dep.front_url = dep.warm_url = s.url
            return dep
        if system == "pushkv":
            coord = CoordinatorProcess("--log-level", "WARNING")
            dep.helpers.append(coord)
            coord.start()
            pp, dp = _free_port(), _free_port()
            p_conf = pushkv_config(
                "kv_producer", PREFILL_ENGINE_ID, coord.address, f"http://127.0.0.1:{pp}"
            )
            d_conf = pushkv_config(
                "kv_consumer", DECODE_ENGINE_ID, coord.address, f"http://127.0.0.1:{dp}"
            )
            for conf in (p_conf, d_conf):
                conf["kv_connector_extra_config"].update(dict(cfg.pushkv_extra))
            p = _server(
                cfg, "prefill", 0, scenario, port=pp, kv_transfer_config=p_conf, env=shim_env
            )
            d = _server(
                cfg, "decode", 1, scenario, port=dp, kv_transfer_config=d_conf, env=shim_env
            )
            dep.servers += [p, d]
            p.start()
            d.start()
            p.wait_ready(cfg.startup_timeout_s)
            d.wait_ready(cfg.startup_timeout_s)
            router = RouterProcess(coord.address)
            dep.helpers.append(router)
            router.start(timeout=120)
            dep.front_url, dep.warm_url, dep.coordinator = router.url, d.url, coord.address
            return dep
        # vLLM's NIXL connectors, with the unpinning shim on PYTHONPATH.
        pull = system.startswith("pull")
        connector = "NixlConnector" if pull else "NixlPushConnector"
        side_p, side_d = _free_port(), _free_port()

        def env(side: int) -> dict[str, str]:
            return {
                **shim_env,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
            }

        p = _server(
            cfg,
            "prefill",
            0,
            scenario,
            kv_transfer_config=_nixl_config(cfg, connector, "kv_producer", PREFILL_ENGINE_ID),
            env=env(side_p),
        )
        d = _server(
            cfg,
            "decode",
            1,
            scenario,
            kv_transfer_config=_nixl_config(cfg, connector, "kv_consumer", DECODE_ENGINE_ID),
            env=env(side_d),
        )
        dep.servers += [p, d]
        p.start()
        d.start()
        p.wait_ready(cfg.startup_timeout_s)
        d.wait_ready(cfg.startup_timeout_s)
        port = _free_port()
        proxy = ChildProcess(
            f"proxy-{system}",
            [
                sys.executable,
                "-m",
                "bench.serving",
                "proxy",
                "--mode",
                "pull" if pull else "push",
                "--port",
                str(port),
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--prefill-engine-id",
                PREFILL_ENGINE_ID,
                "--prefill-side-port",
                str(side_p),
            ],
            f"http://127.0.0.1:{port}/health",
        )
        dep.helpers.append(proxy)
        proxy.start()
        dep.front_url, dep.warm_url = f"http://127.0.0.1:{port}", d.url
        return dep
    except BaseException:
        dep.stop()
        raise


# =============================================================== proxies (a) and (b)


class Proxy:
    """The standard 1P1D proxy flows for vLLM's NIXL connectors.

    pull: POST the prefill leg (max_tokens 1, do_remote_decode), wait for its
          response, relay its kv_transfer_params to the decode leg, stream that.
    push: POST both legs at once; the decode leg carries the prefill engine's
          coordinates and the shared request id (X-Request-Id on both legs).
    """

    def __init__(
        self, mode: str, prefill: str, decode: str, prefill_engine_id: str, side_port: int
    ) -> None:
        self.mode = mode
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.prefill_engine_id = prefill_engine_id
        self.side_port = side_port
        self._http: aiohttp.ClientSession | None = None

    async def _start(self, app: web.Application) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600, connect=10))

    async def _stop(self, app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.mode})

    def _prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        p = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p.update(max_tokens=1, stream=False)
        p["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return p

    async def _post_prefill(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        assert self._http is not None
        async with self._http.post(
            self.prefill + "/v1/completions", json=self._prefill_body(body), headers=headers
        ) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"prefill answered {r.status}: {text[:200]}")
            out: dict[str, Any] = json.loads(text)
            return out

    async def _relay_decode(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self._http is not None
        async with self._http.post(
            self.decode + "/v1/completions", json=body, headers=headers
        ) as resp:
            if not body.get("stream"):
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type=resp.content_type
                )
            response = web.StreamResponse(status=resp.status)
            response.content_type = resp.content_type or "text/event-stream"
            response.headers["Cache-Control"] = "no-cache"
            await response.prepare(request)
            async for chunk in resp.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if self.mode == "pull":
            try:
                pre = await self._post_prefill(body, headers)
            except (RuntimeError, aiohttp.ClientError, ValueError) as exc:
                return web.json_response({"error": str(exc)}, status=502)
            params = pre.get("kv_transfer_params")
            if not isinstance(params, dict):
                return web.json_response({"error": "no kv_transfer_params"}, status=502)
            return await self._relay_decode(
                request, {**body, "kv_transfer_params": params}, headers
            )

        decode_body = {
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.prefill_engine_id,
                "remote_host": "127.0.0.1",
                "remote_port": self.side_port,
                "tp_size": 1,
                "pp_size": 1,
                "remote_request_id": rid,
            },
        }
        handler = asyncio.current_task()
        p_task = asyncio.create_task(self._post_prefill(body, headers))

        def prefill_done(t: asyncio.Task[dict[str, Any]]) -> None:
            # A failed prefill leg would leave the decode leg waiting for a whole
            # registration timeout: abort it (the client sees a failure).
            if not t.cancelled() and t.exception() is not None and handler is not None:
                handler.cancel()

        p_task.add_done_callback(prefill_done)
        try:
            return await self._relay_decode(request, decode_body, headers)
        finally:
            if not p_task.done():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(p_task, 60)


async def _serve_proxy(proxy: Proxy, port: int) -> None:
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def proxy_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_serving proxy")
    ap.add_argument("--mode", choices=["pull", "push"], required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--prefill-engine-id", default=PREFILL_ENGINE_ID)
    ap.add_argument("--prefill-side-port", type=int, default=0)
    a = ap.parse_args(argv)
    proxy = Proxy(a.mode, a.prefill, a.decode, a.prefill_engine_id, a.prefill_side_port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_proxy(proxy, a.port))
    return 0


# =============================================================== driver


@dataclass
class SystemRun:
    system: str
    scenario: str
    error: str = ""
    startup_s: float = 0.0
    affinity: dict[str, dict[str, str]] = field(default_factory=dict)
    idle_cpu_percent: dict[str, float] = field(default_factory=dict)
    rates: list[RateResult] = field(default_factory=list)

    def at(self, rate: float) -> RateResult | None:
        return next((r for r in self.rates if r.rate == rate), None)


TOKEN_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
ENGINE_TIMES: Final = (
    ("queue", "vllm:request_queue_time_seconds"),
    ("prefill", "vllm:request_prefill_time_seconds"),
    ("decode", "vllm:request_decode_time_seconds"),
)


def engine_time_sums(base_url: str) -> dict[str, float]:
    """Sums and counts of an engine's per-request time histograms ({} on failure)."""
    from harness.vllm_server import metric_value

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
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
    from harness.vllm_server import metric_value

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    return {
        src: metric_value(text, "vllm:prompt_tokens_by_source_total", f'source="{src}"')
        for src in TOKEN_SOURCES
    }


def _warm(url: str, prompts: Sequence[Sequence[int]], timeout_s: float) -> list[str]:
    return asyncio.run(_post_many(url + "/v1/completions", prompts, 2, timeout_s))


def run_system(cfg: BenchConfig, system: str, scenario: str) -> SystemRun:
    run = SystemRun(system, scenario)
    t0 = time.monotonic()
    _say(f"[{scenario}] {system}: starting ({LABELS[system]}) ...")
    dep: Deployment | None = None
    for attempt in (1, 2):  # ports come from free_port(): another process may take one first
        try:
            dep = deploy(cfg, system, scenario)
            break
        except (RuntimeError, TimeoutError, OSError) as exc:
            lines = str(exc).splitlines() or [""]
            cause = [ln for ln in lines[1:] if "Error" in ln or "error:" in ln][-1:]
            why = " ".join(["start failed:", lines[0], *cause])[:400]
            _say(f"[{scenario}] {system}: {why} (attempt {attempt} of 2)")
            run.error = why
    if dep is None:
        return run
    run.error = ""
    try:
        run.startup_s = round(time.monotonic() - t0, 1)
        run.affinity = {name: thread_affinity(g) for name, g in dep.pgids().items()}
        # Warm-up through the front: handshakes and first-request costs, not measured.
        warm = warmup_prompts(cfg)
        recs = run_load(
            dep.front_url,
            Workload(0.0, tuple(tuple(p) for p in warm), tuple(0.0 for _ in warm)),
            cfg.output_len,
            cfg.timeout_s,
        )
        bad = [r.error or "timed out" for r in recs if not r.ok]
        if bad:
            run.error = f"warm-up failed: {bad[0]}"
            _say(f"[{scenario}] {system}: {run.error}")
            return run
        run.idle_cpu_percent = idle_cpu_percent(dep.pgids())
        _say(
            f"[{scenario}] {system}: up in {run.startup_s:.0f} s; worker affinity "
            f"{ {n: a.get('VLLM::Worker', '?') for n, a in run.affinity.items()} }; "
            f"idle CPU % {run.idle_cpu_percent}"
        )
        for i, rate in enumerate(cfg.rates):
            wl = make_workload(cfg, scenario, i, rate)
            if scenario == "prefixhit":
                errs = _warm(dep.warm_url, wl.prompts, cfg.timeout_s)
                if errs:
                    _say(f"  warming {dep.warm_url} failed for {len(errs)} prompts: {errs[0]}")
            load0 = os.getloadavg()[0]
            tokens0 = prompt_tokens_by_source(dep.warm_url)
            times0 = {sv.name: engine_time_sums(sv.url) for sv in dep.servers}
            groups = {name: _pgid_pids(g) for name, g in dep.all_pgids().items()}
            cpu0 = {name: _cpu_ticks(p) for name, p in groups.items()}
            sched0 = {name: worker_schedstat(p) for name, p in groups.items()}
            self0 = os.times()
            recs = run_load(dep.front_url, wl, cfg.output_len, cfg.timeout_s)
            hz = os.sysconf("SC_CLK_TCK")
            res_cpu = {
                name: round((_cpu_ticks(p) - cpu0[name]) / hz, 2) for name, p in groups.items()
            }
            self1 = os.times()
            res_cpu["load generator"] = round(
                self1.user + self1.system - self0.user - self0.system, 2
            )
            res = summarize(rate, recs)
            res.loadavg_before, res.loadavg_after = load0, os.getloadavg()[0]
            res.cpu_s = res_cpu
            for name, p in groups.items():
                (r0, w0), (r1, w1) = sched0[name], worker_schedstat(p)
                if r1 > r0:
                    res.worker_sched_s[name] = {
                        "run": round((r1 - r0) / 1e9, 2),
                        "wait": round((w1 - w0) / 1e9, 2),
                    }
            res.engine_ms = {
                sv.name: engine_means_ms(times0[sv.name], engine_time_sums(sv.url))
                for sv in dep.servers
            }
            tokens1 = prompt_tokens_by_source(dep.warm_url)
            res.decode_prompt_tokens = {k: v - tokens0.get(k, 0.0) for k, v in tokens1.items()}
            if dep.coordinator:
                res.stages_ms = pushkv_stages(dep.coordinator, recs)
            run.rates.append(res)
            _say(
                f"  rate {rate:g}/s: {res.ok}/{res.n} ok, {res.failed} failed, "
                f"{res.timed_out} timed out; {res.throughput_rps:.2f} req/s; "
                f"TTFT p50 {res.ttft_ms['p50']:.0f} ms p99 {res.ttft_ms['p99']:.0f} ms; "
                f"TPOT p50 {res.tpot_ms['p50']:.1f} ms; load avg {load0:.1f}"
                + ("" if res.sustained else "  (not sustained)")
                + (f"  errors: {res.errors[:2]}" if res.errors else "")
            )
            _say(f"    decode-side prompt tokens by source: {res.decode_prompt_tokens}")
            _say(f"    CPU seconds during the rate: {res.cpu_s}")
            _say(
                "    worker main thread (the forward), seconds run / waited for its core: "
                + ", ".join(
                    f"{n} {v['run']:.2f} / {v['wait']:.2f}" for n, v in res.worker_sched_s.items()
                )
            )
            _say(f"    engine-side mean times (ms): {res.engine_ms}")
            if res.stages_ms:
                _say("    pushkv stages, medians (ms): " + stages_text(res.stages_ms))
            time.sleep(1.0)  # let the engines go idle between rates
        return run
    finally:
        dep.stop()


# =============================================================== pushkv timeline

STAGES: Final = (
    ("send->decode_registered", "sent", "decode_registered"),
    ("send->prefill_done", "sent", "prefill_done"),
    ("both->ordered", "both", "ordered"),
    ("ordered->write_done", "ordered", "write_done"),
    ("write_done->complete", "write_done", "complete"),
    ("complete->first_token", "complete", "first"),
    ("send->first_token", "sent", "first"),
)


def pushkv_stages(coordinator: str, recs: Sequence[ReqRecord]) -> dict[str, float]:
    """Where a pushkv request's TTFT goes, from the coordinator's transfer timelines.

    The router uses its transfer id as X-Request-Id, so a streamed chunk's id is
    ``cmpl-<transfer id>``; the timeline events are unix times on this host.
    """
    import grpc
    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    channel = grpc.insecure_channel(coordinator)
    try:
        stub = pbg.StatusServiceStub(channel)
        listed = stub.ListTransfers(pb.ListTransfersRequest(limit=10_000), timeout=10)
    except grpc.RpcError:
        return {}
    finally:
        channel.close()
    by_id = {t.transfer_id: t for t in listed.transfers}
    samples: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for r in recs:
        t = by_id.get(r.response_id.removeprefix("cmpl-"))
        if t is None or r.first_unix is None:
            continue
        at: dict[str, float] = {"sent": r.sent_unix, "first": r.first_unix}
        for e in t.timeline:
            if e.stage == "write_done":  # the last rank's
                at[e.stage] = max(at.get(e.stage, 0.0), e.unix_us / 1e6)
            else:
                at.setdefault(e.stage, e.unix_us / 1e6)
        if "decode_registered" in at and "prefill_done" in at:
            at["both"] = max(at["decode_registered"], at["prefill_done"])
        for name, a, b in STAGES:
            if a in at and b in at:
                samples[name].append((at[b] - at[a]) * 1000)
    return {name: percentile(xs, 50) for name, xs in samples.items() if xs}


def stages_text(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in stages.items())


# =============================================================== reporting


def _fmt(x: float, digits: int = 0) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


# A TPOT p50 under this means the responses came in one chunk: a starved API
# server sent every token at once, so the client saw no time between tokens
# (a decode step here takes ~4 ms). A ratio against it would mean nothing.
TPOT_UNSEEN_MS = 0.05


def _tpot_ratio(a: float, b: float) -> float:
    return math.nan if b < TPOT_UNSEEN_MS else _ratio(a, b)


def highest_common_rate(runs: dict[str, SystemRun], rates: Sequence[float]) -> float | None:
    """Highest rate sustained by every compared system that ran (failed systems excluded)."""
    alive = [runs[s] for s in COMPARED if s in runs and not runs[s].error and runs[s].rates]
    if not alive:
        return None
    best = None
    for rate in rates:
        if all((r := run.at(rate)) is not None and r.sustained for run in alive):
            best = rate
    return best


def _metric(run: SystemRun | None, rate: float, key: str, q: str) -> float:
    if run is None or run.error:
        return math.nan
    r = run.at(rate)
    if r is None:
        return math.nan
    return float(getattr(r, key)[q])


def report(cfg: BenchConfig, all_runs: dict[str, dict[str, SystemRun]]) -> list[str]:
    lines: list[str] = []
    for scenario, runs in all_runs.items():
        lines.append("")
        lines.append(f"## scenario {scenario}: {SCENARIO_LABELS[scenario]}")
        lines.append(
            "| rate (req/s) | system | ok/n | failed | timed out | offered / achieved (req/s) "
            "| TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | sustained |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for rate in cfg.rates:
            for system in cfg.systems:
                run = runs.get(system)
                if run is None:
                    continue
                if run.error:
                    lines.append(f"| {rate:g} | {system} | FAILED: {run.error} |||||||")
                    continue
                r = run.at(rate)
                if r is None:
                    continue
                t, p = r.ttft_ms, r.tpot_ms
                lines.append(
                    f"| {rate:g} | {system} | {r.ok}/{r.n} | {r.failed} | {r.timed_out} "
                    f"| {r.offered_rps:.2f} / {r.throughput_rps:.2f} "
                    f"| {_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} "
                    f"| {_fmt(p['p50'], 1)} / {_fmt(p['p90'], 1)} / {_fmt(p['p99'], 1)} "
                    f"| {'yes' if r.sustained else 'no'} |"
                )
        lines.append("")
        lines.append(f"ratios pushkv / baseline ({scenario}; below 1: pushkv better)")
        lines.append(
            "| rate | pushkv vs | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        pk = runs.get("pushkv")
        unseen = False
        for rate in cfg.rates:
            for base in ("pull", "vllm-push", *CONTROLS):
                other = runs.get(base)
                if other is None:
                    continue
                cells = [
                    _fmt(
                        _ratio(_metric(pk, rate, "ttft_ms", q), _metric(other, rate, "ttft_ms", q)),
                        2,
                    )
                    for q in ("p50", "p90", "p99")
                ]
                for q in ("p50", "p90", "p99"):
                    b = _metric(other, rate, "tpot_ms", q)
                    seen = not b < TPOT_UNSEEN_MS
                    unseen = unseen or not seen
                    a = _metric(pk, rate, "tpot_ms", q)
                    cells.append(_fmt(_tpot_ratio(a, b), 2) if seen else "n/a")
                lines.append(f"| {rate:g} | {base} | " + " | ".join(cells) + " |")
        if unseen:
            lines.append(
                "n/a: the baseline's TPOT rounds to 0.0 ms: its API server sent most "
                "responses in one chunk, so the client saw no time between tokens"
            )
        pk_run = runs.get("pushkv")
        if pk_run is not None and any(r.stages_ms for r in pk_run.rates):
            lines.append("")
            lines.append(
                f"pushkv: where TTFT goes ({scenario}; medians in ms over requests, "
                "from the coordinator's transfer timelines)"
            )
            lines.append("| rate | " + " | ".join(name for name, _, _ in STAGES) + " |")
            lines.append("|---|" + "---|" * len(STAGES))
            for r in pk_run.rates:
                cells = [_fmt(r.stages_ms.get(name, math.nan)) for name, _, _ in STAGES]
                lines.append(f"| {r.rate:g} | " + " | ".join(cells) + " |")
        best = highest_common_rate(runs, cfg.rates)
        lines.append(
            f"highest rate sustained by all of {', '.join(s for s in COMPARED if s in runs)}: "
            + (f"{best:g} req/s" if best is not None else "none")
        )
        ref = single_floor(cfg, runs)
        if ref is not None:
            lines.append(ref)
    return lines


def single_floor(cfg: BenchConfig, runs: dict[str, SystemRun]) -> str | None:
    """The single engine's TTFT p50 over pull's at the comparison rate: the ratio a
    system with no transfer and no second engine reaches on this machine, a
    reference for the TTFT goals. None unless both ran."""
    if "single" not in runs or "pull" not in runs:
        return None
    rate = comparison_rate(cfg, runs)
    if rate is None:
        return None
    x = _ratio(
        _metric(runs["single"], rate, "ttft_ms", "p50"),
        _metric(runs["pull"], rate, "ttft_ms", "p50"),
    )
    return (
        f"reference at {rate:g} req/s: single-engine TTFT p50 / pull = {_fmt(x, 2)} "
        "(no transfer, no second engine)"
    )


def comparison_rate(cfg: BenchConfig, runs: dict[str, SystemRun]) -> float | None:
    """Where the final line's ratios are taken: the highest rate all compared
    systems sustained, else the lowest rate (said in the table)."""
    best = highest_common_rate(runs, cfg.rates)
    if best is None:
        best = cfg.rates[0] if cfg.rates else None
    return best


def final_line(cfg: BenchConfig, runs: dict[str, SystemRun]) -> tuple[str, float | None]:
    best = comparison_rate(cfg, runs)
    pk, pl, vp = runs.get("pushkv"), runs.get("pull"), runs.get("vllm-push")
    if best is None:
        x = y = z = math.nan
    else:
        x = _ratio(_metric(pk, best, "ttft_ms", "p50"), _metric(pl, best, "ttft_ms", "p50"))
        y = _ratio(_metric(pk, best, "ttft_ms", "p50"), _metric(vp, best, "ttft_ms", "p50"))
        z = _tpot_ratio(_metric(pk, best, "tpot_ms", "p50"), _metric(pl, best, "tpot_ms", "p50"))

    def f(v: float) -> str:
        return "nan" if math.isnan(v) else f"{v:.3f}"

    return (
        f"ttft_p50_ratio_vs_pull={f(x)} ttft_p50_ratio_vs_vllm_push={f(y)} "
        f"tpot_p50_ratio_vs_pull={f(z)}",
        best,
    )


def plot(cfg: BenchConfig, all_runs: dict[str, dict[str, SystemRun]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(all_runs)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6.4 * len(scenarios), 4.6), squeeze=False)
    styles = {
        "pull": "o-",
        "vllm-push": "s-",
        "pushkv": "D-",
        "single": "x--",
        "pull-noprog": "o:",
        "vllm-push-noprog": "s:",
    }
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for system, run in all_runs[scenario].items():
            if run.error or not run.rates:
                continue
            xs = [r.rate for r in run.rates]
            ys = [r.ttft_ms["p50"] for r in run.rates]
            style = styles.get(system, "o-")
            if system == "single":
                ax.plot(xs, ys, style, color="black", label=system)
            else:
                ax.plot(xs, ys, style, label=system)
            bad = [r for r in run.rates if not r.sustained and not math.isnan(r.ttft_ms["p50"])]
            ax.scatter(
                [r.rate for r in bad],
                [r.ttft_ms["p50"] for r in bad],
                s=170,
                facecolors="none",
                edgecolors="red",
                linewidths=1.2,
            )
        ax.set_title(f"{scenario}: {SCENARIO_LABELS[scenario]}", fontsize=9)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"TTFT p50 vs rate; Llama {cfg.layers}L h{cfg.hidden} fp32, prompts "
        f"{cfg.min_prompt}-{cfg.max_prompt} tok, {cfg.output_len} out\n"
        "P core 0, D core 1 (single: core 0); red ring: rate not sustained",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =============================================================== entry point


def _setting(ap: argparse.ArgumentParser, kv: str) -> tuple[str, str]:
    key, sep, value = kv.partition("=")
    if not sep or not key:
        ap.error(f"--pushkv-setting wants KEY=VALUE, not {kv!r}")
    return key, value


def _parse(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        prog="pushkv bench serving",
        description="pushkv vs vLLM NixlConnector (pull) vs vLLM NixlPushConnector vs one "
        "engine, on real vLLM servers (P core 0, D core 1).",
    )
    ap.add_argument("--quick", action="store_true", help="a <10 min run: nocache scenario only")
    ap.add_argument("--out", type=Path, help="write all raw figures to DIR/bench_serving.json")
    ap.add_argument("--plot", type=Path, default=Path("docs/bench_ttft.png"))
    ap.add_argument("--rates", type=str, help="comma-separated request rates (req/s)")
    ap.add_argument(
        "--systems", type=str, help=f"comma-separated, from {SYSTEMS + CONTROLS}; default {SYSTEMS}"
    )
    ap.add_argument("--scenarios", type=str, help=f"comma-separated subset of {SCENARIOS}")
    ap.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    ap.add_argument("--min-requests", type=int, help="requests per rate at least")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=256)
    ap.add_argument("--max-prompt", type=int, default=3072)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--timeout", type=float, help="per-request timeout (s)")
    ap.add_argument("--kv-lease", type=int, help="vLLM NIXL kv_lease_duration (default: vLLM's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pushkv-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a pushkv kv_connector_extra_config setting (repeatable), e.g. "
        "idle_wait_ms=0; default: the connector's own defaults",
    )
    ap.add_argument("--model-dir", type=Path, help="default .cache/bench-model-<shape>")
    ap.add_argument(
        "--pin",
        choices=("workers", "engines"),
        default="workers",
        help="core layout, the same for every system: bind only each engine's worker "
        "threads to its core (default), or every process of the engine (API server, "
        "EngineCore, worker)",
    )
    ap.add_argument(
        "--vllm-spin-ms",
        type=float,
        default=None,
        help="bound vLLM's shm message queues' busy-poll after each read to this many ms "
        f"(vLLM 0.32 hard-codes 1000), for every system alike, through a sitecustomize "
        f"shim; at least {MIN_SPIN_MS:g}. Default: vLLM's own. A diagnostic: a short "
        "poll gave requests 5 s stalls (vLLM's shm reader recheck; docs/benchmarks.md)",
    )
    a = ap.parse_args(argv)
    if a.vllm_spin_ms is not None and a.vllm_spin_ms < MIN_SPIN_MS:
        ap.error(f"--vllm-spin-ms must be at least {MIN_SPIN_MS:g}")
    quick = bool(a.quick)
    rates = (
        tuple(float(x) for x in a.rates.split(","))
        if a.rates
        else ((1.0, 2.0) if quick else (0.5, 1.0, 1.5, 2.0, 3.0))
    )
    systems = tuple(a.systems.split(",")) if a.systems else SYSTEMS
    scenarios = (
        tuple(a.scenarios.split(",")) if a.scenarios else (("nocache",) if quick else SCENARIOS)
    )
    for s in systems:
        if s not in SYSTEMS + CONTROLS:
            ap.error(f"unknown system {s!r}; known: {SYSTEMS + CONTROLS}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; known: {SCENARIOS}")
    max_pos = 1 << math.ceil(math.log2(a.max_prompt + a.output_len + 1))
    model_dir = a.model_dir or Path(f".cache/bench-model-l{a.layers}-h{a.hidden}-p{max_pos}")
    cfg = BenchConfig(
        model_dir=model_dir,
        layers=a.layers,
        hidden=a.hidden,
        block_size=a.block_size,
        min_prompt=a.min_prompt,
        max_prompt=a.max_prompt,
        output_len=a.output_len,
        rates=rates,
        duration_s=a.duration if a.duration is not None else (15.0 if quick else 20.0),
        min_requests=a.min_requests if a.min_requests is not None else 30,
        timeout_s=a.timeout if a.timeout is not None else (60.0 if quick else 120.0),
        max_num_seqs=a.max_num_seqs,
        seed=a.seed,
        kv_lease_s=a.kv_lease,
        pushkv_extra=tuple(_setting(ap, kv) for kv in a.pushkv_setting),
        systems=systems,
        scenarios=scenarios,
        quick=quick,
        startup_timeout_s=150.0 if quick else 300.0,
        pin=a.pin,
        vllm_spin_ms=a.vllm_spin_ms,
    )
    return cfg, a


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "proxy":
        return proxy_main(args[1:])
    cfg, a = _parse(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: blocks
    t0 = time.monotonic()
    from harness.tiny_model import build_tiny_model

    max_pos = 1 << math.ceil(math.log2(cfg.max_model_len))
    build_tiny_model(cfg.model_dir, layers=cfg.layers, hidden=cfg.hidden, max_positions=max_pos)
    _say(
        f"core layout: --pin {cfg.pin}; vLLM shm queue busy-poll: "
        + (
            f"{cfg.vllm_spin_ms:g} ms (--vllm-spin-ms), every system"
            if cfg.vllm_spin_ms is not None
            else "vLLM's own (1 s)"
        )
        + "; "
        f"model {cfg.model_dir}: Llama {cfg.layers} layers, hidden {cfg.hidden}, fp32, block "
        f"{cfg.block_size}; prompts {cfg.min_prompt}-{cfg.max_prompt} tokens, "
        f"{cfg.output_len} output tokens; rates {cfg.rates}; systems {cfg.systems}; "
        f"scenarios {cfg.scenarios}"
    )
    all_runs: dict[str, dict[str, SystemRun]] = {}
    for scenario in cfg.scenarios:
        all_runs[scenario] = {}
        for system in cfg.systems:
            all_runs[scenario][system] = run_system(cfg, system, scenario)
    lines = report(cfg, all_runs)
    for line in lines:
        _say(line)
    primary = all_runs.get("nocache") or next(iter(all_runs.values()))
    last, best = final_line(cfg, primary)
    try:
        plot(cfg, all_runs, a.plot)
        _say(f"plot: {a.plot}")
    except Exception as exc:  # a missing matplotlib must not lose the figures
        _say(f"plot not written: {type(exc).__name__}: {exc}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        dump = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "wall_s": round(time.monotonic() - t0, 1),
            "comparison_rate": best,
            "final_line": last,
            "runs": {
                sc: {sy: asdict(r) for sy, r in runs.items()} for sc, runs in all_runs.items()
            },
        }
        path = a.out / "bench_serving.json"
        path.write_text(json.dumps(dump, indent=1, default=str))
        _say(f"raw figures: {path}")
    primary_name = "nocache" if "nocache" in all_runs else next(iter(all_runs))
    if highest_common_rate(primary, cfg.rates) is None:
        primary_name += "; no rate was sustained by all compared systems: lowest rate used"
    _say(f"wall time {time.monotonic() - t0:.0f} s; ratios taken at {best} req/s ({primary_name})")
    _say(last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
