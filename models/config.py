"""ModelConfig: the one frozen description of a model, parsed once from an HF `config.json`.

Every family (Llama, Qwen3, Qwen3.5 dense/MoE, Qwen3-Next, gpt-oss, Gemma 3, DeepSeek-V3,
Nemotron-H, Kimi Linear) maps onto the same fields; the forward pass reads only this object. RoPE variants
found in HF configs (default, linear, llama3, yarn; `rope_parameters` in HF 5.x or legacy `rope_theta`/`rope_scaling`) become one
inverse-frequency table here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from models.deepseek_config import DeepseekMoEConfig, MLAConfig, deepseek_v3_fields
from models.kimi_config import kimi_linear_fields
from models.mamba2_config import MAMBA, Mamba2Config, nemotron_h_config
from models.window_configs import GEMMA3_DEFAULTS, gemma3_fields, gpt_oss_fields

ATTENTION = "full_attention"
LINEAR = "linear_attention"


class ConfigError(ValueError):
    """config.json is missing a field or asks for something we do not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # ATTENTION | LINEAR | MAMBA | "none" (an MLP-only block) per layer
    mlp_types: tuple[str, ...]  # "dense" | "moe" | "none" (a mixer-only block) per layer
    # norms and attention flavour
    zero_centred_norm: bool = False  # x/rms(x) * (1 + w)  (Qwen3.5 / Qwen3-Next)
    qk_norm: bool = False
    attn_output_gate: bool = False  # q_proj yields [query | gate] per head
    attention_bias: bool = False
    mlp_bias: bool = False
    # per attention layer: its sliding window (0: full attention); () = every layer full
    sliding_windows: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss)
    # Gemma 3: post-attention and post-MLP norms on the branch outputs (`attn_out_norm`,
    # `mlp_out_norm`; `post_norm` is then HF's pre_feedforward_layernorm), gelu-tanh MLP,
    # embeddings times sqrt(hidden_size), attention scale query_pre_attn_scalar**-0.5 (0: head_dim),
    # logits soft-capped `c * tanh(logits / c)` (None: not)
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float | None = None
    # rope
    rope_theta: float = 10000.0
    rotary_dim: int = 0
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()
    # sliding-window layers' own RoPE (Gemma 3's local base); sliding_rope_theta 0: the same as above
    sliding_rope_theta: float = 0.0
    sliding_rope_type: str = "default"
    sliding_rope_scaling: tuple[tuple[str, float], ...] = ()
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # gpt-oss experts: router with bias, softmax over the top-k logits, biased experts with the
    # clamped SwiGLU `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, g = min(gate, limit)
    gpt_oss_moe: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    gdn_fused_qkvz: bool = False  # Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba
    mla: MLAConfig | None = None  # DeepSeek-V3's MLA and MoE (models/deepseek_config.py)
    deepseek_moe: DeepseekMoEConfig | None = None
    mamba: Mamba2Config | None = None  # Nemotron-H's Mamba-2 mixer (models/mamba2_config.py)
    kda: bool = False  # Kimi Linear: LINEAR layers are KDA (models/kda_layer.py, models/kimi_config.py)
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        return LINEAR in self.layer_types or MAMBA in self.layer_types

    @property
    def num_attention_layers(self) -> int:
        return sum(t == ATTENTION for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:  # recurrent layers (GDN or Mamba-2): one state slot each
        return sum(t in (LINEAR, MAMBA) for t in self.layer_types)

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    def sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (HF's: keys p - W < k <= p), or None (full attention)."""
        return (self.sliding_windows[layer] if self.sliding_windows else 0) or None

    def layer_period(self) -> int:
        """Smallest p with (layer_types, mlp_types, windows) periodic of period p: layers scan in groups of p."""
        windows = self.sliding_windows or (0,) * self.num_layers
        kinds = list(zip(self.layer_types, self.mlp_types, windows))
        n = len(kinds)
        for p in range(1, n + 1):
            if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
                return p
        return n

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def has_sliding_rope(self) -> bool:
        """Whether sliding-window layers take their own RoPE tables (`inv_freq(sliding=True)`)."""
        return bool(self.sliding_rope_theta) and any(self.sliding_windows)

    def inv_freq(self, sliding: bool = False) -> tuple[np.ndarray, float]:
        """RoPE inverse frequencies [rotary_dim // 2] (float32) and the cos/sin scale; `sliding`:
        those of the sliding-window layers (the same unless `sliding_rope_theta` is set)."""
        theta, rope_type, scaling = self.rope_theta, self.rope_type, self.rope_scaling
        if sliding and self.sliding_rope_theta:
            theta, rope_type, scaling = self.sliding_rope_theta, self.sliding_rope_type, self.sliding_rope_scaling
        dim = self.rotary_dim
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        s = dict(scaling)
        scale = 1.0
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            inv = inv / s["factor"]
        elif rope_type == "llama3":
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old = s["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        elif rope_type == "yarn":
            inv, scale = _yarn(inv, dim, theta, s, self.max_position_embeddings)
        else:
            raise ConfigError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn)")
        return inv.astype(np.float32), float(scale)


def _yarn(inv: np.ndarray, dim: int, base: float, s: dict, max_pos: int) -> tuple[np.ndarray, float]:
    factor = s["factor"]
    original = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    mscale = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if mscale[0] and mscale[1]:
            attention_factor = get_mscale(factor, mscale[0]) / get_mscale(factor, mscale[1])
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rot):
        return (dim * math.log(original / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interp = inv / factor
    return interp * (1 - extrapolation) + inv * extrapolation, attention_factor


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "GptOssForCausalLM",
    "Gemma3ForCausalLM",
    "DeepseekV3ForCausalLM",
    "NemotronHForCausalLM",
    "KimiLinearForCausalLM",
)
# Multimodal wrappers whose `text_config` is a supported causal LM (jaxserve serves the text part;
# the language model's tensors live under `model.language_model.`, see models/weights.py).
TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
}


def _rope(hf: dict, head_dim: int) -> dict:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    keys = (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    )
    scaling = tuple((k, params[k]) for k in keys if params.get(k) is not None)
    return dict(rope_theta=float(theta), rotary_dim=int(head_dim * partial), rope_type=rope_type, rope_scaling=scaling)


def _eos(hf: dict, generation: dict | None) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (generation or {}, hf):
        e = src.get("eos_token_id")
        if e is None:
            continue
        ids.extend(e if isinstance(e, list) else [e])
    return tuple(dict.fromkeys(int(i) for i in ids))


def parse_config(hf: dict, generation: dict | None = None) -> ModelConfig:
    """Parse an HF config.json dict (plus generation_config.json, for EOS ids) into a ModelConfig."""
    archs = [TEXT_MODEL_OF.get(a, a) for a in hf.get("architectures") or []]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "text_config" in hf and "hidden_size" not in hf:
        hf = {**hf["text_config"], "architectures": archs}
    if arch == "Gemma3ForCausalLM":  # Gemma 3's published text_config leaves most fields to HF's defaults
        hf = {**GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if arch == "NemotronHForCausalLM":  # the pattern, HF's defaults, the Mamba-2 mixer
        hf, nemotron_h = nemotron_h_config(hf, ConfigError)
    try:
        n_layers = int(hf["num_hidden_layers"])
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        common = dict(
            architecture=arch,
            model_type=hf.get("model_type", ""),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(hf.get("intermediate_size") or 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos(hf, generation),
            **_rope(hf, head_dim),
        )
    except KeyError as e:
        raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None

    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        return ModelConfig(
            **common,
            layer_types=(ATTENTION,) * n_layers,
            mlp_types=("dense",) * n_layers,
            qk_norm=arch == "Qwen3ForCausalLM",
        )

    if arch == "NemotronHForCausalLM":
        return ModelConfig(**common, **nemotron_h)
    if arch == "GptOssForCausalLM":
        return ModelConfig(**gpt_oss_fields(hf, common, n_layers, _rope, ConfigError, ATTENTION))
    if arch == "Gemma3ForCausalLM":
        cfg = ModelConfig(**gemma3_fields(hf, common, n_layers, _rope, ConfigError, ATTENTION))
        cfg.inv_freq(), cfg.inv_freq(sliding=True)  # an unsupported rope_type is refused here, at start-up
        return cfg
    if arch == "DeepseekV3ForCausalLM":
        cfg = ModelConfig(**deepseek_v3_fields(hf, common, n_layers, _rope, ConfigError, ATTENTION))
        cfg.inv_freq()  # an unsupported rope_type is refused here, at start-up
        return cfg

    if arch == "KimiLinearForCausalLM":
        return ModelConfig(**kimi_linear_fields(hf, common, n_layers, ConfigError, ATTENTION, LINEAR))

    layer_types = tuple(
        hf.get("layer_types")
        or [LINEAR if (i + 1) % int(hf.get("full_attention_interval", 4)) else ATTENTION for i in range(n_layers)]
    )
    if len(layer_types) != n_layers or set(layer_types) - {ATTENTION, LINEAR}:
        raise ConfigError(f"layer_types must list {n_layers} entries of {ATTENTION!r}/{LINEAR!r}, got {layer_types}")
    if arch == "Qwen3_5ForCausalLM":
        mlp_types = ("dense",) * n_layers
    elif arch == "Qwen3_5MoeForCausalLM":
        mlp_types = ("moe",) * n_layers
    else:
        sparse_step = int(hf.get("decoder_sparse_step", 1))
        only = set(hf.get("mlp_only_layers") or [])
        n_exp = int(hf.get("num_experts", 0))
        mlp_types = tuple(
            "moe" if (i not in only and n_exp > 0 and (i + 1) % sparse_step == 0) else "dense" for i in range(n_layers)
        )
    return ModelConfig(
        **common,
        layer_types=layer_types,
        mlp_types=mlp_types,
        zero_centred_norm=True,
        qk_norm=True,
        attn_output_gate=True,
        num_experts=int(hf.get("num_experts", 0)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if arch == "Qwen3NextForCausalLM" else True,
        linear_num_key_heads=int(hf["linear_num_key_heads"]),
        linear_num_value_heads=int(hf["linear_num_value_heads"]),
        linear_key_head_dim=int(hf["linear_key_head_dim"]),
        linear_value_head_dim=int(hf["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
        gdn_fused_qkvz=arch == "Qwen3NextForCausalLM",
    )
