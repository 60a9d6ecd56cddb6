"""MLA over paged latent rows: every implementation vs float64 numpy oracles.

The first oracle is MLA *un-absorbed*: it expands each token's latent into per-head K and V with
random up-projections (what HF's DeepseekV3Attention does) and runs plain causal softmax
attention; the op under test gets the absorbed query `q_nope @ W_UK_h ++ q_pe` and its output is
multiplied by W_UV_h afterwards. So the test checks the absorption identity as well as the paging.
The second is the absorbed form written directly (one shared row as key, its first v_dim channels
as value) on the stored (rounded, dequantized) rows. Pages are permuted, the spare page slots, the
null page and the scales of unused pages poisoned with NaN, the batch ragged (prefill chunks and
decodes) with padding tokens and sequences. The Pallas kernels run under the TPU simulator
(`pltpu.InterpretParams`) and the GPU Pallas interpreter on CPU, compiled on a GPU.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import gpu_kernel_interpret

from pallas_kernels.mla import KERNELS, LatentPages, mla_ragged_paged_attention

H, L, R, DN, DV = 3, 40, 8, 12, 10  # heads, kv_lora_rank, rope dim, qk_nope dim, v dim: awkward
PAGE = 16
SEQS = [(1, 1), (5, 19), (1, 33), (17, 17), (3, 40)]  # (q_len, kv_len): decodes and prefill chunks


def _batch(rng, seqs, dtype, *, width, page=PAGE, fp8_scales=False):
    """seqs: (q_len, kv_len) pairs. Returns the op's operands and, per sequence, its rows as stored
    (rounded to `dtype`, times the page scale for FP8) in float64."""
    blocks = [-(-kv // page) for _, kv in seqs]
    max_blocks = max(blocks) + 1
    num_pages = 1 + sum(blocks) + 2
    pages = np.full((num_pages, page, width), np.nan, np.float32)
    scales = np.full(num_pages, np.nan, np.float32)  # unused pages' scales: NaN
    order = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(seqs) + 2, max_blocks), np.int32)  # two padded sequences
    rows_of, used = [], 0
    for s, (_, kv) in enumerate(seqs):
        rows = rng.standard_normal((kv, width)).astype(np.float32) * 2.0
        stored = np.zeros((kv, width))
        for b in range(blocks[s]):
            pid = order[used]
            used += 1
            tables[s, b] = pid
            chunk = rows[b * page : (b + 1) * page]
            scales[pid] = rng.uniform(0.25, 4.0) if fp8_scales else 1.0
            pages[pid, : len(chunk)] = chunk / scales[pid]
            rounded = pages[pid, : len(chunk)].astype(dtype).astype(np.float64)
            stored[b * page : b * page + len(chunk)] = rounded * np.float64(scales[pid])
        rows_of.append(stored)
    q_lens = [q for q, _ in seqs]
    cu = np.zeros(len(seqs) + 3, np.int32)
    cu[1 : len(seqs) + 1] = np.cumsum(q_lens)
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    kv_lens = np.array([kv for _, kv in seqs] + [0, 0], np.int32)
    latent = LatentPages(c=jnp.asarray(pages.astype(dtype)), c_scale=jnp.asarray(scales) if fp8_scales else None)
    return latent, kv_lens, tables, cu, sum(q_lens) + 3, rows_of


def _absorbed_oracle(q, rows_of, seqs, cu, scale, v_dim):
    """float64: softmax(q . row * scale) @ row[:, :v_dim] over each query's causal prefix."""
    expected = np.zeros((int(cu[len(seqs)]), q.shape[1], v_dim))
    for s, (q_len, kv_len) in enumerate(seqs):
        for i in range(q_len):
            t, pos = cu[s] + i, kv_len - q_len + i
            rows = rows_of[s][: pos + 1]
            logits = rows @ q[t].T * scale  # [pos+1, H]
            p = np.exp(logits - logits.max(0))
            expected[t] = ((p / p.sum(0)).T @ rows)[:, :v_dim]
    return expected


def _run(q, latent, kv_lens, tables, cu, num_seqs, **options):
    out = mla_ragged_paged_attention(
        q,
        latent,
        jnp.asarray(kv_lens),
        jnp.asarray(tables),
        jnp.asarray(cu),
        jnp.asarray(num_seqs, jnp.int32),
        **options,
    )
    assert out.shape == (*q.shape[:2], options["v_dim"]) and out.dtype == q.dtype
    return np.asarray(out.astype(jnp.float32), np.float64)


def _interpret(impl, detect_races=False):
    if impl in ("pallas", "pallas_tpu"):  # the TPU simulator: stricter about DMAs than interpret=True
        return pltpu.InterpretParams(detect_races=detect_races)
    return gpu_kernel_interpret() if impl == "pallas_gpu" else False


@pytest.mark.parametrize("impl", list(KERNELS))
def test_every_impl_matches_unabsorbed_oracle(impl):
    rng = np.random.default_rng(0)
    latent, kv_lens, tables, cu, T, rows_of = _batch(rng, SEQS, np.float32, width=L + R)
    w_uk = rng.standard_normal((H, L, DN)) / np.sqrt(L)  # latent -> per-head nope key
    w_uv = rng.standard_normal((H, L, DV)) / np.sqrt(L)  # latent -> per-head value
    q_nope = rng.standard_normal((T, H, DN))
    q_pe = rng.standard_normal((T, H, R))
    scale = 1.0 / np.sqrt(DN + R)
    absorbed = np.concatenate([np.einsum("thd,hld->thl", q_nope, w_uk), q_pe], axis=-1)
    absorbed[int(cu[len(SEQS)]) :] = np.nan  # padding tokens

    # oracle: per-head K = [c @ W_UK_h, k_pe], V = c @ W_UV_h, causal softmax attention
    expected = np.zeros((T, H, DV))
    for s, (q_len, kv_len) in enumerate(SEQS):
        c, k_pe = rows_of[s][:, :L], rows_of[s][:, L:]
        for i in range(q_len):
            t, pos = cu[s] + i, kv_len - q_len + i
            for h in range(H):
                k = np.concatenate([c[: pos + 1] @ w_uk[h], k_pe[: pos + 1]], axis=-1)
                logits = k @ np.concatenate([q_nope[t, h], q_pe[t, h]]) * scale
                p = np.exp(logits - logits.max())
                expected[t, h] = (p / p.sum()) @ (c[: pos + 1] @ w_uv[h])
    real = int(cu[len(SEQS)])
    try:
        out = _run(
            jnp.asarray(absorbed, jnp.float32),
            latent,
            kv_lens,
            tables,
            cu,
            [len(SEQS)],
            sm_scale=scale,
            v_dim=L,
            impl=impl,
            interpret=_interpret(impl, detect_races=impl == "pallas"),
        )
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    got = np.einsum("thl,hld->thd", out[:real], w_uv)
    np.testing.assert_allclose(got, expected[:real], rtol=2e-5, atol=2e-5, err_msg=impl)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_low_precision_rows(dtype):
    """bf16 and FP8 rows (FP8 with per-page scales) against the oracle on the stored rows."""
    rng = np.random.default_rng(1)
    seqs = [(4, 21), (1, 9)]
    fp8 = dtype.startswith("float8")
    latent, kv_lens, tables, cu, T, rows_of = _batch(
        rng, seqs, getattr(ml_dtypes, dtype), width=L + R, page=8, fp8_scales=fp8
    )
    q = rng.standard_normal((T, H, L + R))
    expected = _absorbed_oracle(q, rows_of, seqs, cu, 0.2, L)
    for impl in ("reference", "chunked"):
        out = _run(
            jnp.asarray(q, jnp.float32), latent, kv_lens, tables, cu, len(seqs), sm_scale=0.2, v_dim=L, impl=impl
        )
        np.testing.assert_allclose(out[: len(expected)], expected, rtol=1e-4, atol=1e-4, err_msg=impl)


# (impl, heads, kv_lora_rank, rope dim, v_dim, page size, row dtype, q dtype, kernel options):
# awkward heads, widths (W not a multiple of 128, and for the TPU kernel not of 16 either), v_dim
# below L, several pages per key block and several query blocks per sequence.
KERNEL_CASES = [
    ("pallas_tpu", 3, 37, 8, 37, 8, "float32", "float32", dict(block_q=2, pages_per_block=2)),
    ("pallas_tpu", 4, 40, 8, 33, 16, "bfloat16", "bfloat16", {}),
    ("pallas_tpu", 5, 40, 24, 40, 8, "float8_e4m3fn", "bfloat16", dict(block_q=3, pages_per_block=3)),
    ("pallas_tpu", 2, 48, 16, 48, 32, "float8_e5m2", "float32", dict(pages_per_block=1)),
    # DeepSeek's rows (576 = 512 + 64, v_dim 512): the TPU kernel's value is a lane slice of the
    # tile, the GPU kernel's the first of its two lane pieces
    ("pallas_tpu", 4, 512, 64, 512, 16, "float8_e4m3fn", "bfloat16", {}),
    ("pallas_gpu", 4, 512, 64, 512, 16, "bfloat16", "bfloat16", {}),
    ("pallas_gpu", 3, 40, 8, 40, 16, "float32", "float32", {}),
    ("pallas_gpu", 5, 64, 16, 64, 16, "bfloat16", "bfloat16", dict(block_h=4)),
    ("pallas_gpu", 4, 40, 8, 33, 32, "float8_e4m3fn", "bfloat16", dict(block_q=8)),
    ("pallas_gpu", 2, 48, 16, 20, 16, "float8_e5m2", "float32", {}),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c[:-1])))
def test_kernel_matches_oracle(case):
    impl, heads, rank, rope, v_dim, page, dtype, q_dtype, options = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    fp8 = dtype.startswith("float8")
    latent, kv_lens, tables, cu, T, rows_of = _batch(
        rng, SEQS, getattr(ml_dtypes, dtype, np.float32), width=rank + rope, page=page, fp8_scales=fp8
    )
    real = int(cu[len(SEQS)])
    q = rng.standard_normal((T, heads, rank + rope)) * 0.3
    q[real:] = np.nan  # padding tokens
    q = jnp.asarray(q, q_dtype)
    scale = 1.0 / np.sqrt(rank + rope)
    expected = _absorbed_oracle(np.asarray(q.astype(jnp.float32), np.float64), rows_of, SEQS, cu, scale, v_dim)
    args = (q, latent, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.asarray(len(SEQS), jnp.int32))
    if impl == "pallas_tpu":
        from pallas_kernels.mla_kernel_tpu import mla_ragged_paged_attention_tpu as kernel
    else:
        from pallas_kernels.mla_kernel_gpu import mla_ragged_paged_attention_gpu as kernel
    try:
        got = kernel(*args, sm_scale=scale, v_dim=v_dim, interpret=_interpret(impl), **options)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert got.shape == (T, heads, v_dim) and got.dtype == q.dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)[:real]
    assert np.isfinite(got).all()
    if q_dtype == "float32":
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    else:  # bf16 matmul inputs and output: errors scale with the largest output
        np.testing.assert_allclose(got, expected, atol=1e-2 * np.abs(expected).max(), rtol=2e-2)


def test_bytes_per_token_and_bad_input():
    latent = LatentPages.create(4, 16, 576, jnp.bfloat16)
    assert latent.bytes_per_token() == 576 * 2
    fp8 = LatentPages.create(4, 16, 576, jnp.float8_e4m3fn)
    assert fp8.bytes_per_token() == 576 + 1  # 4-byte page scale over 16 tokens, rounded up
    args = (
        jnp.zeros((2,), jnp.int32),
        jnp.zeros((2, 1), jnp.int32),
        jnp.zeros((3,), jnp.int32),
        jnp.ones((1,), jnp.int32),
    )
    with pytest.raises(ValueError, match="q must be"):
        mla_ragged_paged_attention(jnp.zeros((4, 2, 100)), latent, *args, sm_scale=1.0, v_dim=512)
    with pytest.raises(ValueError, match="v_dim"):
        mla_ragged_paged_attention(jnp.zeros((4, 2, 576)), latent, *args, sm_scale=1.0, v_dim=600)
    with pytest.raises(ValueError, match="impl"):
        mla_ragged_paged_attention(jnp.zeros((4, 2, 576)), latent, *args, sm_scale=1.0, v_dim=512, impl="nope")
    bits = LatentPages.create(4, 16, 576, jnp.bfloat16, bit_storage=True)
    with pytest.raises(ValueError, match="bit storage"):
        mla_ragged_paged_attention(jnp.zeros((4, 2, 576)), bits, *args, sm_scale=1.0, v_dim=512, impl="pallas_tpu")
    with pytest.raises(ValueError, match="needs interpret"):
        mla_ragged_paged_attention(jnp.zeros((4, 2, 576)), latent, *args, sm_scale=1.0, v_dim=512, impl="pallas")
    small_pages = LatentPages.create(4, 8, 576, jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size >= 16"):
        mla_ragged_paged_attention(
            jnp.zeros((4, 2, 576)), small_pages, *args, sm_scale=1.0, v_dim=512, impl="pallas_gpu"
        )
    narrow = LatentPages.create(4, 16, 50, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        mla_ragged_paged_attention(jnp.zeros((4, 2, 50)), narrow, *args, sm_scale=1.0, v_dim=40, impl="pallas_gpu")


# ---------------------------------------------------------------- lowering without hardware


def _abstract_args(dtype, *, heads=16, width=576, page_size=64, tokens=8, seqs=8, max_blocks=32, sharding=None):
    """A DeepSeek-V3 layer's shapes on one TP-8 shard (16 of 128 heads, W = 512 + 64)."""
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)
    pages = seqs * max_blocks + 1
    scale = sds((pages,), jnp.float32) if jnp.dtype(dtype).itemsize == 1 else None
    return (
        sds((tokens, heads, width), jnp.bfloat16),
        LatentPages(c=sds((pages, page_size, width), dtype), c_scale=scale),
        sds((seqs,), jnp.int32),
        sds((seqs, max_blocks), jnp.int32),
        sds((seqs + 1,), jnp.int32),
        sds((), jnp.int32),
    )


def _mla(impl, v_dim=512):
    return lambda *args: mla_ragged_paged_attention(*args, sm_scale=192**-0.5, v_dim=v_dim, impl=impl)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_tpu_kernel_exports_for_tpu(dtype):
    exported = jax.export.export(jax.jit(_mla("pallas_tpu")), platforms=["tpu"])(*_abstract_args(dtype))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype,heads,page_size", [("bfloat16", 16, 64), ("float8_e4m3fn", 128, 128)])
def test_gpu_kernel_lowers_for_cuda(dtype, heads, page_size):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    args = _abstract_args(dtype, heads=heads, page_size=page_size, tokens=40)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(_mla("pallas_gpu")).trace(*args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
