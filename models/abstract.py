"""A model from its config.json shapes alone: abstract parameters, no weights.

    params = abstract_params(cfg, "bfloat16")   # pytree of jax.ShapeDtypeStruct, the layout
                                                # models/weights.py loads (same names, shapes, dtypes)
    model = abstract_model(cfg, "bfloat16")      # a models.model.Model over those shapes

`jaxserve plan` compiles whole serving steps for a real chip from these, so a 80B model's
memory and cost figures come from the compiler without a byte of its weights on this host.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from models.config import ATTENTION, ModelConfig
from models.model import Model
from models.weights import FP32_PARAMS


def _attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * D * (2 if cfg.attn_output_gate else 1)
    kv_out = cfg.num_kv_heads * D
    shapes = {"q_proj": (H, q_out), "k_proj": (H, kv_out), "v_proj": (H, kv_out), "o_proj": (cfg.num_heads * D, H)}
    if cfg.attention_bias:
        shapes.update(q_bias=(q_out,), k_bias=(kv_out,), v_bias=(kv_out,), o_bias=(H,))
    if cfg.qk_norm:
        shapes.update(q_norm=(D,), k_norm=(D,))
    return shapes


def _gdn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, C, hv, dv = cfg.hidden_size, cfg.conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {"in_qkv": (H, C), "in_z": (H, hv * dv), "in_b": (H, hv), "in_a": (H, hv),
            "conv_w": (C, cfg.linear_conv_kernel_dim), "A_log": (hv,), "dt_bias": (hv,), "gated_norm": (dv,),
            "out_proj": (hv * dv, H)}


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
    if Is:
        shapes.update(shared_gate_proj=(H, Is), shared_up_proj=(H, Is), shared_down_proj=(Is, H),
                      shared_expert_gate=(H, 1))
    return shapes


def abstract_params(cfg: ModelConfig, dtype: str) -> dict:
    """ShapeDtypeStructs of every parameter, stacked by layer group like `load_params` returns."""
    dt = jnp.dtype(dtype)

    def leaf(name, shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32 if name in FP32_PARAMS else dt)

    period, G = cfg.layer_period(), cfg.num_layers // cfg.layer_period()
    groups = []
    for j in range(period):
        shapes = {"input_norm": (cfg.hidden_size,), "post_norm": (cfg.hidden_size,)}
        shapes.update(_attention_shapes(cfg) if cfg.layer_types[j] == ATTENTION else _gdn_shapes(cfg))
        shapes.update(_mlp_shapes(cfg, cfg.mlp_types[j]))
        groups.append({name: leaf(name, (G, *shape)) for name, shape in shapes.items()})
    V, H = cfg.vocab_size, cfg.hidden_size
    params = {"embed": leaf("embed", (V, H)), "final_norm": leaf("final_norm", (H,)), "groups": tuple(groups)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = leaf("lm_head", (H, V))
    return params


def abstract_model(cfg: ModelConfig, dtype: str, path: str | Path = "<abstract>") -> Model:
    """A `Model` whose params are ShapeDtypeStructs: enough to trace, lower and compile its steps."""
    return Model(cfg, abstract_params(cfg, dtype), dtype, Path(path))


def shard_abstract_model(model: Model, mesh, expert_parallel: bool = False) -> Model:
    """`models.sharding.shard_model` for abstract params: attach each leaf's NamedSharding (the GDN
    channel reorder changes no shape, so there is nothing else to do)."""
    from jax.sharding import NamedSharding

    from models.sharding import param_specs, tensor_parallel_plan

    plan = tensor_parallel_plan(model.cfg, mesh, expert_parallel)
    specs = param_specs(model.params, model.cfg, plan)
    model.params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                                model.params, specs)
    model.tp = plan
    return model


def abstract_caches(model: Model, num_pages: int, page_size: int, num_slots: int, kv_dtype: str = "auto",
                    bit_storage: bool = False):
    """ShapeDtypeStructs of `model.init_caches(...)`, with the cache shardings of a sharded model."""
    from models.sharding import cache_shardings

    unsharded = Model(model.cfg, model.params, model.dtype, model.path)
    shapes = jax.eval_shape(lambda: unsharded.init_caches(num_pages, page_size, num_slots, kv_dtype, bit_storage))
    if model.tp is None:
        return shapes
    shardings = cache_shardings(shapes, model.cfg, model.tp)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def unstack_abstract(params: dict) -> dict:
    """`models.transformer.unstack_layers` for abstract params: one group's leaves per layer group."""
    from jax.sharding import NamedSharding, PartitionSpec

    def one(x):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)

    groups = params["groups"]
    n_groups = jax.tree.leaves(groups)[0].shape[0]
    layers = tuple(jax.tree.map(one, groups) for _ in range(n_groups))
    return {**{k: v for k, v in params.items() if k != "groups"}, "layers": layers}
