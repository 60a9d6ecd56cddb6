"""Converted checkpoints: the parameter tree written with orbax-checkpoint, restored into its sharding.

    write_checkpoint(params, cfg, hf_dir, out_dir, "bfloat16")   # models/convert.py: `jaxserve convert`
    is_orbax_checkpoint(out_dir)                                 # models.model.load_model's test
    params, tp = restore_params(out_dir, cfg, dtype, mesh=None)

OUT_DIR holds `params/` (orbax, one array per leaf of the tree models/weights.py builds, stacked by
layer group), the HF side files (config.json, generation_config.json, tokenizer files, chat
template) and `jaxserve_orbax.json` (the saved dtype). Parameters are saved in their canonical
layout (GDN qkv channels in HF order), so any mesh restores them. With a mesh, each leaf is
restored straight into its tensor-parallel sharding: every process reads only the byte ranges of
its own shards; the KV-head repeat and GDN channel reorder of models/sharding.py then run on the
devices.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.safetensors_io import CheckpointError
from models.sharding import (
    TensorParallel,
    _reorder_gdn,
    canonical_param_specs,
    param_specs,
    repeat_kv_heads,
    tensor_parallel_plan,
)
from models.weights import abstract_params

MARKER = "jaxserve_orbax.json"
PARAMS = "params"
_NOT_COPIED = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def write_checkpoint(
    params: dict, cfg: ModelConfig, src: str | Path, out_dir: str | Path, dtype: str, mesh: Mesh | None = None
) -> Path:
    """Write `params` (in `dtype`, which the marker records) with orbax into the empty or new `out_dir`,
    with the side files of the HF directory `src`. With `mesh`, the arrays are written from their sharded placement (each
    process writes its shards)."""
    src, out_dir = Path(src), Path(out_dir)
    if mesh is not None:  # canonical layout, sharded: the same split restore uses, without the GDN reorder
        specs = canonical_param_specs(params, cfg, tensor_parallel_plan(cfg, mesh))
        params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    out_dir.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((out_dir / PARAMS).absolute(), params)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_NOT_COPIED) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out_dir / f.name)
    (out_dir / MARKER).write_text(json.dumps({"format": 1, "dtype": dtype}, indent=2) + "\n")
    return out_dir


def saved_dtype(path: str | Path) -> str:
    return json.loads((Path(path) / MARKER).read_text())["dtype"]


def restore_params(
    path: str | Path, cfg: ModelConfig, dtype: str, mesh: Mesh | None = None, expert_parallel: bool = False
) -> tuple[dict, TensorParallel | None]:
    """The parameters of an orbax checkpoint (cast to `dtype`), on one device or split over `mesh`
    (then also its `TensorParallel` plan, as `shard_model` would set it)."""
    import orbax.checkpoint as ocp

    path = Path(path)
    stored = saved_dtype(path)
    abstract = abstract_params(cfg, stored)
    plan = None
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
    else:
        plan = tensor_parallel_plan(cfg, mesh, expert_parallel)
        specs = canonical_param_specs(abstract, cfg, plan)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), abstract, specs
        )
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore((path / PARAMS).absolute(), target)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise CheckpointError(f"{path}: orbax checkpoint does not match config.json: {err}") from None
    shardings = jax.tree.map(lambda x: x.sharding, target)
    if plan is not None and (plan.kv_repeat > 1 or plan.mamba):  # the held layout's (KV heads, B/C groups repeated)
        held = jax.eval_shape(lambda p: _reorder_gdn(repeat_kv_heads(p, cfg, plan), cfg, plan), abstract)
        shardings = jax.tree.map(lambda _, s: NamedSharding(mesh, s), held, param_specs(held, cfg, plan))

    def finish(p):
        p = repeat_kv_heads(p, cfg, plan)
        p = _reorder_gdn(p, cfg, plan) if plan is not None else p
        return jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.dtype(stored) else a, p)

    return jax.jit(finish, out_shardings=shardings)(params), plan
