"""MLA under tensor parallelism with the latent pool split over the model axis (`mla_latent: split`).

Default (`replicated`): the query heads are split over the model axis and every chip holds every
latent row (one row serves all heads), so the KV pool is the same size on each chip as on one.
`split`, as vLLM's decode context parallelism does for MLA: the *tokens* are split, interleaved,
token at position t held by chip t % m (m = the model axis). A page of `ps` tokens keeps its page
id and holds ps / m rows on each chip: pool [P, ps, W] split on its row dim, chip i's slice
[P, ps / m, W] a pool of its own, page size ps / m, local row j of a sequence = token j * m + i,
under the same block tables. Each chip then attends with *all* H heads over its own tokens and
returns the partial output with its log-sum-exp; the exact result is their logsumexp combine:

    q:    [T, H/m, W] per chip -> all-gathered to [T, H, W]
    chip i: o_i, lse_i = softmax-attend(q, own rows, causal on global positions)   [T, H, L], [T, H]
    out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M),  M = max_i lse_i      (reduce-scatter
          over heads: each chip keeps its H/m heads, and W_UV / o_proj stay head-split)

Per chip: KV rows / m, the same attention flops (H heads x S/m tokens, not H/m x S), plus an
all-gather of q and a reduce-scatter of [T, H, L] per MLA layer, and an f32 [T, H, L] accumulator.
The attention here is a jnp online softmax over the block table (no Pallas MLA kernel returns its
log-sum-exp yet), on every platform. FP8 latent pages (one scale per page: split pages would need
one per chip) and P/D transfer of split pages are refused at start-up (`check_split`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels import mla
from pallas_kernels.rpa_common import true_num_seqs

MODES = ("replicated", "split", "auto")


def local_slots(slots, page_size: int, m: int, i):
    """Global slots (page * ps + offset, -1: padding) -> chip i's slots in its [P, ps / m] pool
    (-1 where another chip holds the token)."""
    ps_local = page_size // m
    page, offset = slots // page_size, slots % page_size
    return jnp.where((slots >= 0) & (offset % m == i), page * ps_local + offset // m, -1)


def partial_attention(q, latent: mla.LatentPages, kv_lens, block_tables, cu_q_lens, num_seqs, *, m, i, sm_scale, v_dim):
    """Chip i's causal MLA over its rows (local row j = token j * m + i): ([T, H, v_dim] f32
    normalized over its rows, [T, H] f32 log-sum-exp; -inf where it holds no visible row)."""
    T = q.shape[0]
    ps = latent.page_size
    n = true_num_seqs(num_seqs)
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), kv_lens.shape[0] - 1)
    start = cu_q_lens[seq]
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - start) + (t - start)  # the token's global position
    pos = jnp.where(t < cu_q_lens[n], pos, -1)  # padding tokens see nothing
    visible = jnp.where(pos >= i, (pos - i) // m + 1, 0)  # [T] own rows at positions <= pos
    q32 = q.astype(jnp.float32)

    def block(b, carry):
        mx, den, acc = carry
        rows = latent.load(latent.c[block_tables[seq, b]]).astype(jnp.float32)  # [T, ps, W]
        if latent.c_scale is not None:
            rows = rows * latent.c_scale[block_tables[seq, b]][:, None, None]
        s = jnp.einsum("thw,tkw->thk", q32, rows) * sm_scale
        seen = (b * ps + jnp.arange(ps))[None] < visible[:, None]  # [T, ps]
        s = jnp.where(seen[:, None], s, -jnp.inf)
        new = jnp.maximum(mx, s.max(-1))
        p = jnp.exp(s - new[..., None])
        scale = jnp.exp(mx - new)
        acc = acc * scale[..., None] + jnp.einsum("thk,tkl->thl", p, rows[..., :v_dim])
        return new, den * scale + p.sum(-1), acc

    H = q.shape[1]
    init = (jnp.full((T, H), -1e30, jnp.float32), jnp.zeros((T, H), jnp.float32), jnp.zeros((T, H, v_dim), jnp.float32))
    num_blocks = (jnp.max(visible) + ps - 1) // ps
    mx, den, acc = lax.fori_loop(0, num_blocks, block, init)
    lse = jnp.where(den > 0, mx + jnp.log(jnp.maximum(den, 1e-30)), -jnp.inf)
    return acc / jnp.maximum(den, 1e-30)[..., None], lse


def combine(out, lse, axis: str, scatter_heads: bool):
    """The exact attention from every chip's (out [T, H, L], lse [T, H]): logsumexp-weighted sum
    over `axis`; `scatter_heads`: each chip keeps its H/m heads (reduce-scatter), else all."""
    top = lax.pmax(lse, axis)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # 0 where the chip saw nothing
    if scatter_heads:
        num = lax.psum_scatter(out * w[..., None], axis, scatter_dimension=1, tiled=True)
        den = lax.psum_scatter(w, axis, scatter_dimension=1, tiled=True)
    else:
        num, den = lax.psum(out * w[..., None], axis), lax.psum(w, axis)
    return num / jnp.maximum(den, 1e-30)[..., None]


def split_mla(q, rows, slots, latent: mla.LatentPages, batch, block_tables, *, tp, sm_scale, v_dim, write):
    """Write this step's `rows` [T, W] at global `slots` into the split pool and attend `q` [T, H, W]:
    ([T, H, v_dim] in q's dtype, heads split when `tp.attention`, the updated pool).
    `write(latent, rows, slots)`: the pool write (models/mla_attention.py `write_latent`)."""
    axis, m = tp.axis, tp.size
    page_size = latent.page_size  # the global page size (the pool's row dim before the split)

    def run(q, rows, slots, latent, kv_lens, block_tables, cu_q_lens, num_seqs):
        i = lax.axis_index(axis)
        latent = write(latent, rows, local_slots(slots, page_size, m, i))
        out, lse = partial_attention(
            q, latent, kv_lens, block_tables, cu_q_lens, num_seqs, m=m, i=i, sm_scale=sm_scale, v_dim=v_dim
        )
        return combine(out, lse, axis, tp.attention).astype(q.dtype), latent

    pool = jax.tree.map(lambda _: P(None, axis), latent)
    heads = P(None, axis) if tp.attention else P()
    return jax.shard_map(
        run,
        mesh=tp.mesh,
        in_specs=(P(), P(), P(), pool, P(), P(), P(), P()),
        out_specs=(heads, pool),
        check_vma=False,
    )(q, rows, slots, latent, batch.kv_lens, block_tables, batch.cu_q_lens, batch.num_seqs)


# `mla_latent: auto` (benchmarks/results/plan/mla-latent/compare.json: on DeepSeek-V3 at v5p-64 the split
# holds 32x the tokens per chip for a larger step temp and a q all-gather + [T, H, L] reduce-scatter per
# MLA layer, which a replicated pool never pays): split only where the replicated pool is the bound,
# i.e. it cannot hold `max_num_seqs` sequences of `max_model_len` (and the split serves the launch);
# else replicated. A configured `cache.num_pages` keeps replicated.
AUTO_RULE = "split iff the replicated latent pool cannot hold max_num_seqs sequences of max_model_len"


def _problem(m: int, page_size: int, kv_dtype: str, kv_transfer: bool) -> str | None:
    if page_size % m:
        return f"page_size {page_size} must be a multiple of the model axis {m}"
    if "float8" in str(kv_dtype) or "fp8" in str(kv_dtype):
        return "FP8 latent pages (one scale per page) are not supported; use bf16 KV"
    if kv_transfer:
        return "P/D transfer of split latent pages is not supported"
    return None


def check_split(
    mode: str, m: int, page_size: int, has_mla: bool, kv_dtype: str, kv_transfer: bool, kv_bound: bool = False
) -> bool:
    """Whether the MLA latent pools are split: `split` (ValueError for a combination the split does
    not serve), `replicated`, or `auto` (`AUTO_RULE`: `kv_bound` says the replicated pool is the
    bound; a combination the split does not serve stays replicated)."""
    if mode not in MODES:
        raise ValueError(f"parallel.mla_latent must be one of {MODES}, got {mode!r}")
    if mode == "replicated" or not has_mla or m == 1:
        return False
    problem = _problem(m, page_size, kv_dtype, kv_transfer)
    if mode == "auto":
        return kv_bound and problem is None
    if problem is not None:
        raise ValueError(f"parallel.mla_latent split: {problem}")
    return True
