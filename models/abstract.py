"""A model from its config.json shapes alone: abstract parameters, no weights.

    model = abstract_model(cfg, "bfloat16")      # a models.model.Model over abstract params:
                                                # models.weights.abstract_params, the layout
                                                # models/weights.py loads (same names, shapes, dtypes)

`jaxserve plan` compiles whole serving steps for a real chip from these, so a 80B model's
memory and cost figures come from the compiler without a byte of its weights on this host.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.model import Model
from models.weights import abstract_params


def abstract_model(cfg: ModelConfig, dtype: str, path: str | Path = "<abstract>") -> Model:
    """A `Model` whose params are ShapeDtypeStructs: enough to trace, lower and compile its steps."""
    return Model(cfg, abstract_params(cfg, dtype), dtype, Path(path))


# projections a block-FP8 checkpoint stores in FP8 (DeepSeek-V3 as published: every Linear of the
# layers but the MoE router; embedding, lm_head and norms stay in the model dtype)
BLOCK_FP8_PARAMS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"),
    *("gate_proj", "up_proj", "down_proj", "experts_gate_up", "experts_down"),
    *("shared_gate_proj", "shared_up_proj", "shared_down_proj"),
)


def block_fp8_params(params: dict, block: tuple[int, int] | None) -> dict:
    """Abstract params with the projections held as a block-FP8 checkpoint loads them
    (models/prequantized.py): float8_e4m3fn codes [..., K, N] and float32 scales
    [..., ceil(K/bi), ceil(N/bo)] (`block` [bo, bi]; None: one scale per matrix). A gate | up
    stack whose halves do not fill whole blocks holds a scale per column (as `concat_columns`)."""
    from models.quantization import QuantizedWeight

    def quantized(name, x):
        *lead, k, n = x.shape
        bo, bi = block or (n // 2 if name == "experts_gate_up" else n, k)  # per tensor: gate, up one each
        if name == "experts_gate_up" and (n // 2) % bo:
            bo = 1
        scale = jax.ShapeDtypeStruct((*lead, -(-k // bi), -(-n // bo)), jnp.float32)
        return QuantizedWeight(
            jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn), scale, bits=8, group_size=bi, block_n=bo
        )

    groups = tuple({k: quantized(k, v) if k in BLOCK_FP8_PARAMS else v for k, v in g.items()} for g in params["groups"])
    return {**params, "groups": groups}


def shard_abstract_model(model: Model, mesh, expert_parallel: bool = False) -> Model:
    """`models.sharding.shard_model` for abstract params: KV heads repeated where fewer than the
    devices and Mamba-2's B / C groups where they do not divide (the GDN channel reorder changes no
    shape), then each leaf's NamedSharding attached."""
    from jax.sharding import NamedSharding

    from models.sharding import _reorder_gdn, param_specs, repeat_kv_heads, tensor_parallel_plan

    plan = tensor_parallel_plan(model.cfg, mesh, expert_parallel)
    held = lambda p: _reorder_gdn(repeat_kv_heads(p, model.cfg, plan), model.cfg, plan)
    model.params = jax.eval_shape(held, model.params)
    specs = param_specs(model.params, model.cfg, plan)
    model.params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), model.params, specs
    )
    model.tp = plan
    return model


def abstract_caches(
    model: Model,
    num_pages: int,
    page_size: int,
    num_slots: int,
    kv_dtype: str = "auto",
    bit_storage: bool = False,
    num_window_pages: int | None = None,
    token_minor: bool = False,
):
    """ShapeDtypeStructs of `model.init_caches(...)`, with the cache shardings of a sharded model."""
    from models.cache_formats import pin_formats
    from models.sharding import cache_shardings

    shapes = jax.eval_shape(
        lambda: model.init_caches(
            num_pages,
            page_size,
            num_slots,
            kv_dtype,
            bit_storage,
            place=False,
            num_window_pages=num_window_pages,
            token_minor=token_minor,
        )
    )
    if model.tp is None:
        return shapes
    shardings = pin_formats(shapes, cache_shardings(shapes, model.cfg, model.tp))  # the MLA pool pinned on TPU
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
