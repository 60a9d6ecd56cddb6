"""What one executable of `jaxserve plan` costs a device: memory from the compiler's
`memory_analysis()`, flops from its `cost_analysis()` extrapolated to the model's full depth, and
the analytic figures of a step lowered for CUDA (jaxlib has no CUDA compile-only client).

Every executable comes from the engine's own table (`runtime.steps.executables.StepExecutables`,
`compile(key)` / `lower(key)`), so the planner compiles exactly what `jaxserve serve` would.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from models.abstract import abstract_caches, abstract_model, shard_abstract_model, unstack_abstract
from models.ops import KernelOptions
from runtime.steps.executables import StepExecutables, StepKey


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """One compiled executable, per device."""

    name: str
    tokens: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    analytic: bool = False  # True: not compiled (GPU); array sizes only, no temp / cost figures

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (a leaf pinned to a layout,
    an MLA pool on TPU (models/cache_formats.py), with its minor dim padded to 128 lanes)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        fmt = getattr(x, "format", None)
        if fmt is not None and fmt.layout is not None and fmt.layout.major_to_minor[-1] == len(shape) - 1:
            shape = (*shape[:-1], -(-shape[-1] // 128) * 128)
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def cost_of(stage) -> tuple[float, float]:
    """(flops, bytes accessed) from a Compiled's or Lowered's cost analysis."""
    cost = stage.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per partition
        cost = cost[0] if cost else {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def figures(name: str, tokens: int, compiled) -> StepFigures:
    """Memory of a compiled executable; its cost is filled in by `extrapolated_cost` (see there)."""
    mem = compiled.memory_analysis()
    return StepFigures(
        name,
        tokens,
        mem.argument_size_in_bytes,
        mem.output_size_in_bytes,
        mem.alias_size_in_bytes,
        mem.temp_size_in_bytes,
        0.0,
        0.0,
    )


def truncated_config(cfg, groups: int):
    """`cfg` cut to its first `groups` repetitions of the layer pattern."""
    n = cfg.layer_period() * groups
    return dataclasses.replace(cfg, num_layers=n, layer_types=cfg.layer_types[:n], mlp_types=cfg.mlp_types[:n])


def extrapolated_cost(
    cfg,
    dtype: str,
    mesh,
    opts: KernelOptions,
    T: int,
    *,
    num_pages: int,
    page_size: int,
    num_slots: int,
    kv_dtype: str,
    max_num_seqs: int,
    blocks_per_seq: int,
    gpu: bool = False,
    expert_parallel: bool = False,
    state_dtype: str = "float32",
    token_minor: bool = False,
    latent_split: bool = False,
) -> tuple[float, float]:
    """(flops, bytes accessed) of one backbone step of the whole model. XLA's cost analysis counts a
    `lax.scan` body once, so the step is compiled with 1 and 2 layer groups unrolled and the
    per-group difference is scaled to the real depth: cost(G) = cost(1) + (G - 1) * (cost(2) - cost(1))."""
    costs = []
    for groups in (1, 2):
        model = abstract_model(truncated_config(cfg, groups), dtype)
        model.state_dtype = state_dtype
        if mesh is not None:
            shard_abstract_model(model, mesh, expert_parallel)
            model.tp = dataclasses.replace(model.tp, latent_split=latent_split)  # MLA pools split (models/mla_split.py)
        caches = abstract_caches(model, num_pages, page_size, num_slots, kv_dtype, token_minor=token_minor)
        model.params = unstack_abstract(model.params)
        opts_g = dataclasses.replace(opts, tp=model.tp)
        exes = StepExecutables(
            model,
            caches,
            opts_g,
            token_buckets=(T,),
            seq_buckets=(8,),
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=blocks_per_seq,
        )
        key = StepKey("batch_backbone", T)
        costs.append(cost_of(exes.lower(key, lowering_platforms=("cuda",)) if gpu else exes.compile(key)))
    G = cfg.num_layers // cfg.layer_period()
    return tuple(c1 + (G - 1) * (c2 - c1) for c1, c2 in zip(*costs))


def gpu_lowered(model, caches, opts, buckets, sched, blocks_per_seq) -> list[StepFigures]:
    """Lower every backbone bucket for CUDA (no compile: no CUDA device); memory = the arrays' sizes."""
    exes = StepExecutables(
        model,
        caches,
        opts,
        token_buckets=buckets,
        seq_buckets=(8,),
        max_num_seqs=sched.max_num_seqs,
        max_blocks_per_seq=blocks_per_seq,
    )
    cache_bytes = per_device_bytes(caches)
    args_bytes = per_device_bytes(model.params) + cache_bytes
    hidden_bytes = sched.max_num_seqs * model.cfg.hidden_size * jnp.dtype(model.dtype).itemsize
    steps = []
    for T in buckets:
        lowered = exes.lower(StepKey("batch_backbone", T), lowering_platforms=("cuda",))
        assert lowered.as_text()  # the CUDA lowering (Triton kernels included) succeeded
        steps.append(
            StepFigures(
                f"backbone[T={T}]",
                T,
                args_bytes + per_device_bytes(exes.batch_spec(T)),
                cache_bytes + hidden_bytes,
                cache_bytes,
                0,
                0.0,
                0.0,
                analytic=True,
            )
        )
    return steps
