"""Engine-loop cost of the pushkv connector: time its hooks spend on vLLM's engine thread.

Runs a prefill engine and a decode engine, each in its own process, each made of:

- a REAL vLLM 0.32 ``Scheduler`` (``KVCacheManager``, ``Request``, block hasher)
  whose KV connector, built by vLLM's ``KVConnectorFactory``, is
  ``PushKVConnector`` in the SCHEDULER role (with its coordinator client thread);
- a ``PushKVConnector`` in the WORKER role over real KV tensors in the CPU
  layout, whose embedded agent WRITEs the KV over NIXL/UCX for real;

against a real coordinator process. The model is played by this module: every
scheduled request whose prompt is complete samples one token, and a busy step
sleeps ``--forward-ms`` (the GIL is free then, as in a real forward). The
worker calls follow ``kv_connector_model_runner_mixin._get_kv_connector_output``:
bind metadata, start_load_kv, (forward), wait_for_save, get_transfer_results,
get_block_ids_with_load_errors, clear metadata; an empty step sleeps 1 ms as
``EngineCore`` does.

Two loads, both by default (``--load``):

- ``poisson``: open loop. Request i arrives at the i-th point of a Poisson
  process of ``--rate`` requests/s (seeded, the same schedule on both engines,
  as a router dispatching both legs at once would give), whether or not
  earlier ones have finished; ``--inflight`` is vLLM's ``max_num_seqs``. At the
  default rate (200/s) the decode engine runs about 190 requests, and a step sees
  the arrivals and departures a serving engine sees.
- ``closed``: each engine keeps ``--inflight`` requests in flight. Requests
  that start together finish together, so arrivals and departures come in
  waves of dozens per step: a stress test of the per-request hooks.

Each runs until ``--requests`` transfers have completed. Every hook call is timed with
``time.perf_counter_ns``; per engine step the scheduler-side and worker-side
totals are kept apart and summed. Steps are split into busy steps (tokens
scheduled: the forward waits for them) and idle steps (nothing scheduled; the
worker's ``get_finished`` may then wait up to ``idle_wait_ms`` for an agent
event on purpose, instead of letting the engine spin).

Each load runs twice, alternated: with pushkv, then with the floor connector
(``bench/floor_connector.py``: pushkv's request flow and no work),
so the report can tell vLLM's cost of calling any Python connector on this
machine from pushkv's own (``--connector`` runs one of them).

As in vLLM, each process freezes its start-up heap (``freeze_gc_heap``) before
the loop, so a full garbage collection does not rescan torch and vLLM.

Differences from a real engine, all pessimistic for pushkv: the scheduler and
worker halves share one process and one GIL (in vLLM, EngineCore and the
worker are separate processes), and this box has 2 cores for both engines, the
coordinator and anything else running.

Usage: ``python -m bench.hooks [--inflight 256] [--requests 1024]``
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import math
import multiprocessing as mp
import os
import pstats
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from harness import offline

SCHED_HOOKS: Final = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_HOOKS: Final = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
)
GOAL_US: Final = 50.0
# name -> (class, module). "floor" is the baseline: pushkv's request flow, no work.
CONNECTORS: Final = {
    "pushkv": ("PushKVConnector", "vllm_integration.connector"),
    "floor": ("FloorConnector", "bench.floor_connector"),
}
# Hooks vLLM calls once (or twice) per request that starts or finishes in a step.
PER_REQUEST_HOOKS: Final = frozenset(
    {"get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"}
)


def _say(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class HookConfig:
    model_dir: str
    coordinator: str
    run_id: str
    inflight: int = 256
    requests: int = 1024
    min_prompt: int = 64
    max_prompt: int = 600
    output_len: int = 128
    block_size: int = 32
    num_blocks: int = 8192
    forward_ms: float = 5.0
    max_batched_tokens: int = 4096
    idle_wait_ms: float | None = None  # None: the connector's default
    deadline_s: float = 180.0
    seed: int = 0
    profile_dir: str = ""
    rate: float = 0.0  # requests/s, Poisson (open loop); 0: closed loop
    # Diagnostic: no garbage collection in the engine and worker loops, to see
    # its share of the tail. vLLM runs with the collector on.
    gc_off: bool = False
    connector: str = "pushkv"  # a key of CONNECTORS


def arrival_times(cfg: HookConfig) -> list[float]:
    """Seconds after the start at which each request arrives (open loop)."""
    rng = random.Random(f"{cfg.seed}/arrivals")
    t, out = 0.0, []
    for _ in range(cfg.requests):
        out.append(t)
        t += rng.expovariate(cfg.rate)
    return out


class HookTimer:
    """Wraps a connector's methods; records every call and per-step totals.

    Only outermost calls count towards the step total (a hook may call another
    timed one)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = defaultdict(list)  # wall-clock ns per call
        self.cpu: dict[str, list[int]] = defaultdict(list)  # this thread's CPU ns per call
        self.step_ns = 0
        self.step_cpu_ns = 0
        self.step_request_calls = 0  # calls of per-request hooks this step
        self.step_parts: dict[str, int] = defaultdict(int)  # wall ns per hook this step
        self._depth = 0

    def wrap(self, obj: Any, names: Sequence[str]) -> None:
        for name in names:
            fn = getattr(obj, name)
            setattr(obj, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        calls, cpu = self.calls[name], self.cpu[name]
        per_request = name in PER_REQUEST_HOOKS

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            if per_request:
                self.step_request_calls += 1
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                d = time.perf_counter_ns() - t
                dc = time.thread_time_ns() - c
                cpu.append(dc)
                self._depth -= 1
                calls.append(d)
                if self._depth == 0:
                    self.step_ns += d
                    self.step_cpu_ns += dc
                    self.step_parts[name] += d

        return timed

    def take_parts(self) -> dict[str, int]:
        """Wall ns of this step's outermost calls, by hook; resets them."""
        out = dict(self.step_parts)
        self.step_parts.clear()
        return out

    def take_step(self) -> tuple[int, int]:
        """(wall ns, CPU ns) of this step's outermost hook calls; resets both."""
        out = (self.step_ns, self.step_cpu_ns)
        self.step_ns = self.step_cpu_ns = 0
        return out

    def take_request_calls(self) -> int:
        n, self.step_request_calls = self.step_request_calls, 0
        return n


# ---------------------------------------------------------------- vLLM builders
# (harness/offline.py, shared with the tests' harness)


def _vllm_config(cfg: HookConfig, role: str, engine_id: str) -> Any:
    extra: dict[str, Any] = {"coordinator": cfg.coordinator}
    if cfg.idle_wait_ms is not None:
        extra["idle_wait_ms"] = cfg.idle_wait_ms
    name, module = CONNECTORS[cfg.connector]
    return offline.vllm_config(
        cfg.model_dir,
        connector_name=name,
        connector_module=module,
        kv_role=role,
        engine_id=engine_id,
        extra_config=extra,
        block_size=cfg.block_size,
        enable_prefix_caching=False,
        max_num_seqs=cfg.inflight,
        max_num_batched_tokens=cfg.max_batched_tokens,
        max_model_len=cfg.max_prompt + cfg.output_len + cfg.block_size,
    )


def _prompt(cfg: HookConfig, i: int) -> list[int]:
    rng = random.Random(f"{cfg.seed}/{i}")
    return [rng.randrange(4, 1024) for _ in range(rng.randint(cfg.min_prompt, cfg.max_prompt))]


def _request(cfg: HookConfig, vllm_config: Any, rid: str, prompt: list[int], params: Any) -> Any:
    prefill = bool(params.get("do_remote_decode"))
    return offline.request(
        rid,
        prompt,
        vllm_config,
        max_tokens=1 if prefill else cfg.output_len,
        kv_transfer_params=params,
    )


# ---------------------------------------------------------------- one engine


@dataclass
class EngineFigures:
    role: str
    calls: dict[str, list[int]] = field(default_factory=dict)  # wall ns per call
    cpu: dict[str, list[int]] = field(default_factory=dict)  # thread CPU ns per call
    steps: dict[str, list[int]] = field(default_factory=dict)  # per-step totals, wall ns
    completed: int = 0
    failed: int = 0
    max_inflight: int = 0
    mean_inflight: float = 0.0  # over busy steps
    # per busy step: (wall ns of all hooks, per-request hook calls, wall ns by hook)
    busy_detail: list[tuple[int, int, dict[str, int]]] = field(default_factory=list)
    wall_s: float = 0.0
    error: str = ""


def _profiler(cfg: HookConfig) -> cProfile.Profile | None:
    """With --profile: a cProfile of this process's loop (its timings are then not figures)."""
    if not cfg.profile_dir:
        return None
    prof = cProfile.Profile()
    prof.enable()
    return prof


def _dump_profile(prof: cProfile.Profile | None, cfg: HookConfig, name: str) -> None:
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(Path(cfg.profile_dir) / f"{name}.pstats"))


def _print_profiles(directory: Path, top: int = 12) -> None:
    for path in sorted(directory.glob("*.pstats")):
        buf = io.StringIO()
        stats = pstats.Stats(str(path), stream=buf)
        stats.sort_stats("tottime").print_stats(r"vllm_integration|agent/|queue|threading", top)
        _say(f"\n### cProfile {path.stem} (tottime, pushkv and queue/threading frames)")
        body = buf.getvalue()
        start = body.find("   ncalls")
        _say(body[start:].rstrip() if start >= 0 else body.rstrip())


def _gc_policy(cfg: HookConfig) -> None:
    if cfg.gc_off:
        import gc

        gc.disable()


def _quiet_env() -> None:
    os.environ.update({"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error", "UCX_NET_DEVICES": "lo"})


def _engine(cfg: HookConfig, role: str, out: Any) -> None:  # EngineCore: a child process
    _quiet_env()
    figures = EngineFigures(role)
    try:
        _engine_loop(cfg, role, figures)
    except Exception as exc:  # reported to the parent, which prints it
        figures.error = f"{type(exc).__name__}: {exc}"
    out.put(figures)


def _worker(cfg: HookConfig, role: str, conn: Any) -> None:  # the worker: another process
    """Worker half over real KV tensors; one message per engine step, like vLLM's executor."""
    _quiet_env()
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.gc_utils import freeze_gc_heap

    prefill = role == "prefill"
    vcfg = _vllm_config(
        cfg, "kv_producer" if prefill else "kv_consumer", f"hooks-{role}-{cfg.run_id}"
    )
    kv_cfg = offline.kv_cache_config(vcfg, cfg.num_blocks)
    name, module = CONNECTORS[cfg.connector]
    worker = getattr(importlib.import_module(module), name)(vcfg, KVConnectorRole.WORKER, kv_cfg)
    mc = vcfg.model_config
    shape = (
        cfg.num_blocks,
        mc.get_num_kv_heads(vcfg.parallel_config),
        cfg.block_size,
        2 * mc.get_head_size(),
    )
    caches = {
        name: torch.zeros(shape, dtype=torch.float32)
        for name in kv_cfg.kv_cache_groups[0].layer_names
    }
    worker.register_kv_caches(caches)
    freeze_gc_heap()  # as vLLM's worker does once warmed up
    _gc_policy(cfg)
    timer = HookTimer()
    timer.wrap(worker, WORKER_HOOKS)
    conn.send("ready")
    prof = _profiler(cfg)
    try:
        while (msg := conn.recv()) is not None:
            meta, finished_req_ids, busy = msg
            # as kv_connector_model_runner_mixin._get_kv_connector_output
            worker.bind_connector_metadata(meta)
            if busy:
                for name in caches:
                    worker.wait_for_layer_load(name)
                time.sleep(cfg.forward_ms / 1000)  # the forward; the GIL is free meanwhile
                for name, layer in caches.items():
                    worker.save_kv_layer(name, layer, None)
            worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            conn.send(
                (
                    set(results.finished_sending),
                    set(results.finished_recving),
                    set(results.failed_recving),
                    set(invalid),
                    timer.take_step(),
                    timer.take_parts(),
                )
            )
        _dump_profile(prof, cfg, f"{role}-worker")
        conn.send((dict(timer.calls), dict(timer.cpu)))
    finally:
        worker.shutdown()


def _engine_loop(cfg: HookConfig, role: str, fig: EngineFigures) -> None:
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    prefill = role == "prefill"
    vcfg = _vllm_config(
        cfg, "kv_producer" if prefill else "kv_consumer", f"hooks-{role}-{cfg.run_id}"
    )

    # The worker (and its agent) comes up first, as in vLLM.
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    wproc = ctx.Process(target=_worker, args=(cfg, role, child), name=f"hooks-{role}-worker")
    wproc.start()
    try:
        if not conn.poll(120) or conn.recv() != "ready":
            raise TimeoutError("worker not ready in 120 s")
        sched = offline.scheduler(vcfg, cfg.num_blocks)
        freeze_gc_heap()  # as EngineCore.__init__ does once the scheduler is built
        _gc_policy(cfg)
        sconn = sched.connector
        if type(sconn).__name__ != CONNECTORS[cfg.connector][0]:
            raise TypeError(f"scheduler built {type(sconn).__name__}, not {cfg.connector}")
        st = HookTimer()
        st.wrap(sconn, SCHED_HOOKS)
        steps: dict[str, list[int]] = defaultdict(list)
        prof = _profiler(cfg)

        side = "do_remote_decode" if prefill else "do_remote_prefill"
        next_i = 0
        live: dict[str, Any] = {}  # request id -> Request, until the scheduler lets go of it
        arrivals = arrival_times(cfg) if cfg.rate > 0 else []
        inflight_sum = busy_steps = 0
        t0 = time.monotonic()
        deadline = t0 + cfg.deadline_s
        while fig.completed + fig.failed < cfg.requests and time.monotonic() < deadline:
            now = time.monotonic() - t0
            while next_i < cfg.requests and (
                arrivals[next_i] <= now if arrivals else len(sched.requests) < cfg.inflight
            ):
                params = {side: True, "transfer_id": f"tx-{cfg.run_id}-{next_i}"}
                req = _request(cfg, vcfg, f"{role[0]}-{next_i}", _prompt(cfg, next_i), params)
                sched.add_request(req)
                live[req.request_id] = req
                next_i += 1
            fig.max_inflight = max(fig.max_inflight, len(sched.requests))

            so = sched.schedule()
            busy = so.total_num_scheduled_tokens > 0
            conn.send((so.kv_connector_metadata, set(so.finished_req_ids), busy))
            if not conn.poll(60):
                raise TimeoutError("worker step took over 60 s")
            sending, recving, failed, invalid, (w_ns, w_cpu), w_parts = conn.recv()
            kv_out = KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                failed_recving=failed,
                invalid_block_ids=invalid,
            )
            # The model: one token for every request whose prompt is complete.
            req_ids = list(so.num_scheduled_tokens)
            sampled = [
                [100]
                if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                else []
                for r in req_ids
            ]
            mro = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_out,
            )
            sched.update_from_output(so, mro)
            s_ns, s_cpu = st.take_step()
            s_parts = st.take_parts()
            for rid in [r for r in live if r not in sched.requests]:
                if live.pop(rid).status == RequestStatus.FINISHED_ERROR:
                    fig.failed += 1
                else:
                    fig.completed += 1
            if busy:
                busy_steps += 1
                inflight_sum += len(sched.running)
            kind = "busy" if busy else "idle"
            steps[f"scheduler/{kind}"].append(s_ns)
            steps[f"worker/{kind}"].append(w_ns)
            steps[f"all/{kind}"].append(s_ns + w_ns)
            steps[f"all-cpu/{kind}"].append(s_cpu + w_cpu)
            n_req = st.take_request_calls()
            if busy:
                fig.busy_detail.append((s_ns + w_ns, n_req, s_parts | w_parts))
            if busy and n_req == 0:
                steps["all/busy-quiet"].append(s_ns + w_ns)
                steps["all-cpu/busy-quiet"].append(s_cpu + w_cpu)
            elif busy:
                steps["all/per-request-call"].append((s_ns + w_ns) // n_req)
                steps["all-cpu/per-request-call"].append((s_cpu + w_cpu) // n_req)
            if not busy:
                time.sleep(0.001)  # EngineCore sleeps 1 ms after a step that ran no model
        fig.wall_s = time.monotonic() - t0
        fig.mean_inflight = inflight_sum / busy_steps if busy_steps else 0.0
        _dump_profile(prof, cfg, f"{role}-scheduler")
        conn.send(None)
        if not conn.poll(30):
            raise TimeoutError("worker did not report its timings")
        w_calls, w_cpu = conn.recv()
        fig.calls = dict(st.calls) | w_calls
        fig.cpu = dict(st.cpu) | w_cpu
        fig.steps = dict(steps)
        sched.shutdown()
    finally:
        wproc.join(30)
        if wproc.is_alive():
            wproc.kill()
            wproc.join(5)


# ---------------------------------------------------------------- per call, in-process


def micro(model_dir: str, n: int = 4000, reps: int = 5) -> list[str]:
    """Warm per-call cost of the scheduler half's per-request hooks (µs).

    One process, real ``Request`` and ``KVCacheBlocks`` objects, no engine loop:
    the connector's coordinator calls are captured in a deque instead of sent,
    so only the hook's own Python is timed. Hooks that change state on their
    first call for a request are timed over one pass of fresh requests; the
    others are the best of `reps` passes."""
    lines = ["| engine | hook | µs per call |", "|---|---|---|"]
    for role in ("prefill", "decode"):
        lines += [
            f"| {role} | {name} | {us:.2f} |" for name, us in _micro_role(model_dir, role, n, reps)
        ]
    return lines


def _micro_role(model_dir: str, role: str, n: int, reps: int) -> list[tuple[str, float]]:
    import collections
    import gc

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    from vllm_integration.client import Call
    from vllm_integration.connector import PushKVConnector

    cfg = HookConfig(model_dir=model_dir, coordinator="127.0.0.1:9", run_id="micro")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    vcfg = _vllm_config(cfg, kv_role, f"micro-{role}")
    conn = PushKVConnector(vcfg, KVConnectorRole.SCHEDULER, offline.kv_cache_config(vcfg, 8192))
    half = conn._scheduler
    assert half is not None
    half.client.close(1.0)
    captured: collections.deque[Call] = collections.deque()
    half.client.submit = captured.append  # type: ignore[method-assign,assignment]
    side = "do_remote_decode" if role == "prefill" else "do_remote_prefill"
    reqs = [
        _request(cfg, vcfg, f"{role}-{i}", _prompt(cfg, i), {side: True, "transfer_id": f"t{i}"})
        for i in range(n)
    ]
    blocks = [
        KVCacheBlocks(([KVCacheBlock(j) for j in range(i % 100, i % 100 + 20)],)) for i in range(n)
    ]
    external = 0 if role == "prefill" else 1
    ids = list(range(10))

    def timed(fn: Callable[[int], Any], passes: int) -> float:
        best = math.inf
        for _ in range(passes):
            t = time.perf_counter_ns()
            for i in range(n):
                fn(i)
            best = min(best, (time.perf_counter_ns() - t) / n / 1000)
        return best

    gc.collect()
    gc.disable()
    try:
        rows = [
            (
                "get_num_new_matched_tokens",
                timed(lambda i: conn.get_num_new_matched_tokens(reqs[i], 0), reps),
            ),
            (
                "update_state_after_alloc (first call)",
                timed(lambda i: conn.update_state_after_alloc(reqs[i], blocks[i], external), 1),
            ),
            (
                "update_state_after_alloc (again)",
                timed(lambda i: conn.update_state_after_alloc(reqs[i], blocks[i], 0), reps),
            ),
        ]
        # As vLLM would: the decode legs' KV arrived, the prefill legs finished.
        conn.update_connector_output(
            type("Out", (), {"finished_recving": [r.request_id for r in reqs]})()
        )
        for r in reqs:
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        rows.append(("request_finished", timed(lambda i: conn.request_finished(reqs[i], ids), 1)))
        rows.append(("(the timing loop itself)", timed(lambda i: None, reps)))
    finally:
        gc.enable()
        conn.shutdown()
    return rows


# ---------------------------------------------------------------- reporting


def pct(values: Sequence[int], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _us(ns: float) -> str:
    return "nan" if math.isnan(ns) else f"{ns / 1000:.1f}"


STEP_ROWS: Final = (
    ("scheduler/busy", "scheduler hooks, busy steps"),
    ("worker/busy", "worker hooks, busy steps"),
    ("all/busy", "all hooks, busy steps (wall)"),
    ("all-cpu/busy", "all hooks, busy steps (thread CPU)"),
    ("scheduler/idle", "scheduler hooks, idle steps"),
    ("worker/idle", "worker hooks, idle steps (incl. the idle wait)"),
    ("all/idle", "all hooks, idle steps (wall)"),
    ("all-cpu/idle", "all hooks, idle steps (thread CPU)"),
    ("all/busy-quiet", "busy steps where no request started or finished (wall)"),
    ("all-cpu/busy-quiet", "busy steps where no request started or finished (thread CPU)"),
    ("all/per-request-call", "other busy steps, all hooks / per-request hook calls (wall)"),
    ("all-cpu/per-request-call", "other busy steps, all hooks / per-request hook calls (CPU)"),
)


def timer_overhead(n: int = 20_000) -> tuple[float, float]:
    """(wall ns, CPU ns) that HookTimer itself adds to one call: a timed no-op, median."""

    class _Noop:
        def hook(self) -> None:
            return None

    obj = _Noop()
    timer = HookTimer()
    timer.wrap(obj, ("hook",))
    for _ in range(n):
        obj.hook()
    return pct(timer.calls["hook"], 50), pct(timer.cpu["hook"], 50)


def _tail_breakdown(detail: Sequence[tuple[int, int, dict[str, int]]]) -> list[str]:
    """Where the slowest 1% of busy steps (at least 3) spent their hook time."""
    if not detail:
        return []
    ranked = sorted(detail, key=lambda d: d[0], reverse=True)
    tail = ranked[: max(3, len(ranked) // 100)]
    median = ranked[len(ranked) // 2]
    by_hook: dict[str, int] = defaultdict(int)
    for _, _, parts in tail:
        for name, ns in parts.items():
            by_hook[name] += ns
    total = sum(d[0] for d in tail) or 1
    top = sorted(by_hook.items(), key=lambda kv: kv[1], reverse=True)[:5]
    shares = ", ".join(f"{n} {100 * ns / total:.0f}%" for n, ns in top)
    return [
        "",
        f"slowest {len(tail)} busy steps: {_us(total / len(tail))} µs on average, "
        f"{sum(d[1] for d in tail) / len(tail):.1f} per-request hook calls each "
        f"(the median step: {median[1]}); by hook: {shares}",
    ]


def report(figs: Sequence[EngineFigures]) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for f in figs:
        lines.append("")
        lines.append(
            f"## {f.role} engine: {f.completed} requests completed, {f.failed} failed, "
            f"up to {f.max_inflight} in flight (running: {f.mean_inflight:.0f} on average "
            f"over busy steps), {f.wall_s:.1f} s" + (f"  ERROR: {f.error}" if f.error else "")
        )
        lines.append(
            "| hook | calls | wall p50 (µs) | wall p99 (µs) | wall max (µs) "
            "| CPU p50 (µs) | CPU p99 (µs) |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for name in (*SCHED_HOOKS, *WORKER_HOOKS):
            calls, cpu = f.calls.get(name, []), f.cpu.get(name, [])
            if not calls:
                continue
            lines.append(
                f"| {name} | {len(calls)} | {_us(pct(calls, 50))} | {_us(pct(calls, 99))} "
                f"| {_us(max(calls))} | {_us(pct(cpu, 50))} | {_us(pct(cpu, 99))} |"
            )
        lines.append("")
        lines.append("| per engine step | steps | p50 (µs) | p99 (µs) | max (µs) |")
        lines.append("|---|---|---|---|---|")
        s: dict[str, Any] = {}
        for key, label in STEP_ROWS:
            xs = f.steps.get(key, [])
            lines.append(
                f"| {label} | {len(xs)} | {_us(pct(xs, 50))} | {_us(pct(xs, 99))} "
                f"| {_us(max(xs) if xs else math.nan)} |"
            )
            s[key] = {"steps": len(xs), "p50_us": pct(xs, 50) / 1000, "p99_us": pct(xs, 99) / 1000}
        summary[f.role] = s
        lines.extend(_tail_breakdown(f.busy_detail))
    return lines, summary


def run_load(cfg: HookConfig) -> list[EngineFigures]:
    """Both engines (each with its worker process) under one load; prefill first."""
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_engine, args=(cfg, role, q), name=f"hooks-{role}")
        for role in ("prefill", "decode")
    ]
    for p in procs:
        p.start()
    figs: list[EngineFigures] = []
    try:
        for _ in procs:
            figs.append(q.get(timeout=cfg.deadline_s + 120))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    figs.sort(key=lambda f: f.role != "prefill")
    return figs


def _worst(summary: dict[str, Any], key: str) -> float:
    return max((s[key]["p99_us"] for s in summary.values()), default=math.nan)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.hooks",
        description="Time the pushkv connector's hooks on vLLM's engine thread (real "
        "Scheduler, real coordinator, real agents) with many requests in flight.",
    )
    ap.add_argument(
        "--load",
        choices=("both", "poisson", "closed"),
        default="both",
        help="open-loop Poisson arrivals, closed loop (waves), or both (default)",
    )
    ap.add_argument(
        "--rate", type=float, default=200.0, help="Poisson arrivals, requests/s (default 200)"
    )
    ap.add_argument(
        "--inflight",
        type=int,
        default=256,
        help="max_num_seqs; the closed loop keeps this many in flight (default 256)",
    )
    ap.add_argument("--requests", type=int, default=1024, help="transfers per load")
    ap.add_argument("--forward-ms", type=float, default=5.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument(
        "--idle-wait-ms", type=float, default=None, help="connector idle_wait_ms (default: its own)"
    )
    ap.add_argument("--deadline", type=float, default=180.0)
    ap.add_argument("--out", type=Path, help="write raw figures to DIR/bench_hooks.json")
    ap.add_argument(
        "--micro",
        action="store_true",
        help="only the warm per-call cost of the per-request hooks, in-process (~10 s)",
    )
    ap.add_argument(
        "--connector",
        choices=("both", "pushkv", "floor"),
        default="both",
        help="pushkv, the floor connector (pushkv's request flow with no work: what vLLM's "
        "calls into any Python connector cost here), or both, alternated (default)",
    )
    ap.add_argument(
        "--gc-off",
        action="store_true",
        help="diagnostic: no garbage collection in the engine and worker loops, to see "
        "its share of the tail (vLLM runs with it on; do not quote as the hooks' cost)",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        help="cProfile every engine and worker loop into DIR and print the top pushkv "
        "frames (the timings of such a run are inflated; do not quote them)",
    )
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.rate <= 0:
        ap.error("--rate must be > 0")

    from harness.coordinator import CoordinatorProcess
    from harness.tiny_model import build_tiny_model

    model = build_tiny_model(Path(".cache/tiny-model"))
    if a.micro:
        _quiet_env()
        for line in micro(str(model.resolve())):
            _say(line)
        return 0
    loads = ("poisson", "closed") if a.load == "both" else (a.load,)
    connectors = ("pushkv", "floor") if a.connector == "both" else (a.connector,)
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    wall_ns, cpu_ns = timer_overhead()
    results: dict[tuple[str, str], tuple[HookConfig, list[EngineFigures], dict[str, Any]]] = {}
    with CoordinatorProcess("--log-level", "WARNING") as coord:
        # Each load runs with pushkv, then right after with the floor (alternated).
        for load in loads:
            for connector in connectors:
                t0 = time.monotonic()
                cfg = HookConfig(
                    model_dir=str(model.resolve()),
                    coordinator=coord.address,
                    run_id=f"{os.getpid()}-{load}-{connector}",
                    inflight=a.inflight,
                    requests=a.requests,
                    forward_ms=a.forward_ms,
                    output_len=a.output_len,
                    max_batched_tokens=a.max_batched_tokens,
                    idle_wait_ms=a.idle_wait_ms,
                    deadline_s=a.deadline,
                    profile_dir=(
                        str((a.profile / f"{load}-{connector}").resolve()) if a.profile else ""
                    ),
                    rate=a.rate if load == "poisson" else 0.0,
                    gc_off=a.gc_off,
                    connector=connector,
                )
                if a.profile:
                    Path(cfg.profile_dir).mkdir(parents=True, exist_ok=True)
                figs = run_load(cfg)
                _say(_load_header(cfg, connector, time.monotonic() - t0))
                _say(
                    f"timer overhead of one timed call (a no-op, median): wall "
                    f"{wall_ns / 1000:.2f} µs, thread CPU {cpu_ns / 1000:.2f} µs; a step times "
                    "10-20 calls"
                )
                lines, summary = report(figs)
                for line in lines:
                    _say(line)
                _say("")
                results[(load, connector)] = (cfg, figs, summary)
                if a.profile:
                    _print_profiles(Path(cfg.profile_dir))
    summaries = {key: summary for key, (_, _, summary) in results.items()}
    for line in compare_lines(summaries, loads):
        _say(line)
    _say(final_line(summaries, loads))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        dump = {
            f"{load}/{connector}": {
                "config": cfg.__dict__,
                "summary": summary,
                "engines": [f.__dict__ for f in figs],
            }
            for (load, connector), (cfg, figs, summary) in results.items()
        }
        (a.out / "bench_hooks.json").write_text(json.dumps(dump, default=str))
    return 0 if all(not f.error for _, figs, _ in results.values() for f in figs) else 1


def _load_header(cfg: HookConfig, connector: str, took_s: float) -> str:
    how = (
        f"Poisson arrivals at {cfg.rate:g} requests/s (open loop), max_num_seqs {cfg.inflight}"
        if cfg.rate > 0
        else f"closed loop, {cfg.inflight} requests in flight per engine"
    )
    who = (
        "pushkv connector hooks"
        if connector == "pushkv"
        else "floor connector hooks (the baseline: pushkv's request flow, no work)"
    )
    load = "poisson" if cfg.rate > 0 else "closed"
    return (
        f"# load: {load}, {who}. {how}; {cfg.requests} transfers, "
        f"prompts {cfg.min_prompt}-{cfg.max_prompt} tokens, block {cfg.block_size}, "
        f"simulated forward {cfg.forward_ms} ms; {took_s:.0f} s"
        + ("; garbage collection OFF (diagnostic)" if cfg.gc_off else "")
    )


# (summary key, label) of the rows compared against the floor
COMPARED: Final = (
    ("all/busy", "busy steps, all hooks (wall)"),
    ("all/busy-quiet", "busy steps that start or finish no request (wall)"),
    ("scheduler/busy", "busy steps, scheduler hooks only (wall)"),
)


def compare_lines(
    summaries: dict[tuple[str, str], dict[str, Any]], loads: Sequence[str]
) -> list[str]:
    """pushkv against the floor connector, per load, engine and figure (µs)."""
    lines = [
        "## pushkv against the floor connector (same loop, run right after it; µs wall)",
        "| load | engine | steps | pushkv p50 / p99 | floor p50 / p99 | p99 ratio "
        "| pushkv's own p99 (pushkv - floor) |",
        "|---|---|---|---|---|---|---|",
    ]
    for load in loads:
        push, floor = summaries.get((load, "pushkv")), summaries.get((load, "floor"))
        if push is None or floor is None:
            continue
        for engine in ("prefill", "decode"):
            for key, label in COMPARED:
                p, f = push.get(engine, {}).get(key), floor.get(engine, {}).get(key)
                if not p or not f or math.isnan(p["p99_us"]) or math.isnan(f["p99_us"]):
                    continue  # e.g. no quiet steps on a prefill engine
                lines.append(
                    f"| {load} | {engine} | {label} | {p['p50_us']:.1f} / {p['p99_us']:.1f} "
                    f"| {f['p50_us']:.1f} / {f['p99_us']:.1f} "
                    f"| {_ratio(p['p99_us'], f['p99_us'])} | {p['p99_us'] - f['p99_us']:.1f} |"
                )
    return lines if len(lines) > 3 else []


def _ratio(a: float, b: float) -> str:
    return "nan" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def final_line(summaries: dict[tuple[str, str], dict[str, Any]], loads: Sequence[str]) -> str:
    """Per load: the worse engine's busy-step p99 with pushkv and with the floor."""
    parts, verdicts = [], []
    for load in loads:
        push, floor = summaries.get((load, "pushkv")), summaries.get((load, "floor"))
        fields = []
        if push is not None:
            worst = _worst(push, "all/busy")
            fields += [
                f"hooks_p99_us_per_busy_step={worst:.1f}",
                f"cpu_p99_us={_worst(push, 'all-cpu/busy'):.1f}",
            ]
            verdicts.append(f"{load} {'met' if worst <= GOAL_US else 'missed'}")
        if floor is not None:
            fields.append(f"floor_p99_us={_worst(floor, 'all/busy'):.1f}")
        parts.append(f"{load}: " + " ".join(fields))
    verdict = f"; goal <= {GOAL_US:.0f}: {', '.join(verdicts)}" if verdicts else ""
    return f"{'; '.join(parts)} (wall, worse engine{verdict})"


if __name__ == "__main__":
    raise SystemExit(main())
