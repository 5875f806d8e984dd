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

Closed loop: each engine keeps ``--inflight`` requests (default 256) in flight
until ``--requests`` transfers have completed. Every hook call is timed with
``time.perf_counter_ns``; per engine step the scheduler-side and worker-side
totals are kept apart and summed. Steps are split into busy steps (tokens
scheduled: the forward waits for them) and idle steps (nothing scheduled; the
worker's ``get_finished`` may then wait up to ``idle_wait_ms`` for an agent
event on purpose, instead of letting the engine spin).

Differences from a real engine, all pessimistic for pushkv: the scheduler and
worker halves share one process and one GIL (in vLLM, EngineCore and the
worker are separate processes), and this box has 2 cores for both engines, the
coordinator and anything else running.

Usage: ``python -m vllm_integration.bench_hooks [--inflight 256] [--requests 1024]``
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

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
    "get_finished",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
)
GOAL_US: Final = 50.0


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
    output_len: int = 16
    block_size: int = 32
    num_blocks: int = 8192
    forward_ms: float = 5.0
    idle_wait_ms: float | None = None  # None: the connector's default
    deadline_s: float = 180.0
    seed: int = 0


class HookTimer:
    """Wraps a connector's methods; records every call and per-step totals.

    Only outermost calls count towards the step total (get_transfer_results
    calls get_finished inside)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = defaultdict(list)
        self.step_ns = 0
        self._depth = 0

    def wrap(self, obj: Any, names: Sequence[str]) -> None:
        for name in names:
            fn = getattr(obj, name)
            setattr(obj, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        calls = self.calls[name]

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                d = time.perf_counter_ns() - t
                self._depth -= 1
                calls.append(d)
                if self._depth == 0:
                    self.step_ns += d

        return timed

    def take_step(self) -> int:
        ns, self.step_ns = self.step_ns, 0
        return ns


# ---------------------------------------------------------------- vLLM builders
# (the same construction as tests/vllm_harness.py, kept here so the benchmark
# does not import the test tree)


def _vllm_config(cfg: HookConfig, role: str, engine_id: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    max_len = cfg.max_prompt + cfg.output_len + cfg.block_size
    extra: dict[str, Any] = {"coordinator": cfg.coordinator}
    if cfg.idle_wait_ms is not None:
        extra["idle_wait_ms"] = cfg.idle_wait_ms
    return VllmConfig(
        model_config=ModelConfig(
            model=cfg.model_dir,
            tokenizer=cfg.model_dir,
            dtype="float32",
            max_model_len=max_len,
            seed=0,
            enforce_eager=True,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=cfg.inflight,
            max_num_batched_tokens=16384,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=cfg.block_size, enable_prefix_caching=False, cache_dtype="auto"
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PushKVConnector",
            kv_connector_module_path="vllm_integration.connector",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )


def _kv_cache_config(vllm_config: Any, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = vllm_config.model_config
    layers = mc.get_num_layers(vllm_config.parallel_config)
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(),
        dtype=torch.float32,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def _prompt(cfg: HookConfig, i: int) -> list[int]:
    rng = random.Random(f"{cfg.seed}/{i}")
    return [rng.randrange(4, 1024) for _ in range(rng.randint(cfg.min_prompt, cfg.max_prompt))]


def _request(cfg: HookConfig, vllm_config: Any, rid: str, prompt: list[int], params: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    is_prefill = bool(params.get("do_remote_decode"))
    sp = SamplingParams(
        max_tokens=1 if is_prefill else cfg.output_len,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": dict(params)},
    )
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(vllm_config.cache_config.block_size, hash_fn),
    )


# ---------------------------------------------------------------- one engine


@dataclass
class EngineFigures:
    role: str
    calls: dict[str, list[int]] = field(default_factory=dict)
    sched_busy: list[int] = field(default_factory=list)
    sched_idle: list[int] = field(default_factory=list)
    worker_busy: list[int] = field(default_factory=list)
    worker_idle: list[int] = field(default_factory=list)
    total_busy: list[int] = field(default_factory=list)
    total_idle: list[int] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    max_inflight: int = 0
    wall_s: float = 0.0
    error: str = ""


def _engine(cfg: HookConfig, role: str, out: Any) -> None:  # runs in a child process
    os.environ.update({"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error", "UCX_NET_DEVICES": "lo"})
    figures = EngineFigures(role)
    try:
        _engine_loop(cfg, role, figures)
    except Exception as exc:  # reported to the parent, which prints it
        figures.error = f"{type(exc).__name__}: {exc}"
    out.put(figures)


def _engine_loop(cfg: HookConfig, role: str, fig: EngineFigures) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_integration.connector import PushKVConnector

    prefill = role == "prefill"
    engine_id = f"hooks-{role}-{cfg.run_id}"
    vcfg = _vllm_config(cfg, "kv_producer" if prefill else "kv_consumer", engine_id)
    kv_cfg = _kv_cache_config(vcfg, cfg.num_blocks)
    vcfg.cache_config.num_gpu_blocks = cfg.num_blocks

    # Worker half first (as in vLLM): real KV tensors in the CPU layout, real agent.
    worker = PushKVConnector(vcfg, KVConnectorRole.WORKER, kv_cfg)
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

    sched = Scheduler(
        vllm_config=vcfg,
        kv_cache_config=kv_cfg,
        structured_output_manager=StructuredOutputManager(vcfg),
        block_size=cfg.block_size,
        hash_block_size=cfg.block_size,
        log_stats=True,
    )
    conn = sched.connector
    if not isinstance(conn, PushKVConnector):
        raise TypeError(f"scheduler built {type(conn).__name__}, not PushKVConnector")
    st, wt = HookTimer(), HookTimer()
    st.wrap(conn, SCHED_HOOKS)
    wt.wrap(worker, WORKER_HOOKS)
    layer_names = list(caches)

    side = "do_remote_decode" if prefill else "do_remote_prefill"
    next_i = 0
    live: dict[str, Any] = {}  # request id -> Request, until the scheduler lets go of it
    t0 = time.monotonic()
    deadline = t0 + cfg.deadline_s
    while fig.completed + fig.failed < cfg.requests and time.monotonic() < deadline:
        while len(sched.requests) < cfg.inflight and next_i < cfg.requests:
            tid = f"tx-{cfg.run_id}-{next_i}"
            req = _request(
                cfg,
                vcfg,
                f"{role[0]}-{next_i}",
                _prompt(cfg, next_i),
                {
                    side: True,
                    "transfer_id": tid,
                },
            )
            sched.add_request(req)
            live[req.request_id] = req
            next_i += 1
        fig.max_inflight = max(fig.max_inflight, len(sched.requests))

        so = sched.schedule()
        busy = so.total_num_scheduled_tokens > 0
        # ---- worker (as _get_kv_connector_output)
        worker.bind_connector_metadata(so.kv_connector_metadata)
        if busy:
            for name in layer_names:
                worker.wait_for_layer_load(name)
            time.sleep(cfg.forward_ms / 1000)  # the forward; the GIL is free meanwhile
            for name in layer_names:
                worker.save_kv_layer(name, caches[name], None)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(so.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        w_ns = wt.take_step()
        kv_out = KVConnectorOutput(
            finished_sending=set(results.finished_sending) or None,
            finished_recving=set(results.finished_recving) or None,
            failed_recving=set(results.failed_recving),
            invalid_block_ids=set(invalid),
        )
        # ---- the model: one token for every request whose prompt is complete
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [100] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
            for r in req_ids
        ]
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        sched.update_from_output(so, mro)
        s_ns = st.take_step()
        for rid in [r for r in live if r not in sched.requests]:
            if live.pop(rid).status == RequestStatus.FINISHED_ERROR:
                fig.failed += 1
            else:
                fig.completed += 1
        if busy:
            fig.sched_busy.append(s_ns)
            fig.worker_busy.append(w_ns)
            fig.total_busy.append(s_ns + w_ns)
        else:
            fig.sched_idle.append(s_ns)
            fig.worker_idle.append(w_ns)
            fig.total_idle.append(s_ns + w_ns)
            time.sleep(0.001)  # EngineCore sleeps 1 ms after a step that ran no model
    fig.wall_s = time.monotonic() - t0
    fig.calls = dict(st.calls) | dict(wt.calls)
    sched.shutdown()
    worker.shutdown()


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


def report(figs: Sequence[EngineFigures]) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for f in figs:
        lines.append("")
        lines.append(
            f"## {f.role} engine: {f.completed} requests completed, {f.failed} failed, "
            f"up to {f.max_inflight} in flight, {f.wall_s:.1f} s"
            + (f"  ERROR: {f.error}" if f.error else "")
        )
        lines.append("| hook | calls | p50 (µs) | p99 (µs) | max (µs) |")
        lines.append("|---|---|---|---|---|")
        for name in (*SCHED_HOOKS, *WORKER_HOOKS):
            calls = f.calls.get(name, [])
            if not calls:
                continue
            lines.append(
                f"| {name} | {len(calls)} | {_us(pct(calls, 50))} | {_us(pct(calls, 99))} "
                f"| {_us(max(calls))} |"
            )
        lines.append("")
        lines.append("| per engine step | steps | p50 (µs) | p99 (µs) | max (µs) |")
        lines.append("|---|---|---|---|---|")
        s: dict[str, Any] = {}
        for label, xs in (
            ("scheduler hooks, busy steps", f.sched_busy),
            ("worker hooks, busy steps", f.worker_busy),
            ("all hooks, busy steps", f.total_busy),
            ("scheduler hooks, idle steps", f.sched_idle),
            ("worker hooks, idle steps (incl. idle wait)", f.worker_idle),
            ("all hooks, idle steps", f.total_idle),
        ):
            lines.append(
                f"| {label} | {len(xs)} | {_us(pct(xs, 50))} | {_us(pct(xs, 99))} "
                f"| {_us(max(xs) if xs else math.nan)} |"
            )
            s[label] = {
                "steps": len(xs),
                "p50_us": pct(xs, 50) / 1000,
                "p99_us": pct(xs, 99) / 1000,
            }
        summary[f.role] = s
    return lines, summary


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_integration.bench_hooks",
        description="Time the pushkv connector's hooks on vLLM's engine thread (real "
        "Scheduler, real coordinator, real agents) with many requests in flight.",
    )
    ap.add_argument("--inflight", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--forward-ms", type=float, default=5.0)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument(
        "--idle-wait-ms", type=float, default=None, help="connector idle_wait_ms (default: its own)"
    )
    ap.add_argument("--deadline", type=float, default=180.0)
    ap.add_argument("--out", type=Path, help="write raw figures to DIR/bench_hooks.json")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))

    from controlplane.launch import CoordinatorProcess
    from vllm_integration.tiny_model import build_tiny_model

    model = build_tiny_model(Path(".cache/tiny-model"))
    t0 = time.monotonic()
    with CoordinatorProcess("--log-level", "WARNING") as coord:
        cfg = HookConfig(
            model_dir=str(model.resolve()),
            coordinator=coord.address,
            run_id=f"{os.getpid()}",
            inflight=a.inflight,
            requests=a.requests,
            forward_ms=a.forward_ms,
            output_len=a.output_len,
            idle_wait_ms=a.idle_wait_ms,
            deadline_s=a.deadline,
        )
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
    _say(
        f"pushkv connector hooks: {cfg.inflight} requests in flight per engine, "
        f"{cfg.requests} transfers, prompts {cfg.min_prompt}-{cfg.max_prompt} tokens, block "
        f"{cfg.block_size}, simulated forward {cfg.forward_ms} ms; "
        f"{time.monotonic() - t0:.0f} s"
    )
    lines, summary = report(figs)
    for line in lines:
        _say(line)
    worst = max((s["all hooks, busy steps"]["p99_us"] for s in summary.values()), default=math.nan)
    _say("")
    _say(
        f"hooks_p99_us_per_busy_step={worst:.1f} (goal <= {GOAL_US:.0f}: "
        f"{'met' if worst <= GOAL_US else 'missed'})"
    )
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        dump = {"config": cfg.__dict__, "summary": summary, "engines": [f.__dict__ for f in figs]}
        (a.out / "bench_hooks.json").write_text(json.dumps(dump, default=str))
    return 0 if all(not f.error for f in figs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
