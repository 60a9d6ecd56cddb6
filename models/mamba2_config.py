"""The Mamba-2 mixer's config and Nemotron-H's config.json, parsed for models/config.py.

Nemotron-H (`NemotronHForCausalLM`) stacks single-mixer blocks (norm -> mixer -> residual) named by
`hybrid_override_pattern` (or HF 5.x's `layers_block_type` list): M = Mamba-2, * = attention
(no RoPE), - = an MLP block (up -> relu2 -> down, no gate), E = MoE (models/nemotron_moe.py: DeepSeek's
router, gateless relu2 experts, one shared expert). Each block is one of our layers: a mixer with no
MLP (`NO_MLP`), or an MLP (dense or MoE) with no mixer (`NO_MIXER`), so the scan over
layer groups (models/transformer.py) runs them unchanged. `recurrent_state_shapes` is the one
place that says what a state slot holds per recurrent layer, GDN or Mamba-2.

This module imports only models/deepseek_config.py of ours (models/config.py imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.deepseek_config import DeepseekMoEConfig

MAMBA = "mamba"  # a layer kind beside models/config.py's ATTENTION and LINEAR (GDN)
NO_MIXER = "none"  # a layer_types entry: an MLP-only block
NO_MLP = "none"  # an mlp_types entry: a mixer-only block
ATTENTION = "full_attention"  # == models.config.ATTENTION

# pattern character / HF layers_block_type name -> (layer kind, MLP kind)
BLOCKS = {
    "M": (MAMBA, NO_MLP),
    "*": (ATTENTION, NO_MLP),
    "-": (NO_MIXER, "dense"),
    "linear_attention": (MAMBA, NO_MLP),
    "mamba": (MAMBA, NO_MLP),
    "full_attention": (ATTENTION, NO_MLP),
    "attention": (ATTENTION, NO_MLP),
    "mlp": (NO_MIXER, "dense"),
    "E": (NO_MIXER, "moe"),
    "moe": (NO_MIXER, "moe"),
}
MOE_BLOCKS = ("E", "moe")
MLP_ACTIVATIONS = ("relu2", "silu", "gelu", "gelu_pytorch_tanh")
# HF's NemotronHConfig defaults (transformers 5.24) and the legacy names its __post_init__ accepts
DEFAULTS = dict(
    vocab_size=131072,
    hidden_size=4096,
    intermediate_size=21504,
    num_attention_heads=32,
    head_dim=128,
    layer_norm_epsilon=1e-5,
    mlp_hidden_act="relu2",
    mlp_bias=False,
    ssm_state_size=128,
    mamba_num_heads=128,
    mamba_head_dim=64,
    mamba_hidden_act="silu",
    n_groups=8,
    conv_kernel=4,
    chunk_size=128,
    use_conv_bias=True,
    use_bias=False,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    num_key_value_heads=8,
    time_step_limit=(0.0, math.inf),
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=7688,
    moe_shared_expert_intermediate_size=7688,
    n_shared_experts=1,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
)
LEGACY_NAMES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}


@dataclass(frozen=True)
class Mamba2Config:
    """One Mamba-2 mixer: H heads of P channels, N state size, G groups of B / C."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    dt_limit: tuple[float, float] = (0.0, math.inf)  # clamp of softplus(dt + dt_bias)
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj biases (HF's `use_bias`)
    norm_eps: float = 1e-5

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: x [H*P] | B [G*N] | C [G*N]."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """in_proj's outputs: gate z [H*P] | xBC [conv_dim] | dt [H]."""
        return self.intermediate_size + self.conv_dim + self.num_heads


def recurrent_state_shapes(cfg, mamba: Mamba2Config | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state [W-1, C], recurrent state) of one slot of one recurrent layer of `cfg` (a
    models.config.ModelConfig): Mamba-2's SSM state [H, P, N], GDN's [Hv, K, V]. `mamba`: the
    Mamba-2 mixer as held under tensor parallelism (models/mamba2_tp.py's `held`), else cfg's."""
    m = mamba or cfg.mamba
    if m is not None:
        return (m.conv_kernel - 1, m.conv_dim), (m.num_heads, m.head_dim, m.state_size)
    rec = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), rec


def _float(value) -> float:
    """A config float; transformers 5.x writes a non-finite one as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _blocks(hf: dict, error) -> list[str]:
    listed = hf.get("layers_block_type") or hf.get("layer_types")
    if listed:
        return list(listed)
    pattern = hf.get("hybrid_override_pattern")
    if pattern is None:
        return ["linear_attention", "moe", "full_attention", "mlp"]  # HF's default
    if not isinstance(pattern, str) or not pattern:
        raise error(f"hybrid_override_pattern must be a non-empty string, got {pattern!r}")
    return list(pattern)


def nemotron_h_config(hf: dict, error) -> tuple[dict, dict]:
    """Nemotron-H config.json -> (the dict models/config.py's common fields are read from: HF's
    defaults filled in, num_hidden_layers from the pattern, no RoPE; the family's own ModelConfig
    fields). Unsupported options raise `error` (models.config.ConfigError) with the reason."""
    hf = {LEGACY_NAMES.get(k, k): v for k, v in hf.items() if v is not None}
    hf = {**DEFAULTS, **hf}
    blocks = _blocks(hf, error)
    unknown = sorted({b for b in blocks if b not in BLOCKS})
    if unknown:
        raise error(f"Nemotron-H layer pattern has unknown block types {unknown} (M, *, -, E or their HF names)")
    moe_fields = _moe_fields(hf, error) if any(b in MOE_BLOCKS for b in blocks) else {}
    if hf["mamba_hidden_act"] not in ("silu", "swish"):
        raise error(f"Nemotron-H mamba_hidden_act {hf['mamba_hidden_act']!r} is not supported (silu)")
    if hf["mlp_hidden_act"] not in MLP_ACTIVATIONS:
        raise error(f"Nemotron-H mlp_hidden_act {hf['mlp_hidden_act']!r} is not supported {MLP_ACTIVATIONS}")
    heads, groups = int(hf["mamba_num_heads"]), int(hf["n_groups"])
    if groups < 1 or heads % groups:
        raise error(f"Nemotron-H mamba_num_heads {heads} must be a multiple of n_groups {groups}")
    if int(hf["conv_kernel"]) < 2:
        raise error(f"Nemotron-H conv_kernel must be >= 2, got {hf['conv_kernel']}")
    limit = tuple(_float(v) for v in hf["time_step_limit"])
    if len(limit) != 2 or not 0.0 <= limit[0] <= limit[1]:
        raise error(f"Nemotron-H time_step_limit must be [low, high] with 0 <= low <= high, got {limit}")
    mamba = Mamba2Config(
        num_heads=heads,
        head_dim=int(hf["mamba_head_dim"]),
        state_size=int(hf["ssm_state_size"]),
        n_groups=groups,
        conv_kernel=int(hf["conv_kernel"]),
        chunk_size=int(hf["chunk_size"]),
        dt_limit=limit,
        conv_bias=bool(hf["use_conv_bias"]),
        proj_bias=bool(hf["use_bias"]),
        norm_eps=float(hf["layer_norm_epsilon"]),
    )
    common = {
        **hf,
        "num_hidden_layers": len(blocks),
        "rms_norm_eps": hf["layer_norm_epsilon"],
        "attention_bias": False,  # HF's NemotronHAttention has no biases, whatever the config says
        "partial_rotary_factor": 0.0,  # no RoPE: rotary_dim 0
        "rope_parameters": None,
        "rope_scaling": None,
    }
    kinds = [BLOCKS[b] for b in blocks]
    fields = dict(
        layer_types=tuple(k for k, _ in kinds),
        mlp_types=tuple(m for _, m in kinds),
        hidden_act=hf["mlp_hidden_act"],
        mamba=mamba,
        **moe_fields,
    )
    return common, fields


def _moe_fields(hf: dict, error) -> dict:
    """The ModelConfig MoE fields of HF's NemotronHMoE (its router is DeepSeek-V3's)."""
    E, K = int(hf["n_routed_experts"]), int(hf["num_experts_per_tok"])
    groups, kept = int(hf["n_group"]), int(hf["topk_group"])
    if hf.get("moe_latent_size") is not None:
        raise error(
            f"Nemotron-H moe_latent_size {hf['moe_latent_size']} (latent MoE projections) is not supported: "
            "jaxserve serves MoE blocks whose experts read the hidden state (moe_latent_size null)"
        )
    if hf["mlp_hidden_act"] != "relu2":
        raise error(f"Nemotron-H MoE experts with mlp_hidden_act {hf['mlp_hidden_act']!r} are not supported (relu2)")
    if groups < 1 or E % groups or E // groups < 2 or not 1 <= kept <= groups:
        raise error(
            f"Nemotron-H n_routed_experts {E} must split into n_group {groups} groups of >= 2 experts, "
            f"with 1 <= topk_group {kept} <= n_group"
        )
    if not 1 <= K <= kept * (E // groups):
        raise error(
            f"Nemotron-H num_experts_per_tok {K} must be in [1, {kept * (E // groups)}] (the kept groups' experts)"
        )
    return dict(
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(hf["moe_shared_expert_intermediate_size"]),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        deepseek_moe=DeepseekMoEConfig(
            n_group=groups,
            topk_group=kept,
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
            n_shared_experts=int(hf["n_shared_experts"]),
        ),
    )
