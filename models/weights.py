"""HF tensor names -> our parameter pytree.

Parameters are a plain dict: `embed`, `final_norm`, optional `lm_head`, and `groups`, a tuple
with one dict per position in the repeating layer group (see ModelConfig.layer_period); each
leaf there is stacked over groups on axis 0 so the forward pass scans over it. Linear weights
are stored [in, out]. Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba` are re-laid out
here into Qwen3.5's separate projections, so one forward pass serves both. `abstract_params` is
the same tree as `jax.ShapeDtypeStruct`s, from the config alone (no weights read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from models import kimi_linear, nemotron_h
from models.config import ATTENTION, ModelConfig
from models.deepseek_moe import ROUTER_PARAMS, deepseek_moe_params, deepseek_moe_shapes
from models.mla_attention import mla_params, mla_shapes
from models.mxfp4 import Mxfp4Source
from models.prequantized import (
    CheckpointQuantization,
    concat_columns,
    dequantize_np,
    read_embedding,
    read_linear,
    stack_layers,
)
from models.quantization import QuantizedWeight, take_columns, to_device
from models.safetensors_io import CheckpointError

# kept in float32 whatever the model dtype (GDN decay, DeepSeek's router as HF keeps it)
FP32_PARAMS = ("A_log", "dt_bias", *ROUTER_PARAMS)


class TensorSource(Protocol):
    def __contains__(self, name: str) -> bool: ...
    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray: ...


class DictSource:
    """A TensorSource over an in-memory {hf_name: array} dict (GGUF, tests)."""

    def __init__(self, tensors: dict[str, np.ndarray], origin: str):
        self.tensors, self.origin = tensors, origin

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape=None) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError(f"{self.origin}: tensor {name!r} is missing from the checkpoint")
        arr = self.tensors[name]
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.origin}: tensor {name!r} has shape {list(arr.shape)}, the config implies {list(shape)}"
            )
        return arr


def _prefix(src: TensorSource, embed: str = "embed_tokens.weight", prefixes=()) -> str:
    for p in (*prefixes, "model.language_model.", "language_model.model.", "model."):
        if f"{p}{embed}" in src:
            return p
    return "model."


def _layer_params(cfg: ModelConfig, get: Callable, has: Callable, lin: Callable, i: int) -> dict:
    if cfg.mamba is not None:  # Nemotron-H: single-mixer blocks
        return nemotron_h.layer_params(cfg, get, has, lin, i)
    if cfg.kda:  # Kimi Linear: KDA and NoPE MLA layers, Moonshot's tensor names
        return kimi_linear.layer_params(cfg, get, has, lin, i)
    H, D = cfg.hidden_size, cfg.head_dim
    p: dict[str, np.ndarray] = {"input_norm": get(f"layers.{i}.input_layernorm.weight", (H,))}
    if cfg.sandwich_norms:  # Gemma 3: HF's post_attention_layernorm norms the attention output
        p["attn_out_norm"] = get(f"layers.{i}.post_attention_layernorm.weight", (H,))
        p["post_norm"] = get(f"layers.{i}.pre_feedforward_layernorm.weight", (H,))
        p["mlp_out_norm"] = get(f"layers.{i}.post_feedforward_layernorm.weight", (H,))
    else:
        p["post_norm"] = get(f"layers.{i}.post_attention_layernorm.weight", (H,))
    if cfg.mla is not None:
        p.update(mla_params(cfg, get, lin, f"layers.{i}.self_attn."))
    elif cfg.layer_types[i] == ATTENTION:
        a = f"layers.{i}.self_attn."
        q_out = cfg.num_heads * D * (2 if cfg.attn_output_gate else 1)
        kv_out = cfg.num_kv_heads * D
        p["q_proj"] = lin(a + "q_proj", q_out, H)
        p["k_proj"] = lin(a + "k_proj", kv_out, H)
        p["v_proj"] = lin(a + "v_proj", kv_out, H)
        p["o_proj"] = lin(a + "o_proj", H, cfg.num_heads * D)
        if cfg.attention_bias:
            p["q_bias"] = get(a + "q_proj.bias", (q_out,))
            p["k_bias"] = get(a + "k_proj.bias", (kv_out,))
            p["v_bias"] = get(a + "v_proj.bias", (kv_out,))
            p["o_bias"] = get(a + "o_proj.bias", (H,)) if has(a + "o_proj.bias") else np.zeros((H,), np.float32)
        if cfg.qk_norm:
            p["q_norm"] = get(a + "q_norm.weight", (D,))
            p["k_norm"] = get(a + "k_norm.weight", (D,))
        if cfg.attention_sinks:
            p["sinks"] = get(a + "sinks", (cfg.num_heads,))
    else:
        p.update(_gdn_params(cfg, get, lin, f"layers.{i}.linear_attn."))
    m = f"layers.{i}.mlp."
    if cfg.mlp_types[i] == "dense":
        I = cfg.intermediate_size
        p["gate_proj"] = lin(m + "gate_proj", I, H)
        p["up_proj"] = lin(m + "up_proj", I, H)
        p["down_proj"] = lin(m + "down_proj", H, I)
        if cfg.mlp_bias:
            p["gate_bias"] = get(m + "gate_proj.bias", (I,))
            p["up_bias"] = get(m + "up_proj.bias", (I,))
            p["down_bias"] = get(m + "down_proj.bias", (H,))
    elif cfg.gpt_oss_moe:
        p.update(_gpt_oss_moe_params(cfg, get, lin, m))
    elif cfg.deepseek_moe is not None:
        p.update(deepseek_moe_params(cfg, get, has, lin, m))
    else:
        p.update(_moe_params(cfg, get, has, lin, m))
    return p


def _gpt_oss_moe_params(cfg: ModelConfig, get: Callable, lin: Callable, m: str) -> dict:
    """gpt-oss stores experts as x @ W ([E, H, 2I], gate and up interleaved column by column):
    de-interleaved here into our [gate | up] halves. MXFP4 experts come as QuantizedWeights
    (models/mxfp4.py)."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gate_up = get(m + "experts.gate_up_proj", (E, H, 2 * I))
    gate_up_bias = get(m + "experts.gate_up_proj_bias", (E, 2 * I))
    halves = np.concatenate([np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)])
    return {
        "router": lin(m + "router", E, H),
        "router_bias": get(m + "router.bias", (E,)),
        "experts_gate_up": take_columns(gate_up, halves),  # [E, H, 2I]
        "experts_gate_up_bias": gate_up_bias[:, halves],
        "experts_down": get(m + "experts.down_proj", (E, I, H)),  # [E, I, H]
        "experts_down_bias": get(m + "experts.down_proj_bias", (E, H)),
    }


def _gdn_params(cfg: ModelConfig, get: Callable, lin: Callable, a: str) -> dict:
    H = cfg.hidden_size
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    C, W = cfg.conv_dim, cfg.linear_conv_kernel_dim
    p: dict[str, np.ndarray] = {}
    if cfg.gdn_fused_qkvz:
        qkvz = _float_rows(lin(a + "in_proj_qkvz", hk * (2 * dk + 2 * r * dv), H)).reshape(hk, 2 * dk + 2 * r * dv, H)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        p["in_qkv"] = np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]).T
        p["in_z"] = z.reshape(-1, H).T
        ba = _float_rows(lin(a + "in_proj_ba", hk * 2 * r, H)).reshape(hk, 2 * r, H)
        p["in_b"] = ba[:, :r].reshape(-1, H).T
        p["in_a"] = ba[:, r:].reshape(-1, H).T
    else:
        p["in_qkv"] = lin(a + "in_proj_qkv", C, H)
        p["in_z"] = lin(a + "in_proj_z", hv * dv, H)
        p["in_b"] = lin(a + "in_proj_b", hv, H)
        p["in_a"] = lin(a + "in_proj_a", hv, H)
    p["conv_w"] = get(a + "conv1d.weight", (C, 1, W))[:, 0, :]
    p["A_log"] = get(a + "A_log", (hv,))
    p["dt_bias"] = get(a + "dt_bias", (hv,))
    p["gated_norm"] = get(a + "norm.weight", (dv,))
    p["out_proj"] = lin(a + "out_proj", H, hv * dv)
    return p


def _moe_params(cfg: ModelConfig, get: Callable, has: Callable, lin: Callable, m: str) -> dict:
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    p: dict = {"router": lin(m + "gate", E, H)}
    if has(m + "experts.gate_up_proj"):
        gate_up = get(m + "experts.gate_up_proj", (E, 2 * I, H))
        p["experts_gate_up"] = np.swapaxes(gate_up, 1, 2)  # [E, H, 2I]
        p["experts_down"] = np.swapaxes(get(m + "experts.down_proj", (E, H, I)), 1, 2)  # [E, I, H]
    else:
        # block-FP8 experts stay quantized (stacked per expert); other quantized ones are dequantized
        # here (kept quantized only when quantized online)
        gate_up = [concat_columns([lin(f"{m}experts.{e}.{n}_proj", I, H) for n in ("gate", "up")]) for e in range(E)]
        downs = [lin(f"{m}experts.{e}.down_proj", H, I) for e in range(E)]
        p["experts_gate_up"] = stack_layers(gate_up)  # [E, H, 2I]
        p["experts_down"] = stack_layers([d if _block_fp8(d) else _float_rows(d).T for d in downs])
    if Is:
        p["shared_gate_proj"] = lin(m + "shared_expert.gate_proj", Is, H)
        p["shared_up_proj"] = lin(m + "shared_expert.up_proj", Is, H)
        p["shared_down_proj"] = lin(m + "shared_expert.down_proj", H, Is)
        p["shared_expert_gate"] = lin(m + "shared_expert_gate", 1, H)
    return p


def _block_fp8(w) -> bool:
    return isinstance(w, QuantizedWeight) and bool(w.block_n)


def _float_rows(w) -> np.ndarray:
    """A Linear weight in HF's [out, in] float layout (dequantized if it was stored quantized)."""
    return (dequantize_np(w) if isinstance(w, QuantizedWeight) else w).T


def _cast(name: str, arr, dtype):
    if isinstance(arr, QuantizedWeight):
        return to_device(arr)
    if arr.dtype == ml_dtypes.float8_e4m3fn:  # read as a float tensor: its scale was not applied
        raise CheckpointError(f"parameter {name!r} is stored as float8_e4m3fn without a scale this loader reads")
    target = np.float32 if name in FP32_PARAMS else dtype
    return jnp.asarray(np.asarray(arr, dtype=np.float32).astype(target) if arr.dtype != target else arr)


def load_params(
    cfg: ModelConfig,
    src: TensorSource,
    dtype: str = "float32",
    progress: bool = False,
    quantization: CheckpointQuantization | None = None,
) -> dict:
    """Read every parameter of `cfg` from `src` (HF names), cast to `dtype`, stack by layer group.
    With `quantization` (a pre-quantized checkpoint), Linear weights stored quantized stay so."""
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if quantization is not None and quantization.method == "mxfp4":
        if not cfg.gpt_oss_moe:
            raise CheckpointError(
                f"quantization_config.quant_method mxfp4: only gpt-oss's experts are read as MXFP4, not {cfg.architecture}"
            )
        src = Mxfp4Source(src)
    embed, final_norm, prefixes = ("embed_tokens.weight", "norm.weight", ())
    if cfg.mamba is not None:
        embed, final_norm, prefixes = nemotron_h.EMBEDDING, nemotron_h.FINAL_NORM, nemotron_h.PREFIXES
    pre = _prefix(src, embed, prefixes)

    def get(name, shape=None):
        return src.get(pre + name, shape)

    def has(name):
        return (pre + name) in src

    def lin(module, out, inp):  # a Linear weight [in, out]: float, or QuantizedWeight as stored
        return read_linear(src, pre + module, out, inp, quantization)

    V, H = cfg.vocab_size, cfg.hidden_size
    period = cfg.layer_period()
    layers = [
        _layer_params(cfg, get, has, lin, i)
        for i in tqdm(range(cfg.num_layers), desc="loading weights", unit="layer", disable=not progress)
    ]
    groups = tuple(
        {
            k: _cast(k, stack_layers([layers[i][k] for i in range(j, cfg.num_layers, period)]), np_dtype)
            for k in layers[j]
        }
        for j in range(period)
    )
    params = {
        "embed": _cast("embed", read_embedding(src, pre + embed, V, H), np_dtype),
        "final_norm": _cast("final_norm", get(final_norm, (H,)), np_dtype),
        "groups": groups,
    }
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" in src or "lm_head.qweight" in src:
            params["lm_head"] = _cast("lm_head", read_linear(src, "lm_head", V, H, quantization), np_dtype)
        else:
            raise CheckpointError("tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
    return params


def _attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * D * (2 if cfg.attn_output_gate else 1)
    kv_out = cfg.num_kv_heads * D
    shapes = {"q_proj": (H, q_out), "k_proj": (H, kv_out), "v_proj": (H, kv_out), "o_proj": (cfg.num_heads * D, H)}
    if cfg.attention_bias:
        shapes.update(q_bias=(q_out,), k_bias=(kv_out,), v_bias=(kv_out,), o_bias=(H,))
    if cfg.qk_norm:
        shapes.update(q_norm=(D,), k_norm=(D,))
    if cfg.attention_sinks:
        shapes.update(sinks=(cfg.num_heads,))
    return shapes


def _gdn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, C, hv, dv = cfg.hidden_size, cfg.conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {
        "in_qkv": (H, C),
        "in_z": (H, hv * dv),
        "in_b": (H, hv),
        "in_a": (H, hv),
        "conv_w": (C, cfg.linear_conv_kernel_dim),
        "A_log": (hv,),
        "dt_bias": (hv,),
        "gated_norm": (dv,),
        "out_proj": (hv * dv, H),
    }


def _mlp_shapes(cfg: ModelConfig, kind: str) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    if kind == "dense":
        I = cfg.intermediate_size
        shapes = {"gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
        if cfg.mlp_bias:
            shapes.update(gate_bias=(I,), up_bias=(I,), down_bias=(H,))
        return shapes
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes = {"router": (H, E), "experts_gate_up": (E, H, 2 * I), "experts_down": (E, I, H)}
    if cfg.gpt_oss_moe:
        shapes = {
            "router": (H, E),
            "router_bias": (E,),
            "experts_gate_up": (E, H, 2 * I),
            "experts_gate_up_bias": (E, 2 * I),
            "experts_down": (E, I, H),
            "experts_down_bias": (E, H),
        }
    if Is:
        shapes.update(
            shared_gate_proj=(H, Is), shared_up_proj=(H, Is), shared_down_proj=(Is, H), shared_expert_gate=(H, 1)
        )
    return shapes


def abstract_params(cfg: ModelConfig, dtype: str) -> dict:
    """ShapeDtypeStructs of every parameter, stacked by layer group like `load_params` returns."""
    dt = jnp.dtype(dtype)

    def leaf(name, shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32 if name in FP32_PARAMS else dt)

    period, G = cfg.layer_period(), cfg.num_layers // cfg.layer_period()
    groups = []
    for j in range(period):
        if cfg.mamba is not None:
            groups.append({name: leaf(name, (G, *shape)) for name, shape in nemotron_h.layer_shapes(cfg, j).items()})
            continue
        if cfg.kda:
            groups.append({name: leaf(name, (G, *shape)) for name, shape in kimi_linear.layer_shapes(cfg, j).items()})
            continue
        shapes = {"input_norm": (cfg.hidden_size,), "post_norm": (cfg.hidden_size,)}
        if cfg.sandwich_norms:
            shapes.update(attn_out_norm=(cfg.hidden_size,), mlp_out_norm=(cfg.hidden_size,))
        if cfg.mla is not None:
            shapes.update(mla_shapes(cfg))
        else:
            shapes.update(_attention_shapes(cfg) if cfg.layer_types[j] == ATTENTION else _gdn_shapes(cfg))
        moe = cfg.deepseek_moe is not None and cfg.mlp_types[j] == "moe"
        shapes.update(deepseek_moe_shapes(cfg) if moe else _mlp_shapes(cfg, cfg.mlp_types[j]))
        groups.append({name: leaf(name, (G, *shape)) for name, shape in shapes.items()})
    V, H = cfg.vocab_size, cfg.hidden_size
    params = {"embed": leaf("embed", (V, H)), "final_norm": leaf("final_norm", (H,)), "groups": tuple(groups)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = leaf("lm_head", (H, V))
    return params
