"""The real Mosaic compiler (libtpu, ahead of time, no TPU attached) compiles our TPU kernels.

Interpret mode ignores TPU tiling rules ((8, 128) tiles, FP8's (32, 128) tiles, aligned DMA
offsets on the two minor dims, SMEM sizes), so a kernel that passes every interpret test can
still be rejected on hardware. Here `jax.jit(...).trace(...).lower().compile()` runs libtpu's
compiler for a v5e and a v6e chip (topology names "v5e=1x1" / "v6e=1x1"; "v5e:1x1" also
works, "v5litepod-1" does not) over the shapes we serve: bf16 and both FP8 KV dtypes, head
dims 64/128/256, page sizes 16/32/64, decode-sized and prefill-sized token counts; and the
GDN kernel at K = V = 128, chunk 64; and the MLA kernel at DeepSeek-V3's rows (W = 576, v_dim 512),
with its pool read in place when pinned row-major. The CUDA lowering checks live beside the interpret tests
(tests/test_ragged_paged_attention.py, tests/test_gdn.py).

libtpu takes /tmp/libtpu_lockfile at start-up; another JAX process on the machine may hold
it, so ALLOW_MULTIPLE_LIBTPU_LOAD=1 must be set before JAX first initialises its backends
(set here, and it belongs in tests/conftest.py for whole-suite runs).
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.gdn import gated_delta_rule
from pallas_kernels.kv_cache import KVPages
from pallas_kernels.kv_write import write_kv
from pallas_kernels.mla import LatentPages, mla_ragged_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

TOPOLOGIES = {"v5e": "v5e=1x1", "v6e": "v6e=1x1"}
DEVICE_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def tpu(request):
    """(chip name, replicated sharding on a 1-chip mesh of that TPU generation)."""
    topology = topologies.get_topology_desc(TOPOLOGIES[request.param], platform="tpu", chips_per_host_bounds=(1, 1, 1))
    assert topology.devices[0].device_kind == DEVICE_KINDS[request.param]
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return request.param, NamedSharding(mesh, PartitionSpec())


def _spec(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def _attention_args(sharding, kv_dtype, head_dim, page_size, tokens, *, q_heads=8, kv_heads=2, seqs=8, max_blocks=32):
    spec = lambda shape, dtype: _spec(shape, dtype, sharding)
    page_shape = (seqs * max_blocks + 1, kv_heads, page_size, head_dim)
    scale = spec(page_shape[:2], jnp.float32) if jnp.dtype(kv_dtype).itemsize == 1 else None
    kv = KVPages(k=spec(page_shape, kv_dtype), v=spec(page_shape, kv_dtype), k_scale=scale, v_scale=scale)
    return (
        spec((tokens, q_heads, head_dim), jnp.bfloat16),
        kv,
        spec((seqs,), jnp.int32),
        spec((seqs, max_blocks), jnp.int32),
        spec((seqs + 1,), jnp.int32),
        spec((), jnp.int32),
    )


# (kv dtype, head dim, page size, tokens): decode-sized T=8 and prefill-sized T=512 batches.
# (A wider sweep, 3 dtypes x D 64/128/256 x ps 16/32/64 x T 8/512 on both chips, all compiled;
# this subset keeps the file fast.)
ATTENTION_CASES = [
    ("bfloat16", 128, 16, 8),
    ("bfloat16", 64, 64, 512),
    ("bfloat16", 256, 32, 8),
    ("float8_e4m3fn", 128, 16, 512),
    ("float8_e4m3fn", 64, 32, 8),
    ("float8_e5m2", 128, 16, 8),
    ("float8_e5m2", 256, 64, 512),
]


@pytest.mark.parametrize("kv_dtype,head_dim,page_size,tokens", ATTENTION_CASES)
def test_ragged_paged_attention_compiles(tpu, kv_dtype, head_dim, page_size, tokens):
    _, sharding = tpu

    def attention(*args):
        return ragged_paged_attention(*args, sm_scale=head_dim**-0.5, impl="pallas_tpu")

    args = _attention_args(sharding, kv_dtype, head_dim, page_size, tokens)
    compiled = jax.jit(attention).trace(*args).lower().compile()
    assert compiled.out_info.shape == (tokens, 8, head_dim)


def test_ragged_paged_attention_options_compile(tpu):
    """Sliding window, soft cap and MHA (group 1) together, with FP8 pages."""
    _, sharding = tpu

    def attention(*args):
        return ragged_paged_attention(*args, sm_scale=0.1, sliding_window=100, soft_cap=30.0, impl="pallas_tpu")

    args = _attention_args(sharding, "float8_e4m3fn", 128, 32, 64, q_heads=4, kv_heads=4)
    jax.jit(attention).trace(*args).lower().compile()


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])  # cache.state_dtype
def test_gdn_compiles(tpu, state_dtype, dtype="bfloat16"):
    """K = V = 128, chunk 64, 2 key heads / 4 value heads, a mixed prefill + decode batch; state
    slots in float32 or bfloat16 (the latter staged through a bf16 VMEM buffer)."""
    _, sharding = tpu
    spec = lambda shape, dt: _spec(shape, dt, sharding)
    tokens, seqs, slots = 200, 8, 9
    args = (
        spec((tokens, 2, 128), dtype),
        spec((tokens, 2, 128), dtype),
        spec((tokens, 4, 128), dtype),
        spec((tokens, 4), jnp.float32),
        spec((tokens, 4), jnp.float32),
        spec((slots, 4, 128, 128), state_dtype),
        spec((seqs + 1,), jnp.int32),
        spec((seqs,), jnp.int32),
        spec((seqs,), jnp.bool_),
        spec((), jnp.int32),
    )
    gdn = lambda *a: gated_delta_rule(*a, impl="pallas_tpu", chunk_size=64)
    compiled = jax.jit(gdn).trace(*args).lower().compile()
    out, state = compiled.out_info
    assert out.shape == (tokens, 4, 128) and state.shape == (slots, 4, 128, 128)
    assert state.dtype == jnp.dtype(state_dtype)


# (kv dtype, head dim, page size). A scatter of token rows into the pool wanted its own layouts:
# offset-major pages inside a loop, and (8, 128) tiles for FP8 where 128-token pages are (32, 128).
IN_PLACE_CASES = [("bfloat16", 128, 128), ("bfloat16", 256, 16), ("float8_e4m3fn", 256, 128), ("float8_e5m2", 128, 64)]


def _write_then_attend_memory(sharding, kv_dtype, head_dim, page_size, max_blocks, whole_pages=True):
    """(pool bytes, compiled memory analysis) of a decode step: KV write, then attention, pages donated."""
    q, kv, kv_lens, block_tables, cu_q_lens, num_seqs = _attention_args(
        sharding, kv_dtype, head_dim, page_size, 8, max_blocks=max_blocks
    )
    if kv.quantized:  # two scale arrays: one donated buffer cannot be two arguments
        kv = KVPages(k=kv.k, v=kv.v, k_scale=kv.k_scale, v_scale=_spec(kv.k_scale.shape, jnp.float32, sharding))
    new = _spec((8, 2, head_dim), jnp.bfloat16, sharding)
    slots = _spec((8,), jnp.int32, sharding)

    def step(q, kv, k, v, slots, kv_lens, block_tables, cu_q_lens, num_seqs):
        def layer(_, carry):  # two layers carrying the pool, as the layer scan does
            out, kv = carry
            kv = write_kv(kv, k, v, slots, whole_pages=whole_pages)
            out = out + ragged_paged_attention(
                q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=head_dim**-0.5, impl="pallas_tpu"
            )
            return out, kv

        return jax.lax.fori_loop(0, 2, layer, (jnp.zeros(q.shape, q.dtype), kv))

    args = (q, kv, new, new, slots, kv_lens, block_tables, cu_q_lens, num_seqs)
    compiled = jax.jit(step, donate_argnums=1).trace(*args).lower().compile()
    return 2 * kv.k.size * jnp.dtype(kv_dtype).itemsize, compiled.memory_analysis()


@pytest.mark.parametrize("kv_dtype,head_dim,page_size", IN_PLACE_CASES)
def test_kv_write_then_attention_updates_the_pool_in_place(tpu, kv_dtype, head_dim, page_size):
    """Two layers of KV write + attention over the donated pages, in a loop as the layer scan: the
    pages are aliased, and the temp does not grow with the pool (the token scatter used to copy
    it: 0.38 GiB of temp for 0.25 GiB of FP8 KV, benchmarks/cache_copies.py)."""
    _, sharding = tpu
    small_pool, small = _write_then_attend_memory(sharding, kv_dtype, head_dim, page_size, 32)
    pool, big = _write_then_attend_memory(sharding, kv_dtype, head_dim, page_size, 128)
    assert big.alias_size_in_bytes >= pool
    grown = big.temp_size_in_bytes - small.temp_size_in_bytes
    assert grown < 0.05 * (pool - small_pool), f"temp grew {grown} bytes with {pool - small_pool} bytes of pool"


# MLA at DeepSeek-V3's shape: rows W = 512 + 64 = 576 (not a multiple of 128), v_dim 512, all 128
# heads or one TP-8 shard of 16; (row dtype, heads, page size, tokens): decode- and prefill-sized.
MLA_CASES = [
    ("bfloat16", 16, 64, 8),
    ("bfloat16", 128, 128, 8),
    ("float8_e4m3fn", 16, 128, 512),
    ("float8_e5m2", 128, 64, 64),
]


@pytest.mark.parametrize("kv_dtype,heads,page_size,tokens", MLA_CASES)
def test_mla_compiles(tpu, kv_dtype, heads, page_size, tokens):
    _, sharding = tpu
    spec = lambda shape, dtype: _spec(shape, dtype, sharding)
    seqs, max_blocks = 8, 32
    pages = seqs * max_blocks + 1
    scale = spec((pages,), jnp.float32) if jnp.dtype(kv_dtype).itemsize == 1 else None
    args = (
        spec((tokens, heads, 576), jnp.bfloat16),
        LatentPages(c=spec((pages, page_size, 576), kv_dtype), c_scale=scale),
        spec((seqs,), jnp.int32),
        spec((seqs, max_blocks), jnp.int32),
        spec((seqs + 1,), jnp.int32),
        spec((), jnp.int32),
    )

    def mla(*args):
        return mla_ragged_paged_attention(*args, sm_scale=192**-0.5, v_dim=512, impl="pallas_tpu")

    compiled = jax.jit(mla).trace(*args).lower().compile()
    assert compiled.out_info.shape == (tokens, heads, 512)


@pytest.mark.parametrize("kv_dtype,page_size", [("bfloat16", 128), ("float8_e4m3fn", 64)])
def test_mla_reads_a_row_major_pool_in_place(tpu, kv_dtype, page_size):
    """At W = 576 TPU's default layout may put another dim of the pool minor (page size 128 here),
    and the step then copies the whole pool before the kernel (benchmarks/mla_kernel_cost.py).
    Pinned to `pool_format` (rows minor) the compiled step holds no copy of it."""
    from pallas_kernels.mla_kernel_tpu import pool_format

    _, sharding = tpu
    spec = lambda shape, dtype: _spec(shape, dtype, sharding)
    seqs, max_blocks = 8, 32768 // page_size
    pages = seqs * max_blocks + 1
    scale = spec((pages,), jnp.float32) if jnp.dtype(kv_dtype).itemsize == 1 else None
    pool_shape = (pages, page_size, 576)
    pool_bytes = pages * page_size * 576 * jnp.dtype(kv_dtype).itemsize

    def compiled_with(pool_sharding):
        latent = LatentPages(c=jax.ShapeDtypeStruct(pool_shape, kv_dtype, sharding=pool_sharding), c_scale=scale)
        meta = (spec((seqs,), jnp.int32), spec((seqs, max_blocks), jnp.int32), spec((seqs + 1,), jnp.int32))
        args = (spec((seqs, 16, 576), jnp.bfloat16), latent, *meta, spec((), jnp.int32))
        mla = lambda *a: mla_ragged_paged_attention(*a, sm_scale=192**-0.5, v_dim=512, impl="pallas_tpu")
        return jax.jit(mla).trace(*args).lower().compile()

    pinned = compiled_with(pool_format(sharding))
    assert pinned.input_formats[0][1].c.layout.major_to_minor == (0, 1, 2)
    assert pinned.memory_analysis().temp_size_in_bytes < pool_bytes / 100
    assert not any(" copy(" in line and f"[{pages},{page_size},576]" in line for line in pinned.as_text().splitlines())
    if kv_dtype == "bfloat16":  # the trap the pinned layout avoids
        default = compiled_with(sharding)
        assert default.input_formats[0][1].c.layout.major_to_minor != (0, 1, 2)
        assert default.memory_analysis().temp_size_in_bytes >= pool_bytes
