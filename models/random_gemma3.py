"""The tiny Gemma 3 spec of `models.random_checkpoint` (family `gemma3`), kept beside it.

Six layers, local : global 2 : 1 (Gemma 3 ships 5 : 1) so the layer scan runs two groups, a window
of 7 so test prompts span many windows, GQA 2 with head_dim 16 != hidden / heads, and every Gemma
knob off the value that would hide its omission: `query_pre_attn_scalar` != head_dim, the local
RoPE base far from the global one, linear RoPE scaling on the global layers only (as Gemma-3-27B),
and a final logit soft-cap small enough that random logits reach into the tanh. Norm weights are
drawn around 0 (HF's `x * (1 + w)` norms), so a loader that reads them as plain RMSNorm fails.
"""

from __future__ import annotations

from typing import Any

GEMMA3_SPEC: tuple[str, str, dict[str, Any]] = (
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    dict(
        vocab_size=1031,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=7,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA 2
        head_dim=16,  # != 64 / 4
        query_pre_attn_scalar=40,  # scale 40**-0.5, not head_dim**-0.5
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=1.5,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=100.0),
            full_attention=dict(rope_type="linear", rope_theta=100000.0, factor=8.0),
        ),
    ),
)
