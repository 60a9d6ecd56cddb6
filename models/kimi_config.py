"""Kimi Linear's config.json (`KimiLinearForCausalLM`) as `ModelConfig` fields: KDA, NoPE MLA, DeepSeek MoE.

`kimi_linear_fields` is called by `models.config.parse_config`, which hands it the fields every
family shares, its error class and its two layer kinds (this module imports none of
models/config.py). HF transformers' `KimiLinearConfig` is the reference, and it reads both
spellings a config.json may use: Moonshot's (`num_experts`, `num_experts_per_token`,
`num_expert_group`, `num_shared_experts`, `moe_renormalize`, `model_max_length`) and the DeepSeek
ones its `attribute_map` aliases (`num_local_experts`, `num_experts_per_tok`, `n_group`, ...).

- Layers: `layer_types` if given, else `linear_attn_config`'s 1-based `kda_layers` /
  `full_attn_layers`, else HF's default (full attention at every fourth layer from index 4).
- KDA (`linear_attn_config`: `num_heads`, `head_dim`, `short_conv_kernel_size`) fills the GDN
  fields with as many key heads as value heads, so a KDA layer's state slot has a GDN layer's
  shapes (conv `[W-1, 3*H*K]`, recurrent `[H, K, K]`); `ModelConfig.kda` routes the mixer to
  models/kda_layer.py.
- MLA without RoPE (HF's `KimiLinearAttention`: the `qk_rope_head_dim` channels of the query and
  of the shared key are used as projected), softmax scale `(qk_nope + qk_rope) ** -0.5`.
  `mla_use_nope: false` is refused: HF's model implements only the NoPE form.
- MLP: `mlp_layer_types` if given, else dense for the first `first_k_dense_replace` (default 1)
  layers and DeepSeek MoE (sigmoid router with correction bias, grouped top-k, routed scaling,
  shared experts: models/deepseek_moe.py) after.
"""

from __future__ import annotations

from models.deepseek_config import DeepseekMoEConfig, MLAConfig

# HF's KimiLinearConfig defaults, for the fields a config.json may leave out
KIMI_LINEAR_DEFAULTS = dict(
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_local_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=1024,
    routed_scaling_factor=2.446,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    hidden_act="silu",
    max_position_embeddings=1048576,
    linear_num_heads=32,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
)
# Moonshot's config.json names -> HF's attribute names (KimiLinearConfig.attribute_map, reversed)
ALIASES = {
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
}
# options of Moonshot's own modeling code that HF's model has one fixed value for
FIXED = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "use_grouped_topk": True}


def kimi_linear_fields(hf: dict, common: dict, n_layers: int, error, attention: str, linear: str) -> dict:
    """ModelConfig keyword arguments of a Kimi Linear config.json. `common`: the fields every family
    shares (models/config.py); `error`: the exception class raised for what is refused
    (`ConfigError`); `attention`, `linear`: the layer kinds of MLA and KDA layers."""
    try:
        return _fields(hf, common, n_layers, attention, linear)
    except (ValueError, TypeError, KeyError) as e:
        raise error(f"Kimi Linear config.json: {e}") from None


def _int(hf: dict, name: str, low: int = 0) -> int:
    value = hf[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _normalized(hf: dict) -> dict:
    """HF's view of the file: aliases renamed, `linear_attn_config` read, defaults filled."""
    out = dict(KIMI_LINEAR_DEFAULTS)
    for key, value in hf.items():
        name = ALIASES.get(key, key)
        if value is not None or name == "q_lora_rank":
            out[name] = value
    linear = hf.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise ValueError(f"linear_attn_config must be an object, got {linear!r}")
    for key, name in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim")):
        if key in linear:
            out[name] = linear[key]
    if "short_conv_kernel_size" in linear:
        out["linear_conv_kernel_dim"] = linear["short_conv_kernel_size"]
    return out


def _layer_types(hf: dict, n_layers: int, attention: str, linear: str) -> tuple[str, ...]:
    if hf.get("layer_types"):
        kinds = tuple(hf["layer_types"])
    else:
        lac = hf.get("linear_attn_config") or {}
        if "kda_layers" in lac and "full_attn_layers" in lac:
            kinds_list: list[str | None] = [None] * n_layers
            for key, kind in (("full_attn_layers", attention), ("kda_layers", linear)):
                for layer in lac[key]:
                    if not isinstance(layer, int) or not 1 <= layer <= n_layers:
                        raise ValueError(f"linear_attn_config.{key} holds {layer!r}, not a layer in 1..{n_layers}")
                    kinds_list[layer - 1] = kind
            if None in kinds_list:
                missing = [i + 1 for i, k in enumerate(kinds_list) if k is None]
                raise ValueError(f"linear_attn_config names no kind for layers {missing} (1-based)")
            kinds = tuple(kinds_list)  # type: ignore[arg-type]
        else:
            kinds = tuple(attention if i and i % 4 == 0 else linear for i in range(n_layers))
    if len(kinds) != n_layers or set(kinds) - {attention, linear}:
        raise ValueError(f"layer_types must list {n_layers} entries of {attention!r}/{linear!r}, got {kinds}")
    return kinds


def _mlp_types(hf: dict, n_layers: int) -> tuple[str, ...]:
    if hf.get("mlp_layer_types"):
        kinds = tuple(hf["mlp_layer_types"])
        if len(kinds) != n_layers or set(kinds) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list {n_layers} entries of 'dense'/'sparse', got {kinds}")
        return tuple("moe" if k == "sparse" else "dense" for k in kinds)
    first_dense = _int(hf, "first_k_dense_replace")
    return tuple("dense" if i < first_dense else "moe" for i in range(n_layers))


def _fields(hf: dict, common: dict, n_layers: int, attention: str, linear: str) -> dict:
    raw, hf = hf, _normalized(hf)
    for name, want in FIXED.items():
        if name in raw and raw[name] is not None and raw[name] != want:
            raise ValueError(f"{name}={raw[name]!r} is not supported (HF's KimiLinear implements {want!r})")
    if hf["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (published checkpoints have none)")
    q_lora = 0 if hf["q_lora_rank"] is None else _int(hf, "q_lora_rank", 1)
    L, R = _int(hf, "kv_lora_rank", 1), _int(hf, "qk_rope_head_dim", 1)
    nope, v_dim = _int(hf, "qk_nope_head_dim", 1), _int(hf, "v_head_dim", 1)
    heads, head_dim = _int(hf, "linear_num_heads", 1), _int(hf, "linear_head_dim", 1)
    conv = _int(hf, "linear_conv_kernel_dim", 2)
    E, K = _int(hf, "num_local_experts", 1), _int(hf, "num_experts_per_tok", 1)
    groups, topk_groups = _int(hf, "n_group", 1), _int(hf, "topk_group", 1)
    mlp_types = _mlp_types(hf, n_layers)
    if "moe" in mlp_types:
        if E % groups or E // groups < 2 or topk_groups > groups:
            raise ValueError(
                f"routing needs n_group dividing the experts into groups of >= 2 and topk_group <= n_group, "
                f"got experts={E}, n_group={groups}, topk_group={topk_groups}"
            )
        if topk_groups * (E // groups) < K:
            raise ValueError(f"num_experts_per_tok={K} must be in [1, {topk_groups * (E // groups)}]")
    mla = MLAConfig(
        q_lora_rank=q_lora,
        kv_lora_rank=L,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=R,
        v_head_dim=v_dim,
        rope_interleave=False,
        softmax_scale=(nope + R) ** -0.5,
        rope=False,
    )
    moe = DeepseekMoEConfig(
        n_group=groups,
        topk_group=topk_groups,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        n_shared_experts=_int(hf, "n_shared_experts"),
    )
    I = _int(hf, "moe_intermediate_size", 1)
    return dict(
        {
            **common,
            "head_dim": R,
            "rotary_dim": R,
            "rope_type": "default",
            "rope_scaling": (),
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": _int(hf, "max_position_embeddings", 1),
        },
        layer_types=_layer_types(raw, n_layers, attention, linear),
        mlp_types=mlp_types,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=I * moe.n_shared_experts,
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=conv,
        mla=mla,
        deepseek_moe=moe,
        kda=True,
    )
