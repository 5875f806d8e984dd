"""Real vLLM 0.32 scheduler objects, built in-process with no server and no model run.

`pushkv bench hooks` (pushkv/bench/hooks/) and the tests' harness
(tests/support/vllm_harness.py) build their engines here, so both run the same vLLM
construction: a ``VllmConfig`` for a local model directory, one full-attention
KV cache group over every decoder layer, a v1 ``Scheduler`` whose KV connector
``KVConnectorFactory`` builds, ``Request``s with the engine's block hasher, and
the ``ModelRunnerOutput`` of a played model (one fixed token per finished prompt).

vLLM is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

SAMPLED_TOKEN = 100  # what the played model samples; not EOS (id 0) in the tiny model


def vllm_config(
    model_dir: Path | str,
    *,
    connector_name: str,
    connector_module: str | None,
    kv_role: str,
    engine_id: str | None = None,
    kv_connector_extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str | None = None,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 1024,
) -> VllmConfig:
    """A CPU ``VllmConfig`` (fp32, eager, chunked prefill) with a KV connector.

    ``connector_module=None`` picks ``connector_name`` from vLLM's own registry
    (e.g. ``"NixlConnector"``) instead of an out-of-tree module.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    kv: dict[str, Any] = {
        "kv_connector": connector_name,
        "kv_role": kv_role,
        "kv_connector_extra_config": dict(kv_connector_extra_config or {}),
    }
    if connector_module is not None:
        kv["kv_connector_module_path"] = connector_module
    if engine_id is not None:
        kv["engine_id"] = engine_id
    if kv_load_failure_policy is not None:
        kv["kv_load_failure_policy"] = kv_load_failure_policy
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype="float32",
            max_model_len=max_model_len,
            seed=0,
            enforce_eager=True,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            cache_dtype="auto",
        ),
        kv_transfer_config=KVTransferConfig(**kv),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(config: VllmConfig, num_blocks: int = 256) -> KVCacheConfig:
    """One ``FullAttentionSpec`` group covering every decoder layer of the model."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = config.model_config
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=mc.get_num_kv_heads(config.parallel_config),
        head_size=mc.get_head_size(),
        dtype=torch.float32,
    )
    layers = mc.get_num_layers(config.parallel_config)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def scheduler(config: VllmConfig, num_blocks: int = 256, *, log_stats: bool = True) -> Scheduler:
    """A real v1 ``Scheduler`` over ``num_blocks`` blocks; its connector (the
    SCHEDULER role) is ``scheduler.connector``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    block_size = config.cache_config.block_size
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(config, num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=log_stats,
    )


def request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    config: VllmConfig,
    *,
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    eos_token_id: int | None = None,
) -> Request:
    """A greedy ``Request`` with the engine's block hasher (prefix caching works).

    ``kv_transfer_params`` travels as the OpenAI server passes it
    (``SamplingParams.extra_args``) and is copied, so a connector may mutate it.
    Without ``eos_token_id`` the request ignores EOS and runs ``max_tokens``.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    extra_args = None
    if kv_transfer_params is not None:
        extra_args = {"kv_transfer_params": dict(kv_transfer_params)}
    sampling_params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=eos_token_id is None,
        extra_args=extra_args,
    )
    if eos_token_id is not None:
        sampling_params.update_from_generation_config({}, eos_token_id)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(config.cache_config.block_size, hash_fn),
    )


def runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    *,
    kv_connector_output: KVConnectorOutput | None = None,
    sampled_token: int = SAMPLED_TOKEN,
) -> ModelRunnerOutput:
    """What the model runner returns for ``scheduler_output``, with the model played:
    every scheduled request whose prompt is complete after this step samples
    ``sampled_token``; partial prefill chunks sample nothing."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done_prefill = request.num_computed_tokens >= request.num_tokens
        sampled.append([sampled_token] if done_prefill else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )
