"""The hooks benchmark's settings, its workload, and the vLLM objects it builds
(through ``pushkv/harness/offline.py``, as the tests' harness does)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Final

from pushkv.harness import offline

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
    "pushkv": ("PushKVConnector", "pushkv.vllm_integration.connector"),
    "floor": ("FloorConnector", "pushkv.bench.floor_connector"),
}
# Hooks vLLM calls once (or twice) per request that starts or finishes in a step.
PER_REQUEST_HOOKS: Final = frozenset(
    {"get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"}
)


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


def prompt(cfg: HookConfig, i: int) -> list[int]:
    """Request ``i``'s prompt (seeded): the same on both engines."""
    rng = random.Random(f"{cfg.seed}/{i}")
    return [rng.randrange(4, 1024) for _ in range(rng.randint(cfg.min_prompt, cfg.max_prompt))]


def vllm_config(cfg: HookConfig, role: str, engine_id: str) -> Any:
    """The engine's ``VllmConfig``, with the connector under test in ``role``."""
    # In-process engines: no HTTP server, no router, so no api_url.
    extra: dict[str, Any] = {"coordinator": cfg.coordinator, "routable": False}
    if cfg.idle_wait_ms is not None:
        extra["idle_wait_ms"] = cfg.idle_wait_ms
    name, module = CONNECTORS[cfg.connector]
    return offline.vllm_config(
        cfg.model_dir,
        connector_name=name,
        connector_module=module,
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config=extra,
        block_size=cfg.block_size,
        enable_prefix_caching=False,
        max_num_seqs=cfg.inflight,
        max_num_batched_tokens=cfg.max_batched_tokens,
        max_model_len=cfg.max_prompt + cfg.output_len + cfg.block_size,
    )


def request(cfg: HookConfig, vllm_config: Any, rid: str, prompt: list[int], params: Any) -> Any:
    """A prefill leg (one token) or a decode leg (``output_len``), by its transfer params."""
    prefill = bool(params.get("do_remote_decode"))
    return offline.request(
        rid,
        prompt,
        vllm_config,
        max_tokens=1 if prefill else cfg.output_len,
        kv_transfer_params=params,
    )
