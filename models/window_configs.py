"""gpt-oss's and Gemma 3's config.json fields: the sliding-window families.

`gpt_oss_fields` and `gemma3_fields` are called by `models.config.parse_config`, which hands them its
RoPE parser, its error class and its attention layer kind (this module imports none of
models/config.py) and builds the `ModelConfig` from the fields they return.
"""

from __future__ import annotations

GPT_OSS_ROPE = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
)


def gpt_oss_fields(hf: dict, common: dict, n_layers: int, rope, ConfigError, ATTENTION: str) -> dict:
    kinds = tuple(hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else ATTENTION for i in range(n_layers)])
    if len(kinds) != n_layers or set(kinds) - {ATTENTION, "sliding_attention"}:
        raise ConfigError(f"layer_types must list {n_layers} entries of sliding_attention/full_attention, got {kinds}")
    window = int(hf.get("sliding_window", 128) or 0)  # HF default 128
    if "sliding_attention" in kinds and window < 1:
        raise ConfigError(f"sliding_attention layers need sliding_window >= 1, got {hf.get('sliding_window')!r}")
    # HF's GptOssConfig defaults, for fields a config.json may leave out
    common = {**common, "intermediate_size": 0, "attention_bias": bool(hf.get("attention_bias", True))}
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        common.update(rope({"rope_theta": 150000.0, **hf, "rope_parameters": GPT_OSS_ROPE}, common["head_dim"]))
    return dict(
        **common,
        layer_types=(ATTENTION,) * n_layers,
        mlp_types=("moe",) * n_layers,
        sliding_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
        attention_sinks=True,
        num_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 128),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
        moe_intermediate_size=int(hf.get("intermediate_size", 2880)),
        gpt_oss_moe=True,
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


# HF's Gemma3TextConfig defaults, for the fields a config.json leaves out
GEMMA3_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    sliding_window_pattern=6,
)
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _gemma3_rope(hf: dict, head_dim: int, rope) -> tuple[dict, dict]:
    """(full-attention, sliding-window) RoPE fields: HF 5.x's `rope_parameters` per layer type, or
    the legacy `rope_theta` + `rope_scaling` (global layers) and `rope_local_base_freq` (local ones)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = {**(hf.get("rope_scaling") or {}), **params}, {}
    full.setdefault("rope_theta", hf["rope_theta"])
    local.setdefault("rope_theta", hf["rope_local_base_freq"])
    return rope({"rope_parameters": full}, head_dim), rope({"rope_parameters": local}, head_dim)


def gemma3_fields(hf: dict, common: dict, n_layers: int, rope, ConfigError, ATTENTION: str) -> dict:
    """Gemma 3 (text): local (sliding-window) and global layers with their own RoPE, QK norm, four
    zero-centred norms per layer, gelu-tanh MLP, scaled embeddings, final logit soft-capping."""
    pattern = int(hf["sliding_window_pattern"])
    kinds = tuple(
        hf.get("layer_types") or [ATTENTION if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    )
    if len(kinds) != n_layers or set(kinds) - {ATTENTION, "sliding_attention"}:
        raise ConfigError(f"layer_types must list {n_layers} entries of sliding_attention/full_attention, got {kinds}")
    window = int(hf.get("sliding_window") or 0)
    if "sliding_attention" in kinds and window < 1:
        raise ConfigError(f"sliding_attention layers need sliding_window >= 1, got {hf.get('sliding_window')!r}")
    if hf.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            "Gemma 3 attn_logit_softcapping is not supported: HF transformers' Gemma3 attention does not apply it "
            f"(got {hf['attn_logit_softcapping']!r}; published Gemma 3 configs leave it null)"
        )
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("Gemma 3 use_bidirectional_attention is not supported (causal decoding only)")
    act = hf["hidden_activation"]
    if act not in GEMMA3_ACTIVATIONS:
        raise ConfigError(f"Gemma 3 hidden_activation {act!r} is not supported ({', '.join(GEMMA3_ACTIVATIONS)})")
    full, local = _gemma3_rope(hf, common["head_dim"], rope)
    softcap = hf.get("final_logit_softcapping")
    return dict(
        **{**common, **full},
        layer_types=(ATTENTION,) * n_layers,
        mlp_types=("dense",) * n_layers,
        zero_centred_norm=True,
        qk_norm=True,
        sliding_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
        sliding_rope_theta=local["rope_theta"],
        sliding_rope_type=local["rope_type"],
        sliding_rope_scaling=local["rope_scaling"],
        sandwich_norms=True,
        hidden_act=act,
        scale_embeddings=True,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        final_logit_softcapping=None if softcap is None else float(softcap),
    )
