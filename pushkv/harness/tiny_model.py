"""Build a tiny, random, fully local Llama model for tests (no downloads).

The model is a randomly initialised ``LlamaForCausalLM`` (float32, safetensors)
with a byte-level BPE tokenizer trained here on a generated corpus, wrapped in
``PreTrainedTokenizerFast`` with a ChatML chat template.  Everything is seeded,
so two builds with the same parameters produce byte-identical weights and
tokenizer files, and greedy outputs are reproducible.

Usage::

    python -m pushkv.harness.tiny_model OUT_DIR [--layers 2] [--hidden 128] [--seed 0]
        [--max-positions 2048] [--kv-heads N] [--mla] [--sliding-window 64]

``kv_heads`` gives the Llama fewer KV heads than the default (hidden / 64),
e.g. 1, so that TP 2 replicates the head on both ranks. ``build_tiny_mla_model``
builds a tiny random DeepSeek-V2 (MLA: one compressed latent per token,
kv_lora_rank 512 + rope 64 = 576, the only head size vLLM's CPU MLA kernel
compiles for), dense layers only, with the same tokenizer.

``build_tiny_hybrid_model`` (``--sliding-window W``) builds a tiny random
Gemma-2 (same head size and KV heads as the Llama): its layers alternate
sliding-window attention (window W tokens, even layers) and full attention, so
vLLM's hybrid KV cache manager serves it with two KV cache groups.

``build_tiny_jamba_model`` (``--jamba``) builds a tiny random Jamba (a hybrid
state-space model, as Jamba and Bamba): layer 0 a Mamba layer, layer 1
attention (same head size and KV heads as the Llama), dense MLPs (one expert);
vLLM gives it a ``MambaSpec`` and a ``FullAttentionSpec`` KV cache group, which
pushkv refuses (``tests/test_refused_vllm.py``).

``build_tiny_model`` is idempotent: a marker file records the build
parameters, and a directory whose marker matches is returned as is.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Final

__all__ = [
    "BOS_EOS_TOKEN",
    "CHAT_TEMPLATE",
    "HEAD_DIM",
    "MARKER_NAME",
    "MAX_POSITION_EMBEDDINGS",
    "MLA_KV_LORA_RANK",
    "MLA_ROPE_DIM",
    "VOCAB_SIZE",
    "build_tiny_hybrid_model",
    "build_tiny_jamba_model",
    "build_tiny_mla_model",
    "build_tiny_model",
    "hybrid_model_params",
    "jamba_model_params",
    "main",
    "mla_model_params",
    "model_params",
]

# Bump whenever the output of a build changes for the same parameters.
_FORMAT_VERSION: Final = 1

MARKER_NAME: Final = "pushkv_tiny_model.json"
VOCAB_SIZE: Final = 1024
HEAD_DIM: Final = 32  # one of the head sizes the vLLM CPU attention backend accepts
MAX_POSITION_EMBEDDINGS: Final = 2048
BOS_EOS_TOKEN: Final = "<|endoftext|>"
_IM_START: Final = "<|im_start|>"
_IM_END: Final = "<|im_end|>"
_PAD: Final = "<pad>"
_SPECIAL_TOKENS: Final = (BOS_EOS_TOKEN, _IM_START, _IM_END, _PAD)  # ids 0..3
_CORPUS_SENTENCES: Final = 6000
# vLLM's CPU MLA decode kernel compiles only for a 576-wide latent (512 + 64).
MLA_KV_LORA_RANK: Final = 512
MLA_ROPE_DIM: Final = 64
_INITIALIZER_RANGE: Final = 0.1  # sharper logits than the HF default 0.02: clear greedy winners

CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_REQUIRED_FILES: Final = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_WORDS_TEXT: Final = (
    "the of and to in is was for on that with as by at from his her it an are were "
    "which this be or has had not but also first one their its new after who they two "
    "time year city world people state school family group music house water river "
    "system power light road train station market number game team player season "
    "small large early late north south east west red green blue black white gold "
    "stone wood iron cloud storm rain snow wind fire earth star moon sun sea lake "
    "hill valley forest field garden bridge tower castle village island coast port "
    "read write build carry move open close begin finish count measure send receive "
    "block cache token prefill decode transfer engine worker agent push pull memory "
    "quick brown fox jumps over lazy dog apple banana cherry orange lemon grape pear "
    "zero three four five six seven eight nine ten hundred thousand million"
)


def _untyped(module: str) -> Any:
    """Import a third-party module as ``Any`` (transformers/tokenizers are untyped)."""
    return importlib.import_module(module)


def model_params(
    *,
    layers: int = 2,
    hidden: int = 128,
    seed: int = 0,
    max_positions: int = MAX_POSITION_EMBEDDINGS,
    kv_heads: int | None = None,
) -> dict[str, Any]:
    """The parameters that identify a build; stored in the marker file.
    `kv_heads` (default: half the attention heads) must divide them."""
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if hidden < 2 * HEAD_DIM or hidden % (2 * HEAD_DIM) != 0:
        raise ValueError(f"hidden must be a positive multiple of {2 * HEAD_DIM}, got {hidden}")
    num_heads = hidden // HEAD_DIM
    n_kv = num_heads // 2 if kv_heads is None else kv_heads
    if n_kv < 1 or num_heads % n_kv:
        raise ValueError(f"kv_heads must divide the {num_heads} attention heads, got {n_kv}")
    return {
        "format_version": _FORMAT_VERSION,
        "layers": layers,
        "hidden": hidden,
        "seed": seed,
        "intermediate": 2 * hidden,
        "num_attention_heads": num_heads,
        "num_key_value_heads": n_kv,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_positions,
        "dtype": "float32",
    }


def build_tiny_model(
    out_dir: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    seed: int = 0,
    max_positions: int = MAX_POSITION_EMBEDDINGS,
    kv_heads: int | None = None,
) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return ``out_dir``.

    With the defaults: 2 layers, hidden 128, intermediate 256, 4 attention
    heads, 2 KV heads, head_dim 32, vocab 1024, max positions 2048, float32.
    ``max_positions`` (max_position_embeddings, also the tokenizer's
    model_max_length) allows longer contexts, e.g. for the serving benchmark.
    ``kv_heads`` overrides the number of KV heads (1: every TP rank holds it).
    """
    params = model_params(
        layers=layers, hidden=hidden, seed=seed, max_positions=max_positions, kv_heads=kv_heads
    )
    return _build(Path(out_dir), params)


def mla_model_params(
    *, layers: int = 2, hidden: int = 128, seed: int = 0, max_positions: int = 1024
) -> dict[str, Any]:
    """The parameters of a tiny DeepSeek-V2 (MLA) build; stored in the marker file."""
    base = model_params(layers=layers, hidden=hidden, seed=seed, max_positions=max_positions)
    base.pop("num_key_value_heads")
    base.pop("head_dim")
    return {
        **base,
        "architecture": "DeepseekV2ForCausalLM",
        "kv_lora_rank": MLA_KV_LORA_RANK,
        "qk_rope_head_dim": MLA_ROPE_DIM,
        "qk_nope_head_dim": HEAD_DIM,
        "v_head_dim": HEAD_DIM,
        "q_lora_rank": None,
    }


def build_tiny_mla_model(
    out_dir: Path, *, layers: int = 2, hidden: int = 128, seed: int = 0, max_positions: int = 1024
) -> Path:
    """Build (or reuse) a tiny random DeepSeek-V2 with MLA in ``out_dir``: dense
    MLP in every layer (no MoE), no q LoRA, 4 attention heads, latent 512 + 64."""
    params = mla_model_params(layers=layers, hidden=hidden, seed=seed, max_positions=max_positions)
    return _build(Path(out_dir), params)


def hybrid_model_params(
    *,
    layers: int = 4,
    hidden: int = 128,
    seed: int = 0,
    max_positions: int = MAX_POSITION_EMBEDDINGS,
    sliding_window: int = 64,
) -> dict[str, Any]:
    """The parameters of a tiny Gemma-2 build (alternating sliding-window and
    full-attention layers); stored in the marker file."""
    if layers < 2:
        raise ValueError(f"a hybrid model needs >= 2 layers (one of each kind), got {layers}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    base = model_params(layers=layers, hidden=hidden, seed=seed, max_positions=max_positions)
    return {**base, "architecture": "Gemma2ForCausalLM", "sliding_window": sliding_window}


def build_tiny_hybrid_model(
    out_dir: Path,
    *,
    layers: int = 4,
    hidden: int = 128,
    seed: int = 0,
    max_positions: int = MAX_POSITION_EMBEDDINGS,
    sliding_window: int = 64,
) -> Path:
    """Build (or reuse) a tiny random Gemma-2 in ``out_dir``: `layers` layers
    alternating sliding-window (window `sliding_window` tokens) and full
    attention, no logit soft-capping, tied embeddings scaled to a tenth of the
    Llama's (so that attention, not the input token, decides the output),
    otherwise as the Llama."""
    params = hybrid_model_params(
        layers=layers,
        hidden=hidden,
        seed=seed,
        max_positions=max_positions,
        sliding_window=sliding_window,
    )
    return _build(Path(out_dir), params)


def jamba_model_params(
    *, seed: int = 0, max_positions: int = 1024, kv_heads: int | None = None
) -> dict[str, Any]:
    """The parameters of a tiny Jamba build (one Mamba and one attention layer);
    stored in the marker file."""
    base = model_params(layers=2, seed=seed, max_positions=max_positions, kv_heads=kv_heads)
    return {
        **base,
        "architecture": "JambaForCausalLM",
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    }


def build_tiny_jamba_model(
    out_dir: Path, *, seed: int = 0, max_positions: int = 1024, kv_heads: int | None = None
) -> Path:
    """Build (or reuse) a tiny random Jamba in ``out_dir``: layer 0 Mamba (state
    16, conv 4, expand 2), layer 1 attention (4 heads, 2 KV heads or
    ``kv_heads``, head size 32), a dense MLP (one expert) in each, hidden 128."""
    params = jamba_model_params(seed=seed, max_positions=max_positions, kv_heads=kv_heads)
    return _build(Path(out_dir), params)


def _build(out_dir: Path, params: dict[str, Any]) -> Path:
    if _is_complete(out_dir, params):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / MARKER_NAME
    marker.unlink(missing_ok=True)  # an interrupted rebuild must not look complete
    token_ids = _build_tokenizer(
        out_dir, seed=params["seed"], max_len=params["max_position_embeddings"]
    )
    _build_model(out_dir, params, token_ids)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, marker)  # written last: its presence means the build completed
    return out_dir


def _is_complete(out_dir: Path, params: dict[str, Any]) -> bool:
    marker = out_dir / MARKER_NAME
    try:
        stored = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(stored == params) and all((out_dir / name).is_file() for name in _REQUIRED_FILES)


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words_pool = _WORDS_TEXT.split()
    lines: list[str] = []
    for _ in range(_CORPUS_SENTENCES):
        words = [rng.choice(words_pool) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice((".", ".", "?", "!", ",")))
    return lines


def _build_tokenizer(
    out_dir: Path, *, seed: int, max_len: int = MAX_POSITION_EMBEDDINGS
) -> dict[str, int]:
    """Train a byte-level BPE tokenizer and save it; return the special-token ids."""
    tk = _untyped("tokenizers")
    pre_tokenizers = _untyped("tokenizers.pre_tokenizers")
    transformers = _untyped("transformers")

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} exceeds {VOCAB_SIZE}")

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_EOS_TOKEN,
        eos_token=BOS_EOS_TOKEN,
        unk_token=None,
        pad_token=_PAD,
        additional_special_tokens=[_IM_START, _IM_END],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    ids = {name: int(tok.token_to_id(name)) for name in _SPECIAL_TOKENS}
    return ids


def _build_model(out_dir: Path, params: dict[str, Any], token_ids: dict[str, int]) -> None:
    torch = _untyped("torch")
    transformers = _untyped("transformers")
    transformers.utils.logging.disable_progress_bar()

    eos = token_ids[BOS_EOS_TOKEN]
    common = {
        "vocab_size": params["vocab_size"],
        "hidden_size": params["hidden"],
        "intermediate_size": params["intermediate"],
        "num_hidden_layers": params["layers"],
        "num_attention_heads": params["num_attention_heads"],
        "max_position_embeddings": params["max_position_embeddings"],
        "initializer_range": _INITIALIZER_RANGE,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": token_ids[_PAD],
        "dtype": params["dtype"],
    }
    if params.get("architecture") == "DeepseekV2ForCausalLM":
        config = transformers.DeepseekV2Config(
            **common,
            num_key_value_heads=params["num_attention_heads"],
            kv_lora_rank=params["kv_lora_rank"],
            q_lora_rank=params["q_lora_rank"],
            qk_rope_head_dim=params["qk_rope_head_dim"],
            qk_nope_head_dim=params["qk_nope_head_dim"],
            v_head_dim=params["v_head_dim"],
            head_dim=params["qk_rope_head_dim"],
            # Every layer dense (first_k_dense_replace = layers): the expert
            # fields must be set but no MoE layer is built.
            first_k_dense_replace=params["layers"],
            n_routed_experts=2,
            n_shared_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=params["hidden"],
        )
        model_cls = transformers.DeepseekV2ForCausalLM
    elif params.get("architecture") == "Gemma2ForCausalLM":
        n = params["layers"]
        config = transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True},  # vLLM's Gemma-2 has no lm_head
            num_key_value_heads=params["num_key_value_heads"],
            head_dim=params["head_dim"],
            sliding_window=params["sliding_window"],
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            query_pre_attn_scalar=params["head_dim"],
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
        model_cls = transformers.Gemma2ForCausalLM
    elif params.get("architecture") == "JambaForCausalLM":
        config = transformers.JambaConfig(
            **common,
            num_key_value_heads=params["num_key_value_heads"],
            # Layer 0 Mamba, layer 1 attention; one expert: dense MLPs, no MoE.
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=1,
            num_experts_per_tok=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=params["mamba_d_state"],
            mamba_d_conv=params["mamba_d_conv"],
            mamba_expand=params["mamba_expand"],
            mamba_dt_rank=params["mamba_dt_rank"],
        )
        model_cls = transformers.JambaForCausalLM
    else:
        config = transformers.LlamaConfig(
            **common,
            num_key_value_heads=params["num_key_value_heads"],
            head_dim=params["head_dim"],
        )
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(params["seed"])
    model = model_cls(config).to(torch.float32).eval()
    if params.get("architecture") == "Gemma2ForCausalLM":
        # Gemma scales the (tied) input embeddings by sqrt(hidden): at the Llama's
        # init range the input token dominates the residual stream and greedy
        # decoding repeats it. A tenth of that lets attention (so the KV cache)
        # decide the output.
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    generation = transformers.GenerationConfig(
        bos_token_id=eos,
        eos_token_id=[eos, token_ids[_IM_END]],
        pad_token_id=token_ids[_PAD],
    )
    generation.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pushkv.harness.tiny_model",
        description="Build a tiny random Llama model with a local BPE tokenizer (no downloads).",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-positions", type=int, default=MAX_POSITION_EMBEDDINGS)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--mla", action="store_true", help="a tiny DeepSeek-V2 (MLA) instead")
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="a tiny Gemma-2 instead: layers alternate a sliding window of this many "
        "tokens and full attention (vLLM: two KV cache groups)",
    )
    parser.add_argument(
        "--jamba",
        action="store_true",
        help="a tiny Jamba instead (one Mamba and one attention layer; vLLM: a Mamba "
        "and a full-attention KV cache group)",
    )
    args = parser.parse_args(argv)
    try:
        if args.jamba:
            path = build_tiny_jamba_model(
                args.out_dir,
                seed=args.seed,
                max_positions=args.max_positions,
                kv_heads=args.kv_heads,
            )
        elif args.sliding_window is not None:
            path = build_tiny_hybrid_model(
                args.out_dir,
                layers=args.layers,
                hidden=args.hidden,
                seed=args.seed,
                max_positions=args.max_positions,
                sliding_window=args.sliding_window,
            )
        elif args.mla:
            path = build_tiny_mla_model(
                args.out_dir,
                layers=args.layers,
                hidden=args.hidden,
                seed=args.seed,
                max_positions=args.max_positions,
            )
        else:
            path = build_tiny_model(
                args.out_dir,
                layers=args.layers,
                hidden=args.hidden,
                seed=args.seed,
                max_positions=args.max_positions,
                kv_heads=args.kv_heads,
            )
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
