"""DeepSeek-V3's mixture of experts, as HF's `DeepseekV3MoE` / `DeepseekV3TopkRouter`.

    scores  = sigmoid(x @ W_router)                       (float32)                 [T, E]
    choice  = scores + e_score_correction_bias            (selection only)
    groups  = sum of each group's top-2 `choice`; keep the `topk_group` best of `n_group` groups
    experts = top-k of `choice` within the kept groups;   weights = scores at those experts
    weights = weights / (sum + 1e-20) if norm_topk_prob;  weights *= routed_scaling_factor
    out     = sum_k weights_k * SwiGLU_expert_k(x) + SwiGLU_shared(x)

The shared experts are one SwiGLU MLP of width `n_shared_experts * moe_intermediate_size` (no
gate on its output, unlike Qwen's shared expert). Routed experts run as grouped matmuls over
expert-sorted token copies (`models.expert_parallel.expert_ffn`), `experts_gate_up` = [gate | up].
The first `first_k_dense_replace` layers are plain dense MLPs (`ModelConfig.mlp_types`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models import ops
from models.config import ModelConfig
from models.expert_parallel import expert_ffn, routed_experts_ep
from models.prequantized import concat_columns, dequantize_np, stack_layers
from models.quantization import QuantizedWeight

ROUTER_PARAMS = ("ds_router", "e_score_bias")  # float32 whatever the model dtype, as HF keeps them


def deepseek_moe_params(cfg: ModelConfig, get, has, lin, m: str) -> dict:
    """One MoE layer's weights under prefix `m` (`layers.{i}.mlp.`): the router and its bias,
    the routed experts (HF 5's fused `experts.gate_up_proj`, or one module per expert as
    DeepSeek publishes them) and the shared experts."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    Is = cfg.shared_expert_intermediate_size
    p = {"ds_router": _rows(lin(m + "gate", E, H)).T, "e_score_bias": get(m + "gate.e_score_correction_bias", (E,))}
    if has(m + "experts.gate_up_proj"):
        p["experts_gate_up"] = np.swapaxes(get(m + "experts.gate_up_proj", (E, 2 * I, H)), 1, 2)  # [E, H, 2I]
        p["experts_down"] = np.swapaxes(get(m + "experts.down_proj", (E, H, I)), 1, 2)  # [E, I, H]
    else:
        # block-FP8 experts stay quantized (stacked per expert), other quantized ones are dequantized
        gate_up = [concat_columns([lin(f"{m}experts.{e}.{n}_proj", I, H) for n in ("gate", "up")]) for e in range(E)]
        p["experts_gate_up"] = stack_layers(gate_up)  # [E, H, 2I]
        p["experts_down"] = stack_layers(
            [_block_fp8_or_float(lin(f"{m}experts.{e}.down_proj", H, I)) for e in range(E)]
        )
    if Is:
        p["shared_gate_proj"] = lin(m + "shared_experts.gate_proj", Is, H)
        p["shared_up_proj"] = lin(m + "shared_experts.up_proj", Is, H)
        p["shared_down_proj"] = lin(m + "shared_experts.down_proj", H, Is)
    return p


def _block_fp8_or_float(w):
    """A Linear weight [in, out] as read: kept if block-FP8, else float (dequantized if stored quantized)."""
    return w if isinstance(w, QuantizedWeight) and w.block_n else _rows(w).T


def _rows(w) -> np.ndarray:
    """A Linear weight [in, out] as read, in HF's [out, in] float layout (dequantized if stored quantized)."""
    return (dequantize_np(w) if isinstance(w, QuantizedWeight) else np.asarray(w)).T


def deepseek_moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes = {"ds_router": (H, E), "e_score_bias": (E,), "experts_gate_up": (E, H, 2 * I), "experts_down": (E, I, H)}
    if Is:
        shapes.update(shared_gate_proj=(H, Is), shared_up_proj=(H, Is), shared_down_proj=(Is, H))
    return shapes


def route(p, x, cfg: ModelConfig):
    """x [T, H] -> (weights [T, K] float32, expert ids [T, K]): HF's DeepseekV3TopkRouter."""
    moe, E, K = cfg.deepseek_moe, cfg.num_experts, cfg.num_experts_per_tok
    T, G = x.shape[0], moe.n_group
    scores = jax.nn.sigmoid(
        jnp.dot(x.astype(jnp.float32), p["ds_router"].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    )  # [T, E]
    choice = scores + p["e_score_bias"].astype(jnp.float32)
    group_scores = jnp.sum(lax.top_k(choice.reshape(T, G, E // G), 2)[0], axis=-1)  # [T, G]
    _, kept = lax.top_k(group_scores, moe.topk_group)  # [T, topk_group]
    group_mask = jnp.any(kept[:, :, None] == jnp.arange(G)[None, None, :], axis=1)  # [T, G]
    choice = jnp.where(jnp.repeat(group_mask, E // G, axis=1), choice, -jnp.inf)
    _, experts = lax.top_k(choice, K)  # [T, K]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


def deepseek_moe(p, x, cfg: ModelConfig, opts=None, rows=None):
    """x [T, H] -> [T, H]. `rows`: x's leading real rows (as `transformer.dense_mlp`)."""
    T, H = x.shape
    K = cfg.num_experts_per_tok
    weights, experts = route(p, x, cfg)
    if opts is not None and opts.tp is not None and opts.tp.expert:  # whole experts per device, all-to-all
        out = routed_experts_ep(x, weights, experts, p["experts_gate_up"], p["experts_down"], opts.tp)
        return (out + _shared(p, x, opts, rows)).astype(x.dtype)
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert)
    token_of = order // K
    group_sizes = jnp.bincount(flat_expert, length=cfg.num_experts).astype(jnp.int32)
    y = expert_ffn(x[token_of], p["experts_gate_up"], p["experts_down"], group_sizes)  # [T*K, H] by expert
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    out = jnp.zeros((T, H), y.dtype).at[token_of].add(y)
    return (out + _shared(p, x, opts, rows)).astype(x.dtype)


def _shared(p, x, opts, rows):
    """The shared experts: one SwiGLU MLP (0 when the config has none)."""
    if "shared_gate_proj" not in p:
        return 0
    gate = ops.linear(x, p["shared_gate_proj"], opts, valid_rows=rows)
    up = ops.linear(x, p["shared_up_proj"], opts, valid_rows=rows)
    return ops.linear(jax.nn.silu(gate) * up, p["shared_down_proj"], opts, valid_rows=rows)
