"""gpt-oss's mixture of experts, as HF's `GptOssMLP`: a router with bias whose top-k logits are
softmaxed (over the selected k only), experts with biases and the clamped SwiGLU

    g = min(gate, limit);  u = clip(up, -limit, limit);  y = (u + 1) * g * sigmoid(alpha * g)

Experts run as grouped matmuls over expert-sorted token copies, like `transformer._routed_experts`;
`experts_gate_up` holds [gate | up] halves (models/weights.py de-interleaves HF's columns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from models.config import ModelConfig
from models.quantization import qdot, qragged_dot


def clamped_swiglu(gate_up, alpha: float, limit: float):
    """gate_up [N, 2I] = [gate | up] -> [N, I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def gpt_oss_moe(p, x, cfg: ModelConfig, opts=None, rows=None):
    """x [T, H] -> [T, H]. `rows`: x's leading real rows (as `transformer.dense_mlp`)."""
    if opts is not None and opts.tp is not None and opts.tp.expert:
        raise NotImplementedError("expert parallelism is not implemented for gpt-oss's biased experts")
    T, H = x.shape
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    logits = qdot(x, p["router"], rows).astype(jnp.float32) + p["router_bias"].astype(jnp.float32)  # [T, E]
    top, experts = lax.top_k(logits, K)  # [T, K]
    weights = jax.nn.softmax(top, axis=-1)
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert)
    token_of = order // K
    row_expert = flat_expert[order]  # [T*K] expert of each sorted row
    group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
    h = qragged_dot(x[token_of], p["experts_gate_up"], group_sizes)  # [T*K, 2I]
    h = h + p["experts_gate_up_bias"][row_expert].astype(h.dtype)
    h = clamped_swiglu(h, cfg.swiglu_alpha, cfg.swiglu_limit).astype(x.dtype)
    y = qragged_dot(h, p["experts_down"], group_sizes) + p["experts_down_bias"][row_expert].astype(h.dtype)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((T, H), y.dtype).at[token_of].add(y)
