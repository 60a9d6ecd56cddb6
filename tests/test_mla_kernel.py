"""MLA over paged latent rows: every implementation vs a float64 numpy oracle of MLA *un-absorbed*.

The oracle expands each token's latent into per-head K and V with random up-projections (what HF's
DeepseekV3Attention does) and runs plain causal softmax attention; the op under test gets the
absorbed query `q_nope @ W_UK_h ++ q_pe` and its output is multiplied by W_UV_h afterwards. So the
test checks the absorption identity as well as the paging. Pages are permuted, the spare page slots
and the null page poisoned with NaN, the batch ragged with padding tokens and sequences.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.mla import KERNELS, LatentPages, mla_ragged_paged_attention

H, L, R, DN, DV = 3, 40, 8, 12, 10  # heads, kv_lora_rank, rope dim, qk_nope dim, v dim: awkward
PAGE = 8


def _batch(rng, seqs, dtype):
    """seqs: (q_len, kv_len) pairs. Returns the op's operands and the oracle's dense per-sequence data."""
    W = L + R
    blocks = [-(-kv // PAGE) for _, kv in seqs]
    max_blocks = max(blocks) + 1
    num_pages = 1 + sum(blocks) + 2
    pages = np.full((num_pages, PAGE, W), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(seqs) + 2, max_blocks), np.int32)  # two padded sequences
    rows_of, used = [], 0
    for s, (_, kv) in enumerate(seqs):
        rows = rng.standard_normal((kv, W)).astype(np.float32)
        rows_of.append(rows)
        for b in range(blocks[s]):
            page = order[used]
            used += 1
            tables[s, b] = page
            chunk = rows[b * PAGE : (b + 1) * PAGE]
            pages[page, : len(chunk)] = chunk
    q_lens = [q for q, _ in seqs]
    T = sum(q_lens) + 3  # padding tokens
    cu = np.zeros(len(seqs) + 3, np.int32)
    cu[1 : len(seqs) + 1] = np.cumsum(q_lens)
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    kv_lens = np.array([kv for _, kv in seqs] + [0, 0], np.int32)
    pages[0] = np.nan  # the null page
    stored = pages.astype(dtype)
    latent = LatentPages(c=jnp.asarray(stored))
    exact_rows = [stored_rows(r, dtype) for r in rows_of]
    return latent, kv_lens, tables, cu, T, exact_rows


def stored_rows(rows, dtype):
    return rows.astype(dtype).astype(np.float64)


def test_every_impl_matches_unabsorbed_oracle():
    rng = np.random.default_rng(0)
    seqs = [(1, 1), (5, 19), (1, 33), (17, 17), (3, 40)]
    latent, kv_lens, tables, cu, T, rows_of = _batch(rng, seqs, np.float32)
    w_uk = rng.standard_normal((H, L, DN)) / np.sqrt(L)  # latent -> per-head nope key
    w_uv = rng.standard_normal((H, L, DV)) / np.sqrt(L)  # latent -> per-head value
    q_nope = rng.standard_normal((T, H, DN))
    q_pe = rng.standard_normal((T, H, R))
    scale = 1.0 / np.sqrt(DN + R)
    absorbed = np.concatenate([np.einsum("thd,hld->thl", q_nope, w_uk), q_pe], axis=-1)

    # oracle: per-head K = [c @ W_UK_h, k_pe], V = c @ W_UV_h, causal softmax attention
    expected = np.zeros((T, H, DV))
    for s, (q_len, kv_len) in enumerate(seqs):
        c, k_pe = rows_of[s][:, :L], rows_of[s][:, L:]
        for i in range(q_len):
            t, pos = cu[s] + i, kv_len - q_len + i
            for h in range(H):
                k = np.concatenate([c[: pos + 1] @ w_uk[h], k_pe[: pos + 1]], axis=-1)
                logits = k @ np.concatenate([q_nope[t, h], q_pe[t, h]]) * scale
                p = np.exp(logits - logits.max())
                expected[t, h] = (p / p.sum()) @ (c[: pos + 1] @ w_uv[h])
    real = int(cu[len(seqs)])
    for impl in KERNELS:
        out = mla_ragged_paged_attention(
            jnp.asarray(absorbed, jnp.float32),
            latent,
            jnp.asarray(kv_lens),
            jnp.asarray(tables),
            jnp.asarray(cu),
            jnp.asarray([len(seqs)], jnp.int32),
            sm_scale=scale,
            v_dim=L,
            impl=impl,
        )
        got = np.einsum("thl,hld->thd", np.asarray(out, np.float64)[:real], w_uv)
        np.testing.assert_allclose(got, expected[:real], rtol=2e-5, atol=2e-5, err_msg=impl)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_low_precision_rows(dtype):
    """bf16 and FP8 rows (FP8 with per-page scales) against the oracle on the dequantized rows."""
    rng = np.random.default_rng(1)
    seqs = [(4, 21), (1, 9)]
    np_dtype = getattr(ml_dtypes, dtype)
    latent, kv_lens, tables, cu, T, rows_of = _batch(rng, seqs, np_dtype)
    if dtype.startswith("float8"):
        page_scale = np.linspace(0.5, 2.0, latent.num_pages).astype(np.float32)
        latent = LatentPages(c=latent.c, c_scale=jnp.asarray(page_scale))
        page_of = {}
        for s, (_, kv) in enumerate(seqs):
            for pos in range(kv):
                page_of[(s, pos)] = page_scale[tables[s, pos // PAGE]]
        rows_of = [r * np.array([page_of[(s, p)] for p in range(len(r))])[:, None] for s, r in enumerate(rows_of)]
    q = rng.standard_normal((T, H, L + R))
    scale = 0.2
    real = int(cu[len(seqs)])
    expected = np.zeros((real, H, L))
    for s, (q_len, kv_len) in enumerate(seqs):
        for i in range(q_len):
            t, pos = cu[s] + i, kv_len - q_len + i
            rows = rows_of[s][: pos + 1]
            logits = rows @ q[t].T * scale  # [pos+1, H]
            p = np.exp(logits - logits.max(0))
            expected[t] = ((p / p.sum(0)).T @ rows)[:, :L]
    for impl in ("reference", "chunked"):
        out = mla_ragged_paged_attention(
            jnp.asarray(q, jnp.float32),
            latent,
            jnp.asarray(kv_lens),
            jnp.asarray(tables),
            jnp.asarray(cu),
            jnp.asarray(len(seqs), jnp.int32),
            sm_scale=scale,
            v_dim=L,
            impl=impl,
        )
        np.testing.assert_allclose(np.asarray(out, np.float64)[:real], expected, rtol=1e-4, atol=1e-4, err_msg=impl)


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
