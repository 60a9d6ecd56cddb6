"""The tiny Nemotron-H spec of `models.random_checkpoint` (family `nemotron_h`), kept beside it.

Ten single-mixer blocks "M-M*-M-M*-" (Mamba-2, MLP, Mamba-2, attention, MLP, twice) so the layer
scan runs two groups and a Mamba-2 layer follows a Mamba-2 layer, an MLP and an attention block.
Awkward sizes everywhere: 6 SSM heads of 12 channels in 2 groups of B / C (3 heads per group), state
size 10, hidden 56, attention GQA 2 with head_dim 20 != 56 / 4, an MLP of 72, HF's prefill chunk 8
so test prompts span many chunks; conv bias on. `time_step_limit` is left at its default: transformers
5.24's mixer clamps dt at `time_step_min` instead, and at 0.001 neither clamp is reached by these
weights (dt_bias ~ N(-2, 0.5)), so both versions are the same oracle; tests/test_nemotron_h.py checks
a limit that does clamp separately.
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
