"""The serving benchmark's systems, scenarios and run settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

SYSTEMS: Final = ("pull", "vllm-push", "pushkv", "single")
# Controls, run only when named in --systems: vLLM's NIXL connectors with NIXL's
# progress thread switched off (not vLLM's default; see vllm_patches.no_progress_thread).
# "pushkv-whole": pushkv with --arm-orders false, the coordinator orders each
# WRITE once both sides reported (the whole-request push armed orders improve on).
CONTROLS: Final = ("pull-noprog", "vllm-push-noprog", "pushkv-whole")
COMPARED: Final = ("pull", "vllm-push", "pushkv")  # "sustained by all systems" uses these
LABELS: Final = {
    "pull": "vLLM NixlConnector (pull, sequential proxy)",
    "vllm-push": "vLLM NixlPushConnector (concurrent dispatch)",
    "pushkv": "pushkv (connector + coordinator + router)",
    "single": "single engine (no disaggregation)",
    "pull-noprog": "control: pull with NIXL's progress thread off",
    "vllm-push-noprog": "control: vLLM push with NIXL's progress thread off",
    "pushkv-whole": "control: pushkv ordering after prefill done (--arm-orders false)",
}
SCENARIOS: Final = ("nocache", "prefixhit")  # the rate scenarios
# One streamed request at a time, pushkv against one engine: TTFT, the time to
# the second token and the decode handover (pushkv/bench/serving/first_token.py).
# It runs alone: its own model, systems and load.
FIRST_TOKEN: Final = "first-token"
ALL_SCENARIOS: Final = (*SCENARIOS, FIRST_TOKEN)
SCENARIO_LABELS: Final = {
    "nocache": "prefix caching off (transfer isolated)",
    "prefixhit": "prefix caching on, decode side warmed: full prefix hit",
    FIRST_TOKEN: "one streamed request at a time, prefix caching off: the first two tokens",
}
PREFILL_ENGINE_ID: Final = "prefill-0"
DECODE_ENGINE_ID: Final = "decode-0"
SUSTAINED_FRACTION: Final = 0.85  # achieved / offered throughput, with no failures
MIN_SPIN_MS: Final = 1.0  # 0 hung a server's first request in a trial
# With --prefill-tp 2 (prefill TP2 into decode TP1): the systems whose connector
# takes a prefill engine of another TP size than the decode engine's. "single"
# stays one TP1 engine, the reference.
HETERO_TP_SYSTEMS: Final = ("pull", "pushkv", "single")
HETERO_TP_CONTROLS: Final = ("pushkv-whole",)  # run only when named
PREFILL_TPS: Final = (1, 2)
# The pushkv coordinator's settings for a TP2 prefill engine, as
# tests/test_tp_hetero_vllm.py: its workers busy-poll vLLM's shm queues on 2
# oversubscribed cores, and a starved agent's heartbeat or a starved rank's DONE
# report may come later than the default lease (5 s) and write timeout (15 s).
TP2_COORDINATOR_FLAGS: Final = ("--lease-s", "20", "--write-timeout-s", "60")


def topology(prefill_tp: int) -> str:
    """The engines' layout, as the report states it."""
    if prefill_tp == 1:
        return "prefill TP1 (core 0) into decode TP1 (core 1); single engine TP1 (core 0)"
    return (
        f"prefill TP{prefill_tp} (ranks' workers on cores 0|1) into decode TP1 (core 1): "
        f"{prefill_tp + 1} worker processes on 2 cores; single engine TP1 (core 0)"
    )


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
    # vLLM's shm queue busy-poll window (vllm_patches.bound_shm_spin), every system
    # alike; None: vLLM's own (1 s).
    vllm_spin_ms: float | None = None
    # The fault scenario (pushkv/bench/serving/fault.py): kill -9 the prefill engine this
    # many seconds into the load (pushkv only, one rate); None: no fault.
    kill_prefill_at_s: float | None = None
    # Tensor parallel size of the prefill engine of the disaggregated systems; the
    # decode engine and the single engine are TP1.
    prefill_tp: int = 1
    # Every engine's step budget (--max-num-batched-tokens): prompts longer
    # than it are prefilled in chunks (pushkv: progressive push); None: the
    # harness's, which takes any prompt of the run whole.
    step_tokens: int | None = None
    # --link: the emulated two-node link's rate (bit/s) for the link phase
    # (pushkv/bench/serving/linked.py); None: no link, the usual run.
    link_rate_bit: int | None = None
    # --link: the loopback phase's rate (pushkv against the single engine).
    low_rate: float = 0.5

    @property
    def max_model_len(self) -> int:
        need = self.max_prompt + self.output_len + 1
        return -(-need // self.block_size) * self.block_size

    def requests_for(self, rate: float) -> int:
        return max(self.min_requests, round(rate * self.duration_s))
