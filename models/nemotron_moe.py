"""Nemotron-H's MoE block (`E`, HF's `NemotronHMoE`: Nemotron 3 Nano), routed as DeepSeek-V3 routes.

    weights, experts = deepseek_moe.route(...)   sigmoid scores, e_score_correction_bias for selection
                                                  only, grouped top-k (n_group / topk_group),
                                                  norm_topk_prob, routed_scaling_factor
    out = sum_k weights_k * down_k(relu2(up_k(x))) + shared_down(relu2(shared_up(x)))

The experts have no gate (an up and a down projection, `mlp_hidden_act`, relu2 in every published
checkpoint), and the shared expert is one such MLP of `moe_shared_expert_intermediate_size`
(HF's NemotronHMLP; `n_shared_experts` is not a multiplier there). The router weight and bias stay
float32 (HF's `_keep_in_fp32_modules_strict`): they reuse DeepSeek's parameter names `ds_router` /
`e_score_bias` so models/weights.py keeps them float32 and models/sharding.py replicates them.
Routed experts run as grouped matmuls over expert-sorted token copies, split on their intermediate
dimension under tensor parallelism, or, with expert parallelism, whole experts per device behind
models/expert_parallel.py's all-to-all (its `ffn` then this module's `relu2_ffn`).

Tensor names: HF 5's fused `experts.up_proj` [E, I, H] / `experts.down_proj` [E, H, I], or one
module per expert as NVIDIA publishes them (`experts.{e}.up_proj.weight`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models import ops
from models.config import ModelConfig
from models.deepseek_moe import _rows, route
from models.expert_parallel import routed_experts_ep
from models.quantization import qragged_dot


def relu2(x):
    return jnp.square(jnp.maximum(x, 0))


def relu2_ffn(xs, w_up, w_down, group_sizes):
    """xs [N, H] sorted by expert, group_sizes [E] -> down(relu2(up(xs))) per expert, [N, H]."""
    h = relu2(qragged_dot(xs, w_up, group_sizes))
    return qragged_dot(h.astype(xs.dtype), w_down, group_sizes)


def nemotron_moe_params(cfg: ModelConfig, get, has, lin, m: str) -> dict:
    """One E block's weights under the mixer prefix `m` (`layers.{i}.mixer.`)."""
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    p = {"ds_router": _rows(lin(m + "gate", E, H)).T, "e_score_bias": get(m + "gate.e_score_correction_bias", (E,))}
    if has(m + "experts.up_proj"):
        p["experts_up"] = np.swapaxes(get(m + "experts.up_proj", (E, I, H)), 1, 2)  # [E, H, I]
        p["experts_down"] = np.swapaxes(get(m + "experts.down_proj", (E, H, I)), 1, 2)  # [E, I, H]
    else:
        p["experts_up"] = np.stack([_rows(lin(f"{m}experts.{e}.up_proj", I, H)).T for e in range(E)])
        p["experts_down"] = np.stack([_rows(lin(f"{m}experts.{e}.down_proj", H, I)).T for e in range(E)])
    p["shared_up_proj"] = lin(m + "shared_experts.up_proj", Is, H)
    p["shared_down_proj"] = lin(m + "shared_experts.down_proj", H, Is)
    return p


def nemotron_moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {
        "post_norm": (H,),
        "ds_router": (H, E),
        "e_score_bias": (E,),
        "experts_up": (E, H, I),
        "experts_down": (E, I, H),
        "shared_up_proj": (H, Is),
        "shared_down_proj": (Is, H),
    }


def nemotron_moe(p, x, cfg: ModelConfig, opts=None, rows=None):
    """x [T, H] -> [T, H]. `rows`: x's leading real rows (as `transformer.dense_mlp`)."""
    T, H = x.shape
    K = cfg.num_experts_per_tok
    weights, experts = route(p, x, cfg)
    if opts is not None and opts.tp is not None and opts.tp.expert:  # whole experts per device, all-to-all
        out = routed_experts_ep(x, weights, experts, p["experts_up"], p["experts_down"], opts.tp, relu2_ffn)
        out = out.astype(jnp.float32)
    else:
        flat_expert = experts.reshape(-1)
        order = jnp.argsort(flat_expert)
        token_of = order // K
        group_sizes = jnp.bincount(flat_expert, length=cfg.num_experts).astype(jnp.int32)
        y = relu2_ffn(x[token_of], p["experts_up"], p["experts_down"], group_sizes)  # [T*K, H] by expert
        y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        out = jnp.zeros((T, H), jnp.float32).at[token_of].add(y)
    up = ops.linear(x, p["shared_up_proj"], opts, valid_rows=rows)
    shared = ops.linear(relu2(up).astype(x.dtype), p["shared_down_proj"], opts, valid_rows=rows)
    return (out + shared.astype(jnp.float32)).astype(x.dtype)
