"""One engine of the hooks benchmark: a real vLLM scheduler with the connector
under test in one process (EngineCore) and its worker half in another, driven
step by step as vLLM drives them, every hook call timed."""

from __future__ import annotations

import cProfile
import importlib
import multiprocessing as mp
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pushkv.agent.nixl_adapter import quiet_nixl_env
from pushkv.bench.children import reap
from pushkv.bench.hooks.config import (
    CONNECTORS,
    SCHED_HOOKS,
    WORKER_HOOKS,
    HookConfig,
    arrival_times,
    prompt,
    request,
    vllm_config,
)
from pushkv.bench.hooks.timer import HookTimer
from pushkv.harness import offline


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


def _gc_policy(cfg: HookConfig) -> None:
    if cfg.gc_off:
        import gc

        gc.disable()


def quiet_env() -> None:
    """NIXL and UCX quiet, UCX on loopback (this process and the ones it starts)."""
    os.environ.update(quiet_nixl_env(loopback=True))


def _engine(cfg: HookConfig, role: str, out: Any) -> None:  # EngineCore: a child process
    quiet_env()
    figures = EngineFigures(role)
    try:
        _engine_loop(cfg, role, figures)
    except Exception as exc:  # reported to the parent, which prints it
        figures.error = f"{type(exc).__name__}: {exc}"
    out.put(figures)


def _worker(cfg: HookConfig, role: str, conn: Any) -> None:  # the worker: another process
    """Worker half over real KV tensors; one message per engine step, like vLLM's executor."""
    quiet_env()
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.gc_utils import freeze_gc_heap

    prefill = role == "prefill"
    vcfg = vllm_config(
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
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    prefill = role == "prefill"
    vcfg = vllm_config(
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
                req = request(cfg, vcfg, f"{role[0]}-{next_i}", prompt(cfg, next_i), params)
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
            sched.update_from_output(
                so, offline.runner_output(sched, so, kv_connector_output=kv_out)
            )
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
        reap([wproc], 30)


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
        reap(procs, 30)
    figs.sort(key=lambda f: f.role != "prefill")
    return figs
