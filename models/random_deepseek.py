"""The tiny DeepSeek-V3 specs of `models.random_checkpoint` (families `deepseek_v3`, `deepseek_v3_qnone`).

`deepseek_v3`: three layers, the first dense (`first_k_dense_replace` 1), so the layer pattern is
not periodic; a q LoRA (`q_lora_rank` 24), YaRN RoPE with `mscale` != `mscale_all_dim` (so the
cos/sin attention factor and the softmax's `mscale ** 2` both differ from 1), interleaved RoPE
pairs, 8 routed experts in 4 groups of which 2 are kept, top-3, two shared experts, a routed
scaling factor off its default. `deepseek_v3_qnone`: four MoE layers (the layer scan runs four
groups), a plain q_proj (`q_lora_rank` None), default RoPE without interleaving, top-2 of 6
experts in 3 groups, unnormalized top-k weights. Both: 5 heads, latent 20 + rope 8 (a row of 28),
qk_nope 12 != v_head_dim 10, hidden 72 != heads x anything. The router's `e_score_correction_bias`
is drawn like the weights (random_checkpoint fills that buffer), so selection differs from scoring.
"""

from __future__ import annotations

from typing import Any

_MLA_TINY = dict(
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
    num_mtp_layers=0,
)

DEEPSEEK_V3_SPEC: tuple[str, str, dict[str, Any]] = (
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    dict(
        **_MLA_TINY,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        q_lora_rank=24,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=256,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.3,
            mscale_all_dim=0.7,
        ),
    ),
)

DEEPSEEK_V3_QNONE_SPEC: tuple[str, str, dict[str, Any]] = (
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    dict(
        **_MLA_TINY,
        num_hidden_layers=4,
        first_k_dense_replace=0,
        q_lora_rank=None,
        n_routed_experts=6,
        n_group=3,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        rope_interleave=False,
        rope_parameters=dict(rope_type="default", rope_theta=5000.0),
    ),
)

DEEPSEEK_SPECS = {"deepseek_v3": DEEPSEEK_V3_SPEC, "deepseek_v3_qnone": DEEPSEEK_V3_QNONE_SPEC}
