"""The tiny Nemotron-H specs of `models.random_checkpoint` (families `nemotron_h`, `nemotron_h_moe`).

Ten single-mixer blocks "M-M*-M-M*-" (Mamba-2, MLP, Mamba-2, attention, MLP, twice) so the layer
scan runs two groups and a Mamba-2 layer follows a Mamba-2 layer, an MLP and an attention block.
Awkward sizes everywhere: 6 SSM heads of 12 channels in 2 groups of B / C (3 heads per group), state
size 10, hidden 56, attention GQA 2 with head_dim 20 != 56 / 4, an MLP of 72, HF's prefill chunk 8
so test prompts span many chunks; conv bias on. `time_step_limit` is left at its default: transformers
5.24's mixer clamps dt at `time_step_min` instead, and at 0.001 neither clamp is reached by these
weights (dt_bias ~ N(-2, 0.5)), so both versions are the same oracle; tests/test_nemotron_h.py checks
a limit that does clamp separately.

`nemotron_h_moe` (Nemotron 3 Nano's block kinds): twelve blocks "MEM*E-MEM*E-" with every kind, M, E,
* and -, in two layer groups; E blocks of 8 gateless relu2 experts in 4 groups of 2 of which 2 are
kept, top-3, normalised and scaled by 2.5, plus a shared expert of 40 (!= the experts' 24 and the
dense MLP's 72). The random router bias (`e_score_correction_bias`) moves the choice.
"""

from __future__ import annotations

from typing import Any

NEMOTRON_H_SPEC: tuple[str, str, dict[str, Any]] = (
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        vocab_size=1031,
        max_position_embeddings=1024,
        layer_norm_epsilon=1e-5,
        hidden_size=56,
        intermediate_size=72,
        hybrid_override_pattern="M-M*-M-M*-",
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA 2
        head_dim=20,  # != 56 / 4
        mamba_num_heads=6,
        mamba_head_dim=12,
        ssm_state_size=10,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        use_conv_bias=True,
        mlp_hidden_act="relu2",
        tie_word_embeddings=False,
    ),
)

NEMOTRON_H_MOE_SPEC: tuple[str, str, dict[str, Any]] = (
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        NEMOTRON_H_SPEC[2],
        hybrid_override_pattern="MEM*E-MEM*E-",
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
)
NEMOTRON_H_SPECS = {"nemotron_h": NEMOTRON_H_SPEC, "nemotron_h_moe": NEMOTRON_H_MOE_SPEC}
