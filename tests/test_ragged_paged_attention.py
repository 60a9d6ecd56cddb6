"""Ragged paged attention: reference vs a float64 numpy oracle, kernels vs reference.

Batches are random and ragged: awkward lengths, partly filled and permuted pages, padded
tokens / sequences / page slots / the null page poisoned with NaN; only real tokens compared.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import gpu_kernel_interpret

from pallas_kernels.kv_cache import KVPages
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

LENGTHS = (1, 15, 16, 17, 63, 64, 65, 300)
FP8 = {"fp8_e4m3fn": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
KV_DTYPES = {"float32": np.float32, "bf16": ml_dtypes.bfloat16, **FP8}


@dataclasses.dataclass
class Batch:
    q: jax.Array
    kv: KVPages
    kv_lens: jax.Array
    block_tables: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    real_tokens: int
    # float64 copies for the oracle: per real sequence (q [q_len,Hq,D], k/v [kv_len,Hkv,D])
    dense: list


def make_batch(
    rng,
    seqs,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    kv_dtype,
    q_dtype=jnp.bfloat16,
    pad_tokens=3,
    pad_seqs=2,
    spare_blocks=1,
    spare_pages=3,
) -> Batch:
    """seqs: list of (q_len, kv_len) with q_len <= kv_len."""
    storage = KV_DTYPES[kv_dtype]
    fp8 = kv_dtype in FP8
    blocks = [-(-kv_len // page_size) for _, kv_len in seqs]
    max_blocks = max(blocks) + spare_blocks
    num_pages = 1 + sum(blocks) + spare_pages
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_pages = np.full(shape, np.nan, np.float32).astype(storage)
    v_pages = np.full(shape, np.nan, np.float32).astype(storage)
    k_scale = np.full(shape[:2], np.nan, np.float32)
    v_scale = np.full(shape[:2], np.nan, np.float32)
    free_pages = list(rng.permutation(np.arange(1, num_pages)))
    num_seqs_padded = len(seqs) + pad_seqs
    block_tables = np.zeros((num_seqs_padded, max_blocks), np.int32)
    kv_lens = np.zeros(num_seqs_padded, np.int32)
    cu = [0]
    q_parts, dense = [], []
    for s, (q_len, kv_len) in enumerate(seqs):
        kv_lens[s] = kv_len
        cu.append(cu[-1] + q_len)
        k_ctx = np.zeros((kv_len, num_kv_heads, head_dim))
        v_ctx = np.zeros((kv_len, num_kv_heads, head_dim))
        for b in range(blocks[s]):
            page = free_pages.pop()
            block_tables[s, b] = page
            n = min(page_size, kv_len - b * page_size)
            for pages, scales, ctx, spread in ((k_pages, k_scale, k_ctx, 2.0), (v_pages, v_scale, v_ctx, 3.0)):
                raw = rng.normal(size=(num_kv_heads, n, head_dim)) * spread * rng.uniform(0.5, 4.0)
                if fp8:
                    scale = np.abs(raw).max(axis=(1, 2)) / float(ml_dtypes.finfo(storage).max)
                    stored = np.clip(
                        raw / scale[:, None, None], -ml_dtypes.finfo(storage).max, ml_dtypes.finfo(storage).max
                    ).astype(storage)
                    scales[page] = scale
                    value = stored.astype(np.float64) * scale.astype(np.float32)[:, None, None]
                else:
                    stored = raw.astype(storage)
                    value = stored.astype(np.float64)
                pages[page, :, :n] = stored
                ctx[b * page_size : b * page_size + n] = value.transpose(1, 0, 2)
        q_s = rng.normal(size=(q_len, num_q_heads, head_dim)).astype(np.float32)
        q_s = np.asarray(jnp.asarray(q_s, q_dtype).astype(jnp.float32))
        q_parts.append(q_s)
        dense.append((q_s.astype(np.float64), k_ctx, v_ctx))
    cu += [cu[-1]] * pad_seqs
    real_tokens = cu[-1]
    q = np.concatenate(q_parts + [np.full((pad_tokens, num_q_heads, head_dim), np.nan)])
    kv = KVPages(
        k=jnp.asarray(k_pages),
        v=jnp.asarray(v_pages),
        k_scale=jnp.asarray(k_scale) if fp8 else None,
        v_scale=jnp.asarray(v_scale) if fp8 else None,
    )
    return Batch(
        q=jnp.asarray(q, q_dtype),
        kv=kv,
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.asarray(len(seqs), jnp.int32),
        real_tokens=real_tokens,
        dense=dense,
    )


def oracle(batch: Batch, *, sm_scale, sliding_window=None, soft_cap=None) -> np.ndarray:
    """Float64 dense causal attention, one sequence at a time."""
    outs = []
    for q, k, v in batch.dense:
        q_len, num_q_heads, _ = q.shape
        kv_len, num_kv_heads, _ = k.shape
        kv_head = np.arange(num_q_heads) // (num_q_heads // num_kv_heads)
        scores = np.einsum("qhd,khd->hqk", q, k[:, kv_head]) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        q_pos = np.arange(kv_len - q_len, kv_len)[:, None]
        k_pos = np.arange(kv_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        outs.append(np.einsum("hqk,khd->qhd", probs, v[:, kv_head]))
    return np.concatenate(outs)


def run(batch: Batch, **kwargs) -> np.ndarray:
    out = ragged_paged_attention(
        batch.q, batch.kv, batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs, **kwargs
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    return np.asarray(out.astype(jnp.float32))[: batch.real_tokens]


def assert_close_bf16(got, want):
    """bf16 matmul inputs and outputs: errors scale with the largest output magnitude."""
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max(), rtol=2e-2)


def random_seqs(rng, kind: str, count: int):
    """(q_len, kv_len) pairs: decode (q_len 1), prefill (q_len == kv_len) or mixed chunks."""
    seqs = []
    for _ in range(count):
        kv_len = int(rng.choice(LENGTHS))
        if kind == "decode":
            q_len = 1
        elif kind == "prefill":
            q_len = kv_len
        else:
            q_len = int(rng.choice([1, kv_len, int(rng.integers(1, kv_len + 1))]))
        seqs.append((q_len, kv_len))
    return seqs


# ---------------------------------------------------------------- reference vs numpy oracle


@pytest.mark.parametrize(
    "kind,kv_dtype",
    [
        ("decode", "bf16"),
        ("prefill", "bf16"),
        ("mixed", "bf16"),
        ("mixed", "float32"),
        ("decode", "fp8_e4m3fn"),
        ("prefill", "fp8_e4m3fn"),
        ("mixed", "fp8_e5m2"),
    ],
)
@pytest.mark.parametrize("impl", ["reference", "chunked", "chunked-bit-storage", "native", "native-bit-storage"])
def test_reference_matches_oracle(kind, kv_dtype, impl):
    rng = np.random.default_rng(zlib.crc32(f"{kind}-{kv_dtype}".encode()))
    seqs = random_seqs(rng, kind, 4)
    batch = make_batch(
        rng, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, kv_dtype=kv_dtype, q_dtype=jnp.float32
    )
    if impl.endswith("-bit-storage"):  # bf16 / FP8 pages held as uint16 / uint8 bits (CPU serving)
        impl, batch.kv = impl.removesuffix("-bit-storage"), batch.kv.with_bit_storage()
        assert kv_dtype == "float32" or jnp.issubdtype(batch.kv.k.dtype, jnp.unsignedinteger)
    got = run(batch, sm_scale=0.125, impl=impl)
    np.testing.assert_allclose(got, oracle(batch, sm_scale=0.125), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "group,sliding_window,soft_cap",
    [(1, None, None), (4, 20, None), (8, None, 3.0), (4, 7, 5.0), (8, 20, None), (1, 7, 5.0)],
)
@pytest.mark.parametrize("impl", ["reference", "chunked", "native"])
def test_reference_gqa_window_softcap(group, sliding_window, soft_cap, impl):
    rng = np.random.default_rng(group * 100 + (sliding_window or 0))
    seqs = [(65, 65), (1, 300), (17, 63), (16, 16), (5, 15)]
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        kv_dtype="bf16",
        q_dtype=jnp.float32,
    )
    options = dict(sm_scale=0.3, sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(run(batch, **options, impl=impl), oracle(batch, **options), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("group,sliding_window,soft_cap", [(8, 20, 3.0), (1, None, None)])
@pytest.mark.parametrize("impl", ["reference", "chunked", "native"])
def test_reference_decode_batch(group, sliding_window, soft_cap, impl):
    """A pure decode step (every sequence has one query) takes the all-sequences-at-once path."""
    rng = np.random.default_rng(5)
    seqs = [(1, n) for n in (300, 1, 16, 17, 64)]
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        kv_dtype="fp8_e5m2",
        q_dtype=jnp.float32,
    )
    batch.num_seqs = batch.num_seqs.reshape(1)  # the contract allows [] or [1]
    options = dict(sm_scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(run(batch, **options, impl=impl), oracle(batch, **options), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size,head_dim", [(8, 128), (32, 64), (16, 80)])
def test_native_page_sizes_and_head_dims(page_size, head_dim):
    """The C++ kernel gathers keys 16 at a time across pages of any size; head dims it has a
    constant for (64 / 128 / 256) and one it has not (80: the runtime-dim loops)."""
    rng = np.random.default_rng(page_size + head_dim)
    seqs = [(40, 40), (1, 75), (17, 50), (1, 1), (3, 33)]
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype="bf16",
        q_dtype=jnp.float32,
        pad_tokens=3,
        pad_seqs=2,
    )
    options = dict(sm_scale=head_dim**-0.5, sliding_window=30)
    np.testing.assert_allclose(run(batch, **options, impl="native"), oracle(batch, **options), atol=2e-4, rtol=1e-4)


def test_reference_bf16_queries_and_no_nan_leak():
    rng = np.random.default_rng(7)
    seqs = [(1, 300), (63, 64), (15, 15)]
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=128,
        page_size=16,
        kv_dtype="fp8_e4m3fn",
        pad_tokens=5,
        pad_seqs=3,
    )
    got = run(batch, sm_scale=128**-0.5)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, oracle(batch, sm_scale=128**-0.5), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- kernels vs reference

KERNEL_CASES = [
    # (impl, kind, kv_dtype, group, head_dim, page_size, sliding_window, soft_cap)
    ("pallas_tpu", "mixed", "bf16", 1, 64, 16, None, None),
    ("pallas_tpu", "decode", "fp8_e4m3fn", 4, 128, 16, None, None),
    ("pallas_tpu", "prefill", "fp8_e5m2", 8, 64, 16, 20, 4.0),
    ("pallas_tpu", "mixed", "bf16", 4, 256, 16, None, 2.0),
    ("pallas_gpu", "mixed", "bf16", 1, 64, 16, None, None),
    ("pallas_gpu", "decode", "fp8_e5m2", 4, 128, 16, None, None),
    ("pallas_gpu", "prefill", "fp8_e4m3fn", 8, 64, 16, 20, 4.0),
    ("pallas_gpu", "mixed", "bf16", 4, 256, 32, 33, None),
    ("pallas_gpu", "mixed", "bf16", 3, 64, 16, None, None),  # group padded to 4 (SmolLM2's GQA)
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference(case):
    impl, kind, kv_dtype, group, head_dim, page_size, sliding_window, soft_cap = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    seqs = random_seqs(rng, kind, 3)
    batch = make_batch(
        rng, seqs, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size, kv_dtype=kv_dtype
    )
    options = dict(sm_scale=head_dim**-0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    want = run(batch, **options)
    # The TPU kernel runs under the TPU simulator (stricter about DMAs than interpret=True).
    interpret = pltpu.InterpretParams() if impl == "pallas_tpu" else gpu_kernel_interpret()
    try:
        got = run(batch, impl=impl, interpret=interpret, **options)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert np.isfinite(got).all()
    assert_close_bf16(got, want)
    assert_close_bf16(got, oracle(batch, **options))


# (kind, kv dtype, group, head_dim, page_size, pages_per_block, sliding_window): head dims below 128
# with pages stored token-minor [P, Hkv, D, ps], as the TPU engine holds them (pallas_kernels/kv_cache.py)
TOKEN_MINOR_CASES = [
    ("mixed", "bf16", 4, 32, 128, None, None),
    ("decode", "fp8_e4m3fn", 2, 64, 128, 2, None),
    ("prefill", "bf16", 1, 16, 256, None, 100),
]


@pytest.mark.parametrize("case", TOKEN_MINOR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_tpu_kernel_reads_token_minor_pages(case):
    from pallas_kernels.rpa_kernel_tpu import ragged_paged_attention_tpu

    kind, kv_dtype, group, head_dim, page_size, pages_per_block, sliding_window = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    seqs = random_seqs(rng, kind, 3)
    batch = make_batch(
        rng, seqs, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size, kv_dtype=kv_dtype
    )
    minor = dataclasses.replace(batch, kv=batch.kv.with_token_minor(True))
    assert minor.kv.k.shape[2:] == (head_dim, page_size) and minor.kv.page_size == page_size
    options = dict(sm_scale=head_dim**-0.5, sliding_window=sliding_window)
    args = (minor.q, minor.kv, minor.kv_lens, minor.block_tables, minor.cu_q_lens, minor.num_seqs)
    try:
        got = ragged_paged_attention_tpu(
            *args, **options, pages_per_block=pages_per_block, interpret=pltpu.InterpretParams()
        )
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    got = np.asarray(got.astype(jnp.float32))[: batch.real_tokens]
    assert np.isfinite(got).all()
    assert_close_bf16(got, oracle(batch, **options))
    # the jnp paths read token-minor pages too (through a head-major copy)
    assert_close_bf16(run(minor, impl="chunked", **options), oracle(batch, **options))


def test_tpu_kernel_under_tpu_simulator():
    rng = np.random.default_rng(11)
    seqs = [(17, 17), (1, 65), (5, 40)]
    batch = make_batch(rng, seqs, num_q_heads=4, num_kv_heads=1, head_dim=128, page_size=16, kv_dtype="fp8_e4m3fn")
    options = dict(sm_scale=128**-0.5, sliding_window=30)
    want = run(batch, **options)
    try:
        # impl="pallas" on CPU with an interpreter picks the TPU kernel.
        got = run(batch, impl="pallas", interpret=pltpu.InterpretParams(detect_races=True), **options)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert np.isfinite(got).all()
    assert_close_bf16(got, want)


@pytest.mark.parametrize("seqs", [[(1, 40), (1, 7), (1, 130)], [(3, 20), (1, 50), (1, 1)]], ids=["decode", "mixed"])
@pytest.mark.parametrize("impl", ["chunked", "native"])
def test_chunked_with_fewer_tokens_than_sequence_slots(seqs, impl):
    """A small token bucket under a large max_num_seqs: the decode pass runs one row per token."""
    rng = np.random.default_rng(len(seqs))
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        kv_dtype="bf16",
        q_dtype=jnp.float32,
        pad_tokens=2,
        pad_seqs=12,
    )
    assert batch.q.shape[0] < batch.kv_lens.shape[0]
    np.testing.assert_allclose(
        run(batch, sm_scale=0.125, impl=impl), oracle(batch, sm_scale=0.125), atol=2e-4, rtol=1e-4
    )


def test_bit_storage_is_refused_by_pallas_kernels():
    rng = np.random.default_rng(3)
    batch = make_batch(
        rng, [(1, 20)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, kv_dtype="bf16", q_dtype=jnp.float32
    )
    batch.kv = batch.kv.with_bit_storage()
    with pytest.raises(ValueError, match="bit storage"):
        run(batch, sm_scale=0.125, impl="pallas_tpu", interpret=True)
    # ... and the reference reads it like float storage
    np.testing.assert_allclose(
        run(batch, sm_scale=0.125, impl="reference"), oracle(batch, sm_scale=0.125), atol=2e-4, rtol=1e-4
    )


def test_input_validation():
    rng = np.random.default_rng(0)
    batch = make_batch(rng, [(1, 5)], num_q_heads=3, num_kv_heads=2, head_dim=64, page_size=16, kv_dtype="bf16")
    with pytest.raises(ValueError, match="multiple"):
        run(batch, sm_scale=1.0)


# ---------------------------------------------------------------- lowering without hardware


def _abstract_args(
    kv_dtype, head_dim, *, tokens=48, q_heads=8, kv_heads=2, pages=24, page_size=16, seqs=6, max_blocks=8
):
    sds = jax.ShapeDtypeStruct
    page_shape = (pages, kv_heads, page_size, head_dim)
    fp8 = jnp.dtype(kv_dtype).itemsize == 1
    scale = sds(page_shape[:2], jnp.float32) if fp8 else None
    kv = KVPages(k=sds(page_shape, kv_dtype), v=sds(page_shape, kv_dtype), k_scale=scale, v_scale=scale)
    return (
        sds((tokens, q_heads, head_dim), jnp.bfloat16),
        kv,
        sds((seqs,), jnp.int32),
        sds((seqs, max_blocks), jnp.int32),
        sds((seqs + 1,), jnp.int32),
        sds((), jnp.int32),
    )


LOWERING_CASES = [("bfloat16", 128), ("float8_e4m3fn", 64), ("float8_e5m2", 256)]


@pytest.mark.parametrize("kv_dtype,head_dim", LOWERING_CASES)
def test_tpu_kernel_exports_for_tpu(kv_dtype, head_dim):
    def attention(*args):
        return ragged_paged_attention(*args, sm_scale=0.1, sliding_window=40, soft_cap=30.0, impl="pallas_tpu")

    exported = jax.export.export(jax.jit(attention), platforms=["tpu"])(*_abstract_args(kv_dtype, head_dim))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("kv_dtype,head_dim", LOWERING_CASES)
def test_gpu_kernel_lowers_for_cuda(kv_dtype, head_dim):
    def attention(*args):
        return ragged_paged_attention(*args, sm_scale=0.1, soft_cap=30.0, impl="pallas_gpu")

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(attention).trace(*_abstract_args(kv_dtype, head_dim)).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
