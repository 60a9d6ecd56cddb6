"""The layouts cache arrays are pinned to on TPU (`jax.experimental.layout.Format`).

An MLA layer's latent pool is [P, ps, W] rows, W = kv_lora_rank + RoPE dim (DeepSeek-V3: 576,
not a lane multiple). Left to itself, TPU's compiler gives that entry parameter another dim
minor (ps minor at W = 576, ps = 128: `major_to_minor` (0, 2, 1)), while the Pallas MLA kernel
and the KV write read W minor; so every step copied the whole pool of every layer in and out
(benchmarks/results/mla/kernel_cost.json `pool_copied`; on DeepSeek-V3 at v5p-64 the 64-token
step's temp was 16.83 GiB, benchmarks/results/plan/tpu-v5p-64-deepseek-v3-mf085-T64.txt). Pinned
rows-minor (`pallas_kernels.mla_kernel_tpu.pool_format`, W padded to 640 lanes in HBM) wherever
the pool is placed (`models.sharding.shard_caches`), planned (`models.abstract.abstract_caches`)
and passed to or returned by a step (`runtime.steps.executables`, in and out shardings: the
donated pool aliases its output), the step reads and writes it in place
(tests/test_mla_layout_tpu.py). KV pages need no pin: head_dim >= 128 is lane-dense in the
default layout, and a narrower one is stored token-minor (`pallas_kernels.kv_cache`).
One TPU chip without a mesh gets the same pin: its pools are placed pinned (`place_pinned`, from
`Model.init_caches`) and the step takes and returns them so (`one_tpu`: the step's shardings are
then the chip's `SingleDeviceSharding`, runtime/steps/executables.py; tests/test_mla_layout_tpu.py).
Other platforms keep their default layouts (the shardings come back unchanged).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.layout import Format, Layout
from jax.sharding import Sharding, SingleDeviceSharding

from pallas_kernels.mla import LatentPages


def on_tpu(sharding) -> bool:
    """Whether `sharding` places its array on TPU devices (a target topology's too, in `jaxserve plan`)."""
    if not isinstance(sharding, Sharding):
        return False
    return next(iter(sharding.device_set)).platform == "tpu"


def pin_formats(caches: dict, shardings: dict) -> dict:
    """`shardings` (the tree of `caches`: arrays or ShapeDtypeStructs) with each MLA latent pool's
    replaced by a `Format` pinning it rows-minor, on TPU; everything else unchanged."""
    kv = []
    for pages, sharding in zip(caches["kv"], shardings["kv"], strict=True):
        if isinstance(pages, LatentPages) and on_tpu(sharding.c):  # `mla_kernel_tpu.pool_format`, any leading dims
            rows_minor = Layout(major_to_minor=tuple(range(len(pages.c.shape))))
            sharding = dataclasses.replace(sharding, c=Format(rows_minor, sharding.c))
        kv.append(sharding)
    return {**shardings, "kv": tuple(kv)}


def cache_formats(caches: dict) -> dict:
    """The shardings of placed `caches` (or of ShapeDtypeStructs carrying shardings), pinned as
    `pin_formats`: what a step takes the caches in and returns them in."""
    shardings = jax.tree.map(lambda x: x.sharding, caches)
    return pin_formats(caches, shardings)


def format_specs(caches: dict) -> dict:
    """ShapeDtypeStructs of `caches` carrying `cache_formats` (a step's abstract cache arguments)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), caches, cache_formats(caches))


def one_tpu(caches: dict) -> SingleDeviceSharding | None:
    """The chip's sharding when `caches` (no mesh) hold an MLA pool on one TPU chip; else None."""
    for pages in caches["kv"]:
        sharding = getattr(pages.c, "sharding", None) if isinstance(pages, LatentPages) else None
        if sharding is not None and on_tpu(sharding) and len(sharding.device_set) == 1:
            return SingleDeviceSharding(next(iter(sharding.device_set)))
    return None


def place_pinned(caches: dict) -> dict:
    """`caches` on one device with each MLA pool moved into its pinned layout on TPU (`pin_formats`)."""
    if one_tpu(caches) is None:
        return caches
    pinned = cache_formats(caches)
    return jax.tree.map(lambda x, s: jax.device_put(x, s) if isinstance(s, Format) else x, caches, pinned)
