"""The tiny Kimi Linear specs of `models.random_checkpoint` (`kimi_linear`, `kimi_linear_qlora`, `kimi_linear_tp`).

`kimi_linear`: five layers, KDA at 1, 2, 4, 5 and MLA at 3 (`linear_attn_config`'s 1-based lists,
as Moonshot publishes them), the first dense (`first_k_dense_replace` 1), so the layer pattern is
not periodic; a plain q_proj (`q_lora_rank` None, as Kimi-Linear-48B), 8 routed experts in 4
groups of which 2 are kept, top-3, two shared experts, a routed scaling factor off its default.
`kimi_linear_qlora`: four layers KDA, MLA, KDA, MLA, all MoE (the layer scan runs two groups), a q
LoRA, top-2 of 6 experts in 3 groups, unnormalized top-k weights, a 3-tap short conv. Both: KDA
with 3 heads of 12 channels (conv channels 108), MLA with 5 heads, latent 20 + NoPE key 8 (a row
of 28), qk_nope 12 != v_head_dim 10, hidden 72. The routers' `e_score_correction_bias` is drawn
like the weights, so selection differs from scoring. `kimi_linear_tp`: `kimi_linear` with 4 KDA
heads and 4 MLA heads, so tensor parallelism of 2 or 4 splits both.
"""

from __future__ import annotations

from typing import Any

_KIMI_TINY = dict(
    vocab_size=1031,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    hidden_size=72,
    intermediate_size=88,
    num_attention_heads=5,
    num_key_value_heads=5,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    moe_intermediate_size=24,
    tie_word_embeddings=False,
)

KIMI_LINEAR_SPEC: tuple[str, str, dict[str, Any]] = (
    "KimiLinearConfig",
    "KimiLinearForCausalLM",
    dict(
        **_KIMI_TINY,
        num_hidden_layers=5,
        linear_attn_config=dict(
            kda_layers=[1, 2, 4, 5], full_attn_layers=[3], head_dim=12, num_heads=3, short_conv_kernel_size=4
        ),
        first_k_dense_replace=1,
        q_lora_rank=None,
        num_local_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
    ),
)

KIMI_LINEAR_QLORA_SPEC: tuple[str, str, dict[str, Any]] = (
    "KimiLinearConfig",
    "KimiLinearForCausalLM",
    dict(
        **_KIMI_TINY,
        num_hidden_layers=4,
        linear_attn_config=dict(
            kda_layers=[1, 3], full_attn_layers=[2, 4], head_dim=12, num_heads=3, short_conv_kernel_size=3
        ),
        first_k_dense_replace=0,
        q_lora_rank=24,
        num_local_experts=6,
        n_group=3,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
    ),
)

# `kimi_linear` with 4 KDA heads and 4 MLA heads: both split over a model axis of 2 or 4
KIMI_LINEAR_TP_SPEC: tuple[str, str, dict[str, Any]] = (
    KIMI_LINEAR_SPEC[0],
    KIMI_LINEAR_SPEC[1],
    {
        **KIMI_LINEAR_SPEC[2],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "linear_attn_config": {**KIMI_LINEAR_SPEC[2]["linear_attn_config"], "num_heads": 4},
    },
)

KIMI_SPECS = {
    "kimi_linear": KIMI_LINEAR_SPEC,
    "kimi_linear_qlora": KIMI_LINEAR_QLORA_SPEC,
    "kimi_linear_tp": KIMI_LINEAR_TP_SPEC,
}
