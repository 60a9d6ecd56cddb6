"""MLA decode kernel vs ragged paged attention over the equivalent MHA cache, as libtpu's compiler
sees them (ahead of time on CPU, no TPU attached: nothing here is a timing).

    python -m benchmarks.mla_kernel_cost [--out benchmarks/results/mla/kernel_cost.json]

One DeepSeek-V3 attention layer on one TP-8 shard: 16 of its 128 query heads. MLA caches one row per
token, 512 latent + 64 RoPE-key channels = 576, the same on every shard (`pallas_kernels/mla.py`,
kernel `pallas_tpu`); the multi-head attention it replaces caches, per head, K of 192 channels
(128 + 64 RoPE) and V of 128. Our ragged paged attention kernel takes K and V of one head dim, so
the MHA side runs at D = 192 for both (its true 192 + 128 bytes are recorded beside it).

A decode step: one query for each of S sequences of C tokens, the pool exactly those S * C tokens
(+ the null page). Both kernels are compiled for v5e and v6e, the pool in TPU's default layout and
pinned row-major (`mla_kernel_tpu.pool_format`), and recorded per case: the compiled argument bytes
and the pool's bytes per cached token (what a decode step must read per token of context: each
kernel reads every context row once per query block, and a decode block is one token), the
argument bytes per cached token (the pool as laid out in HBM: a row-major layout pads the minor
dim to a multiple of 128, 576 -> 640, 192 -> 256; plus the small q and metadata), the temp
bytes, the pool layout the compiler took, and whether the step copies the pool (a `copy` of an
array of the pool's shape before the kernel). XLA's `bytes accessed` is not used: its cost
analysis leaves the Pallas custom call's operands out (4.8 MB for a 151 MB pool).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.kv_cache import KVPages
from pallas_kernels.mla import LatentPages, mla_ragged_paged_attention
from pallas_kernels.mla_kernel_tpu import pool_format
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "mla" / "kernel_cost.json"
TOPOLOGIES = {"v5e": "v5e=1x1", "v6e": "v6e=1x1"}

# DeepSeek-V3 (config.json): 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
# v_head_dim 128; one TP-8 shard holds 16 heads.
HEADS, LORA_RANK, ROPE_DIM, NOPE_DIM, V_HEAD_DIM = 16, 512, 64, 128, 128
WIDTH = LORA_RANK + ROPE_DIM
QK_DIM = NOPE_DIM + ROPE_DIM


@functools.cache
def _sharding(chip: str) -> NamedSharding:
    topology = topologies.get_topology_desc(TOPOLOGIES[chip], platform="tpu", chips_per_host_bounds=(1, 1, 1))
    return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())


def _metadata(spec, seqs, max_blocks):
    return (
        spec((seqs,), jnp.int32),
        spec((seqs, max_blocks), jnp.int32),
        spec((seqs + 1,), jnp.int32),
        spec((), jnp.int32),
    )


def _copies(compiled, pages) -> bool:
    """Whether the compiled step copies a page array (`copy` of an array of the pool's shape)."""
    leaf = jax.tree.leaves(pages)[0]
    shape = "[" + ",".join(map(str, leaf.shape)) + "]"
    lines = [line.split(" = ", 1)[1] for line in compiled.as_text().splitlines() if " = " in line]
    return any(" copy(" in line and shape in line.split(" ", 1)[0] for line in lines)


def _analyse(compiled, pages, pool_tokens: int) -> dict:
    memory = compiled.memory_analysis()
    pool_format = compiled.input_formats[0][1]
    pool_format = pool_format.c if isinstance(pool_format, LatentPages) else pool_format.k
    pool_bytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pages)))
    return {
        "argument_bytes": memory.argument_size_in_bytes,
        "pool_bytes": pool_bytes,
        "pool_bytes_per_token": round(pool_bytes / pool_tokens, 2),
        "argument_bytes_per_token": round(memory.argument_size_in_bytes / pool_tokens, 2),
        "temp_bytes": memory.temp_size_in_bytes,
        "pool_layout_major_to_minor": list(pool_format.layout.major_to_minor),
        "pool_copied": _copies(compiled, pages),
    }


def _compile(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower().compile()
    return compiled, round(time.perf_counter() - start, 3)


def _pool_spec(chip, shape, dtype, layout):
    sharding = _sharding(chip)
    if layout == "row_major":
        sharding = pool_format(sharding) if len(shape) == 3 else Format(Layout(tuple(range(len(shape)))), sharding)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def mla_case(chip: str, dtype: str, page_size: int, layout: str) -> dict:
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=_sharding(chip))
    max_blocks = CONTEXT // page_size
    pages = SEQS * max_blocks + 1
    scale = spec((pages,), jnp.float32) if jnp.dtype(dtype).itemsize == 1 else None
    latent = LatentPages(c=_pool_spec(chip, (pages, page_size, WIDTH), dtype, layout), c_scale=scale)

    def step(q, latent, *meta):
        return mla_ragged_paged_attention(q, latent, *meta, sm_scale=QK_DIM**-0.5, v_dim=LORA_RANK, impl="pallas_tpu")

    q = spec((SEQS, HEADS, WIDTH), jnp.bfloat16)
    compiled, seconds = _compile(step, q, latent, *_metadata(spec, SEQS, max_blocks))
    return {"compile_s": seconds, **_analyse(compiled, latent, pages * page_size)}


def mha_case(chip: str, dtype: str, page_size: int, layout: str) -> dict:
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=_sharding(chip))
    max_blocks = CONTEXT // page_size
    pages = SEQS * max_blocks + 1
    shape = (pages, HEADS, page_size, QK_DIM)
    scale = spec((pages, HEADS), jnp.float32) if jnp.dtype(dtype).itemsize == 1 else None
    k, v = (_pool_spec(chip, shape, dtype, layout) for _ in range(2))
    kv = KVPages(k=k, v=v, k_scale=scale, v_scale=scale)

    def step(q, kv, *meta):
        return ragged_paged_attention(q, kv, *meta, sm_scale=QK_DIM**-0.5, impl="pallas_tpu")

    q = spec((SEQS, HEADS, QK_DIM), jnp.bfloat16)
    compiled, seconds = _compile(step, q, kv, *_metadata(spec, SEQS, max_blocks))
    true_bytes = HEADS * (QK_DIM + V_HEAD_DIM) * jnp.dtype(dtype).itemsize
    return {"compile_s": seconds, **_analyse(compiled, kv, pages * page_size), "true_mha_bytes_per_token": true_bytes}


SEQS, CONTEXT = 32, 4096
# (row dtype, page size, pool layout). FP8 in TPU's default layout is left out: its transposing copy
# took 100-140 s to compile at page size 64 (bf16: 2-5 s).
CASES = [
    ("bfloat16", 64, "default"),
    ("bfloat16", 128, "default"),
    ("bfloat16", 64, "row_major"),
    ("bfloat16", 128, "row_major"),
    ("float8_e4m3fn", 64, "row_major"),
    ("float8_e4m3fn", 128, "row_major"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    rows = []
    for chip in TOPOLOGIES:
        for dtype, page_size, layout in CASES:
            mla = mla_case(chip, dtype, page_size, layout)
            mha = mha_case(chip, dtype, page_size, layout)
            ratio = mha["pool_bytes_per_token"] / mla["pool_bytes_per_token"]
            case = dict(chip=chip, dtype=dtype, page_size=page_size, pool_layout=layout)
            rows.append({**case, "mla": mla, "mha_d192": mha, "mha_over_mla_bytes_per_token": round(ratio, 2)})
            print(json.dumps(rows[-1]))
    result = {
        "what": "DeepSeek-V3 attention, one TP-8 shard (16 heads), decode step of "
        f"{SEQS} sequences x {CONTEXT} tokens: MLA kernel (pallas_tpu) vs ragged paged attention over the "
        "equivalent MHA cache (K = V = 192), libtpu AOT compile on CPU (no TPU attached)",
        "command": "python -m benchmarks.mla_kernel_cost",
        "jax": jax.__version__,
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
