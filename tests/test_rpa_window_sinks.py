"""Sliding windows and attention sinks in ragged paged attention, every implementation, against
a float64 numpy oracle written here (and, once, HF gpt-oss's own `eager_attention_forward`).

HF semantics (transformers/masking_utils.py `sliding_window_overlay` on top of causal): the
query at position p sees key k iff `p - window < k <= p`. gpt-oss sinks: one logit per query
head concatenated as an extra softmax column (not scaled), whose probability is dropped.
Pages wholly outside every window of a sequence are filled with NaN (k, v and FP8 scales): an
implementation that reads them, or multiplies them by a zero probability, returns NaN.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import gpu_kernel_interpret

from pallas_kernels.kv_cache import KVPages
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

KV_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}
# (q_len, kv_len): decode rows, a prefill chunk starting mid-context, a whole prompt, a one-token
# context; lengths not multiples of the page size (16).
SEQS = [(1, 37), (23, 50), (1, 1), (17, 17), (1, 16), (3, 70)]


@dataclasses.dataclass
class Batch:
    q: jax.Array
    kv: KVPages
    kv_lens: jax.Array
    block_tables: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    real_tokens: int
    dense: list  # per sequence: float64 (q [q_len, Hq, D], k [kv_len, Hkv, D], v)
    poisoned_pages: int


def make_batch(rng, seqs, *, num_q_heads, num_kv_heads, head_dim=64, page_size=16, kv_dtype="bf16", window=None):
    """Pages permuted in a pool whose unused slots, padding tokens and (with a window) pages
    wholly before the first key any query of the sequence sees are NaN."""
    storage = KV_DTYPES[kv_dtype]
    fp8 = kv_dtype == "fp8"
    fmax = float(ml_dtypes.finfo(storage).max)
    blocks = [-(-kv_len // page_size) for _, kv_len in seqs]
    max_blocks = max(blocks) + 1
    num_pages = 1 + sum(blocks) + 2
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    pages = {name: np.full(shape, np.nan, np.float32).astype(storage) for name in "kv"}
    scales = {name: np.full(shape[:2], np.nan, np.float32) for name in "kv"}
    free = list(rng.permutation(np.arange(1, num_pages)))
    pad_seqs = 2
    block_tables = np.zeros((len(seqs) + pad_seqs, max_blocks), np.int32)
    kv_lens = np.zeros(len(seqs) + pad_seqs, np.int32)
    cu, q_parts, dense, poisoned = [0], [], [], 0
    for s, (q_len, kv_len) in enumerate(seqs):
        kv_lens[s] = kv_len
        cu.append(cu[-1] + q_len)
        lowest_seen = 0 if window is None else max(0, kv_len - q_len - window + 1)
        ctx = {name: np.zeros((kv_len, num_kv_heads, head_dim)) for name in "kv"}
        for b in range(blocks[s]):
            page = free.pop()
            block_tables[s, b] = page
            n = min(page_size, kv_len - b * page_size)
            for name, spread in (("k", 2.0), ("v", 3.0)):
                raw = rng.normal(size=(num_kv_heads, n, head_dim)) * spread
                if fp8:
                    scale = np.abs(raw).max(axis=(1, 2)) / fmax
                    stored = np.clip(raw / scale[:, None, None], -fmax, fmax).astype(storage)
                    value = stored.astype(np.float64) * scale.astype(np.float32)[:, None, None]
                else:
                    scale, stored = None, raw.astype(storage)
                    value = stored.astype(np.float64)
                ctx[name][b * page_size : b * page_size + n] = value.transpose(1, 0, 2)
                if (b + 1) * page_size <= lowest_seen:
                    continue  # wholly outside every window of this sequence: left NaN
                pages[name][page, :, :n] = stored
                if fp8:
                    scales[name][page] = scale
            poisoned += (b + 1) * page_size <= lowest_seen
        q_s = np.asarray(jnp.asarray(rng.normal(size=(q_len, num_q_heads, head_dim)), jnp.bfloat16), np.float64)
        q_parts.append(q_s)
        dense.append((q_s, ctx["k"], ctx["v"]))
    cu += [cu[-1]] * pad_seqs
    q = np.concatenate(q_parts + [np.full((3, num_q_heads, head_dim), np.nan)])
    kv = KVPages(
        k=jnp.asarray(pages["k"]),
        v=jnp.asarray(pages["v"]),
        k_scale=jnp.asarray(scales["k"]) if fp8 else None,
        v_scale=jnp.asarray(scales["v"]) if fp8 else None,
    )
    return Batch(
        q=jnp.asarray(q, jnp.bfloat16),
        kv=kv,
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.asarray(len(seqs), jnp.int32),
        real_tokens=cu[-1],
        dense=dense,
        poisoned_pages=poisoned,
    )


def oracle(batch: Batch, *, sm_scale, window=None, sinks=None, soft_cap=None) -> np.ndarray:
    """Float64 dense attention per sequence: explicit window mask, sink column appended and dropped."""
    outs = []
    for q, k, v in batch.dense:
        q_len, num_q_heads, _ = q.shape
        kv_len, num_kv_heads, _ = k.shape
        kv_head = np.arange(num_q_heads) // (num_q_heads // num_kv_heads)
        logits = np.einsum("qhd,khd->hqk", q, k[:, kv_head]) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        p = np.arange(kv_len - q_len, kv_len)[:, None]
        key = np.arange(kv_len)[None, :]
        visible = key <= p
        if window is not None:
            visible &= p - window < key
        logits = np.where(visible, logits, -np.inf)
        if sinks is not None:
            sink_column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (num_q_heads, q_len, 1))
            logits = np.concatenate([logits, sink_column], axis=-1)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs = (probs / probs.sum(-1, keepdims=True))[..., :kv_len]
        outs.append(np.einsum("hqk,khd->qhd", probs, v[:, kv_head]))
    return np.concatenate(outs)


def run(batch: Batch, impl, **options) -> np.ndarray:
    interpret = {"pallas_tpu": pltpu.InterpretParams(), "pallas_gpu": gpu_kernel_interpret()}.get(impl, False)
    try:
        out = ragged_paged_attention(
            batch.q,
            batch.kv,
            batch.kv_lens,
            batch.block_tables,
            batch.cu_q_lens,
            batch.num_seqs,
            impl=impl,
            interpret=interpret,
            **options,
        )
    finally:
        if impl == "pallas_tpu":
            pltpu.reset_tpu_interpret_mode_state()
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    return np.asarray(out.astype(jnp.float32))[: batch.real_tokens]


def random_sinks(rng, num_q_heads):
    """Logits around the scores' range, so the sink takes a visible share of the softmax."""
    return jnp.asarray(rng.uniform(-2.0, 3.0, size=num_q_heads), jnp.float32)


def assert_matches(got, want):
    assert np.isfinite(got).all(), "NaN from a page outside the window (or a padding slot)"
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)  # bf16 output


IMPLS = ["reference", "chunked", "native", "pallas_tpu", "pallas_gpu"]
# (group, kv dtype, window, sinks): windows smaller than a page, of 1, across pages, wider than
# every context; GQA ratios 1 and 4; sinks alone, windows alone, both.
CASES = [
    (4, "bf16", 5, True),
    (1, "fp8", 20, True),
    (4, "fp8", 1, False),
    (1, "bf16", 1000, True),
    (4, "bf16", None, True),
    (1, "bf16", 33, False),
]


# The interpreted Pallas kernels are slow on CPU: the first four cases cover windows, sinks,
# FP8 and both groups for them; the jnp and C++ paths run all.
RUNS = [(impl, case) for impl in IMPLS for case in (CASES[:4] if impl.startswith("pallas") else CASES)]


@pytest.mark.parametrize("impl,case", RUNS, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x)))
def test_window_and_sinks_match_oracle(impl, case):
    group, kv_dtype, window, with_sinks = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    batch = make_batch(rng, SEQS, num_q_heads=2 * group, num_kv_heads=2, kv_dtype=kv_dtype, window=window)
    assert window in (None, 1000) or batch.poisoned_pages > 0
    sinks = random_sinks(rng, 2 * group) if with_sinks else None
    options = dict(sm_scale=0.125, sliding_window=window, sinks=sinks)
    want = oracle(batch, sm_scale=0.125, window=window, sinks=None if sinks is None else np.asarray(sinks))
    assert_matches(run(batch, impl, **options), want)


@pytest.mark.parametrize("impl", ["reference", "chunked", "native", "pallas_tpu"])
def test_pages_of_8_under_a_window(impl):
    """Pages smaller than the C++ kernel's 16-key groups: a group starting before the window
    spans a NaN page. (The GPU kernel needs pages of >= 16.)"""
    rng = np.random.default_rng(8)
    batch = make_batch(rng, SEQS, num_q_heads=8, num_kv_heads=2, page_size=8, window=5)
    assert batch.poisoned_pages > 0
    sinks = random_sinks(rng, 8)
    want = oracle(batch, sm_scale=0.125, window=5, sinks=np.asarray(sinks))
    assert_matches(run(batch, impl, sm_scale=0.125, sliding_window=5, sinks=sinks), want)


@pytest.mark.parametrize("impl", ["reference", "chunked", "native"])
def test_sinks_with_soft_cap_and_fp8(impl):
    """Sinks are added as given, after the cap (a gpt-oss layer has no cap; the two compose)."""
    rng = np.random.default_rng(9)
    batch = make_batch(rng, SEQS, num_q_heads=8, num_kv_heads=2, kv_dtype="fp8", window=24)
    sinks = random_sinks(rng, 8)
    want = oracle(batch, sm_scale=0.3, window=24, soft_cap=4.0, sinks=np.asarray(sinks))
    assert_matches(run(batch, impl, sm_scale=0.3, sliding_window=24, soft_cap=4.0, sinks=sinks), want)


@pytest.mark.parametrize("impl", ["reference", "chunked", "native"])
def test_sinks_change_the_output(impl):
    """Guards the oracle comparison: a strong sink shrinks every output towards zero."""
    rng = np.random.default_rng(4)
    batch = make_batch(rng, SEQS, num_q_heads=4, num_kv_heads=2)
    plain = run(batch, impl, sm_scale=0.125)
    sunk = run(batch, impl, sm_scale=0.125, sinks=jnp.full((4,), 30.0))
    assert np.abs(sunk).max() < 1e-3 * np.abs(plain).max()


def test_matches_hf_gpt_oss_eager_attention():
    """HF's own gpt-oss attention with its sinks, under a sliding-window causal mask built here."""
    torch = pytest.importorskip("torch")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    rng = np.random.default_rng(12)
    group, window, sm_scale = 4, 6, 0.125
    seqs = [(9, 30)]  # a chunk late in the context: the window cuts it
    batch = make_batch(rng, seqs, num_q_heads=2 * group, num_kv_heads=2, window=window)
    sinks = random_sinks(rng, 2 * group)
    q, k, v = batch.dense[0]
    q_len, kv_len = seqs[0]
    p = np.arange(kv_len - q_len, kv_len)[:, None]
    key = np.arange(kv_len)[None, :]
    mask = np.where((key <= p) & (key > p - window), 0.0, -np.inf)[None, None]
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.tensor(np.asarray(sinks), dtype=torch.float64))
    module.num_key_value_groups = group
    module.eval()
    to_heads = lambda x: torch.tensor(x).permute(1, 0, 2)[None]  # [1, H, L, D]
    hf_out, _ = eager_attention_forward(
        module, to_heads(q), to_heads(k), to_heads(v), torch.tensor(mask), scaling=sm_scale
    )
    want = hf_out[0].detach().numpy()  # [q_len, Hq, D]
    for impl in ("reference", "chunked", "native"):
        assert_matches(run(batch, impl, sm_scale=sm_scale, sliding_window=window, sinks=sinks), want)


def test_sinks_shape_is_checked():
    rng = np.random.default_rng(0)
    batch = make_batch(rng, [(1, 5)], num_q_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="sinks"):
        run(batch, "reference", sm_scale=1.0, sinks=jnp.zeros((2,)))


def _abstract_args(kv_dtype, *, sharding=None, tokens=48, q_heads=8, kv_heads=2, head_dim=128, page_size=16):
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    seqs, max_blocks = 6, 8
    page_shape = (seqs * max_blocks + 1, kv_heads, page_size, head_dim)
    scale = sds(page_shape[:2], jnp.float32) if jnp.dtype(kv_dtype).itemsize == 1 else None
    kv = KVPages(k=sds(page_shape, kv_dtype), v=sds(page_shape, kv_dtype), k_scale=scale, v_scale=scale)
    metadata = (sds((seqs,), jnp.int32), sds((seqs, max_blocks), jnp.int32), sds((seqs + 1,), jnp.int32))
    return (
        sds((tokens, q_heads, head_dim), jnp.bfloat16),
        kv,
        *metadata,
        sds((), jnp.int32),
        sds((q_heads,), "float32"),
    )


def _attention(impl):
    def attention(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sinks):
        return ragged_paged_attention(
            q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=0.1, sliding_window=40, sinks=sinks, impl=impl
        )

    return attention


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_gpu_kernel_with_window_and_sinks_lowers_for_cuda(kv_dtype):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(_attention("pallas_gpu")).trace(*_abstract_args(kv_dtype)).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_tpu_kernel_with_window_and_sinks_compiles_for_v5e(kv_dtype):
    """The real Mosaic compiler (libtpu, no TPU attached), as tests/test_kernels_tpu_aot.py."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        topology = topologies.get_topology_desc("v5e=1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    except Exception as e:  # no libtpu in this environment
        pytest.skip(f"no TPU topology (libtpu) here: {e}")
    sharding = NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())
    args = _abstract_args(kv_dtype, sharding=sharding)
    compiled = jax.jit(_attention("pallas_tpu")).trace(*args).lower().compile()
    assert compiled.out_info.shape == (48, 8, 128)


def test_tpu_kernel_copies_no_page_outside_the_window():
    """Block-table entries of pages wholly outside the window point past the pool: the TPU
    simulator raises on an out-of-bounds DMA, so passing means those pages were never copied
    (masking alone would not: the key block is several pages, starting at the window's page)."""
    rng = np.random.default_rng(21)
    seqs = [(1, 90), (4, 77), (1, 40)]
    batch = make_batch(rng, seqs, num_q_heads=8, num_kv_heads=2, kv_dtype="fp8", window=20)
    tables = np.asarray(batch.block_tables).copy()
    num_pages = batch.kv.k.shape[0]
    for s, (q_len, kv_len) in enumerate(seqs):
        lowest_seen = kv_len - q_len - 20 + 1
        tables[s, : lowest_seen // 16] = num_pages + 1000
    batch.block_tables = jnp.asarray(tables)
    sinks = random_sinks(rng, 8)
    got = run(batch, "pallas_tpu", sm_scale=0.125, sliding_window=20, sinks=sinks)
    assert_matches(got, oracle(batch, sm_scale=0.125, window=20, sinks=np.asarray(sinks)))
