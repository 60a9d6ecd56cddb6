"""DeepSeek-V3's config.json (`DeepseekV3ForCausalLM`) as `ModelConfig` fields: MLA and DeepSeek MoE.

`deepseek_v3_fields` is called by `models.config.parse_config`, which hands it its RoPE parser,
its error class and its attention layer kind (this module imports none of models/config.py). HF transformers' `DeepseekV3Config` is the reference: its defaults fill what a
config.json leaves out, `head_dim` is the RoPE dim (`qk_rope_head_dim`), and the softmax scale is
`(qk_nope + qk_rope) ** -0.5`, times `mscale ** 2` with `mscale = 0.1 * mscale_all_dim * ln(factor) + 1`
under a scaled RoPE (HF's `yarn_apply_mscale`). `rope_interleave` (HF default True) rotates
interleaved channel pairs `(x0, x1), (x2, x3), ...` and writes the result de-interleaved
(`apply_rotary_pos_emb_interleave`). Options HF's model does not implement are refused here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# HF's DeepseekV3Config defaults, for the fields a config.json may leave out
DEEPSEEK_V3_DEFAULTS = dict(
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    first_k_dense_replace=3,
    rope_interleave=True,
    hidden_act="silu",
)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention's dims. q_lora_rank 0: a plain q_proj (HF's None)."""

    q_lora_rank: int
    kv_lora_rank: int  # L: the latent's channels
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # R: the decoupled RoPE key's channels
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    rope: bool = True  # False: the qk_rope_head_dim channels go unrotated (Kimi Linear's NoPE MLA)

    @property
    def latent_width(self) -> int:
        """Channels of one cached row: c_kv ++ k_pe (L + R)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekMoEConfig:
    """Sigmoid router with a selection-only bias, grouped top-k, routed scaling, shared experts."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, rope_type: str, rope_scaling: dict) -> float:
    """HF's `yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5)`."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
    if rope_type != "default" and mscale_all_dim:
        m = _mscale(rope_scaling["factor"], mscale_all_dim)
        scale = scale * m * m
    return scale


def deepseek_v3_fields(hf: dict, common: dict, n_layers: int, rope_fields, error, attention: str) -> dict:
    """ModelConfig keyword arguments of a DeepSeek-V3 config.json. `common`: the fields every family
    shares (models/config.py); `rope_fields(hf, dim)`: its RoPE parser; `error`: the exception class
    raised for what is refused (`ConfigError`); `attention`: the layer kind of every layer."""
    try:
        return _fields(hf, common, n_layers, rope_fields, attention)
    except ValueError as e:
        raise error(str(e)) from None


def _int(hf: dict, name: str) -> int:
    value = hf[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"DeepSeek-V3 {name} must be a non-negative integer, got {value!r}")
    return value


def _fields(hf: dict, common: dict, n_layers: int, rope_fields, attention: str) -> dict:
    hf = {**DEEPSEEK_V3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "q_lora_rank"}}
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if name in hf and hf[name] != want:
            raise ValueError(f"DeepSeek-V3 {name}={hf[name]!r} is not supported (HF's DeepseekV3 implements {want!r})")
    if hf["hidden_act"] != "silu":
        raise ValueError(f"DeepSeek-V3 hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("attention_bias"):
        raise ValueError("DeepSeek-V3 attention_bias=true is not supported (published checkpoints have none)")
    q_lora = 0 if hf["q_lora_rank"] is None else _int(hf, "q_lora_rank")
    L, R = _int(hf, "kv_lora_rank"), _int(hf, "qk_rope_head_dim")
    nope, v_dim = _int(hf, "qk_nope_head_dim"), _int(hf, "v_head_dim")
    if min(L, R, nope, v_dim) < 1 or R % 2:
        raise ValueError(
            f"DeepSeek-V3 needs kv_lora_rank, qk_nope/v_head_dim >= 1 and an even qk_rope_head_dim, got {hf}"
        )
    E, K = _int(hf, "n_routed_experts"), _int(hf, "num_experts_per_tok")
    groups, topk_groups = _int(hf, "n_group"), _int(hf, "topk_group")
    if groups < 1 or E % groups or E // groups < 2 or not 1 <= topk_groups <= groups:
        raise ValueError(
            f"DeepSeek-V3 routing needs n_group dividing n_routed_experts into groups of >= 2 and "
            f"1 <= topk_group <= n_group, got n_routed_experts={E}, n_group={groups}, topk_group={topk_groups}"
        )
    if not 1 <= K <= topk_groups * (E // groups):
        raise ValueError(f"DeepSeek-V3 num_experts_per_tok={K} must be in [1, {topk_groups * (E // groups)}]")
    first_dense = min(_int(hf, "first_k_dense_replace"), n_layers)
    rope = rope_fields({**hf, "partial_rotary_factor": 1.0}, R)
    scaling = dict(rope["rope_scaling"])
    if rope["rope_type"] == "yarn" and "factor" not in scaling:  # HF: max_position / original
        original = scaling.get("original_max_position_embeddings") or common["max_position_embeddings"]
        scaling["factor"] = common["max_position_embeddings"] / original
        rope["rope_scaling"] = tuple(sorted(scaling.items()))
    mla = MLAConfig(
        q_lora_rank=q_lora,
        kv_lora_rank=L,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=R,
        v_head_dim=v_dim,
        rope_interleave=bool(hf["rope_interleave"]),
        softmax_scale=softmax_scale(nope + R, rope["rope_type"], scaling),
    )
    moe = DeepseekMoEConfig(
        n_group=groups,
        topk_group=topk_groups,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        n_shared_experts=_int(hf, "n_shared_experts"),
    )
    return dict(
        {**common, **rope, "head_dim": R, "attention_bias": False, "mlp_bias": False},
        layer_types=(attention,) * n_layers,
        mlp_types=tuple("dense" if i < first_dense else "moe" for i in range(n_layers)),
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=_int(hf, "moe_intermediate_size"),
        shared_expert_intermediate_size=_int(hf, "moe_intermediate_size") * moe.n_shared_experts,
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        mla=mla,
        deepseek_moe=moe,
    )
