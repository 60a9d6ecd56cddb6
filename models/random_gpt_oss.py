"""The tiny gpt-oss spec of `models.random_checkpoint` (family `gpt_oss`), kept beside it.

Four layers alternating sliding / full attention (HF's default pattern), a window of 7 so test
prompts span many windows, GQA 2 with head_dim != hidden / heads, YaRN RoPE without truncation
(as gpt-oss ships it), 4 biased experts top-2, and a SwiGLU clamp (`swiglu_limit`) small enough
that random activations hit it on both sides; `swiglu_alpha` off its default so a loader that
ignores it fails. Sinks, router and expert biases are drawn like every other weight (non-zero).
The MXFP4 copy of tests/test_gpt_oss_mxfp4.py: this spec with `intermediate_size=64` (MXFP4 blocks
of 32 run along each expert's input dim), converted by `models.mxfp4.write_mxfp4_checkpoint`.
"""

from __future__ import annotations

from typing import Any

GPT_OSS_SPEC: tuple[str, str, dict[str, Any]] = (
    "GptOssConfig",
    "GptOssForCausalLM",
    dict(
        vocab_size=1031,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        hidden_size=64,
        intermediate_size=40,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=7,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA 2
        head_dim=24,  # != 64 / 4
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_alpha=1.3,
        swiglu_limit=0.5,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=256,
        ),
    ),
)
