"""KV write: scatter this step's K/V into the pages at `slot_mapping`, quantizing to FP8.

Pure jnp: float pages take a token scatter; FP8 pages are gathered, requantized and written back
whole; on TPU (`whole_pages`) every page goes back by dynamic-update-slice, no scatter into the
pool. FP8 scale rule, per (page, kv head):
  * a write at offset 0 starts the page fresh: its scale comes from this step's tokens only;
  * otherwise the scale grows to cover the new tokens (never shrinks while the page lives), and
    the entries already in the page are requantized to the grown scale;
  * values are always clipped to the FP8 range before the cast.
Only pages written this step are touched (gathered, requantized, written back page by page), never
the whole pool: on TPU the pool stays in its own layout (docs/scaling.md, "The caches in place").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kv_cache import KVPages, fp8_max, quantize

# Smallest scale we store: keeps x / scale finite for an all-zero page.
_MIN_SCALE = 1e-30


def _set_tokens(kv: KVPages, pages, at, offset, tokens):
    """`pages[at[t], :, offset[t]] = tokens[t]` in the storage layout (token-minor: the token is the
    last axis); tokens [T, Hkv, D]; `at` out of range: dropped."""
    if kv.token_minor:
        return pages.at[at, :, :, offset].set(tokens, mode="drop")
    return pages.at[at, :, offset].set(tokens, mode="drop")


def _write_pages(kv: KVPages, pages, page, offset, valid, tokens, refresh, max_pages: int | None):
    """Writes this step's `tokens` [T, Hkv, D] (already in the pages' stored form) into `pages`
    a whole page at a time: each distinct page written is gathered once, `refresh(page_copies,
    page_ids)` applied (FP8: requantized to the grown scale), the tokens set into it, and the page
    put back by dynamic-update-slice. At most `max_pages` pages are gathered at once (a bound on
    the distinct pages of one step; more are done in further rounds, never dropped).
    `max_pages=None` (CPU, GPU): every token's page gathered and one scatter of whole pages
    puts the pages back (no loop: a GPU runs a loop's iterations one launch at a time).

    No scatter touches the pool. On TPU a scatter picks its own layout for the pool (token rows:
    offset-major; FP8: (8, 128) tiles against the pool's (32, 128)), and XLA copied the whole pool
    into that layout and back, inside the layer scan every layer (docs/scaling.md)."""
    T, num_pages = page.shape[0], pages.shape[0]
    first = jnp.full((num_pages + 1,), T, jnp.int32).at[page].min(jnp.arange(T, dtype=jnp.int32))[page]
    owns = valid & (first == jnp.arange(T))  # one token per distinct page written
    if max_pages is None:
        copies = refresh(pages[jnp.minimum(page, num_pages - 1)], page)  # [T, Hkv, ps, D] (or D, ps)
        copies = _set_tokens(kv, copies, jnp.where(valid, first, T), offset, tokens)
        return pages.at[jnp.where(owns, page, num_pages)].set(copies, mode="drop")
    n = max(1, min(max_pages, T))
    rounds = -(-T // n)
    rank = jnp.cumsum(owns) - 1  # an owner's index among the distinct pages
    target = jnp.where(valid, rank[jnp.minimum(first, T - 1)], rounds * n)  # [T]: token -> its page's index
    owners = jnp.nonzero(owns, size=rounds * n, fill_value=0)[0]
    count = jnp.sum(owns)

    def one_round(r, pages):
        ids = page[lax.dynamic_slice_in_dim(owners, r * n, n)]  # [n] page ids (past count: unused)
        copies = refresh(pages[jnp.minimum(ids, num_pages - 1)], ids)  # [n, Hkv, ps, D] (or D, ps)
        at = target - r * n
        at = jnp.where((at >= 0) & (at < n), at, n)  # other rounds' tokens (and padding) dropped
        copies = _set_tokens(kv, copies, at, offset, tokens)

        def put(j, pages):
            return lax.dynamic_update_slice_in_dim(pages, copies[j][None], ids[j], axis=0)

        return lax.fori_loop(0, jnp.minimum(n, count - r * n), put, pages)

    return lax.fori_loop(0, (count + n - 1) // n, one_round, pages)


def _write_plain(kv: KVPages, pages, new, page, offset, valid, max_pages: int | None):
    # pages: [P, Hkv, ps, D] (token-minor: [P, Hkv, D, ps]); new: [T, Hkv, D]; page/offset: [T]
    # (page == P for padding -> dropped)
    if max_pages is None:
        return _set_tokens(kv, pages, page, offset, kv.store(new))
    return _write_pages(kv, pages, page, offset, valid, kv.store(new), lambda copies, ids: copies, max_pages)


def _write_fp8(
    kv: KVPages,
    pages: jax.Array,
    scale: jax.Array,
    new: jax.Array,
    page: jax.Array,
    offset: jax.Array,
    valid: jax.Array,
    max_pages: int | None,
):
    num_pages = pages.shape[0]
    limit = fp8_max(kv.dtype)
    # Per (page, head) amax of this step's tokens, and which pages restart at offset 0.
    token_amax = jnp.max(jnp.abs(new.astype(jnp.float32)), axis=-1)  # [T, Hkv]
    token_amax = jnp.where(valid[:, None], token_amax, 0.0)
    step_amax = jnp.zeros(scale.shape, jnp.float32).at[page].max(token_amax, mode="drop")
    starts_fresh = (
        jnp.zeros((num_pages,), jnp.int32).at[page].max((valid & (offset == 0)).astype(jnp.int32), mode="drop") > 0
    )  # [P]
    written = jnp.zeros((num_pages,), jnp.int32).at[page].max(valid.astype(jnp.int32), mode="drop") > 0  # [P]

    needed = jnp.maximum(step_amax / limit, _MIN_SCALE)  # [P, Hkv]
    grown = jnp.where(starts_fresh[:, None], needed, jnp.maximum(scale, needed))
    new_scale = jnp.where(written[:, None], grown, scale)

    def requantize(copies, ids):  # the entries already in a written page, to its grown scale
        ids = jnp.minimum(ids, num_pages - 1)
        ratio = (scale[ids] / new_scale[ids])[:, :, None, None]  # [n, Hkv, 1, 1]
        return kv.store(jnp.clip(kv.load(copies).astype(jnp.float32) * ratio, -limit, limit))

    token_scale = new_scale[jnp.minimum(page, num_pages - 1)][:, :, None]  # [T, Hkv, 1]
    tokens = kv.store(quantize(new, token_scale, kv.dtype))
    return _write_pages(kv, pages, page, offset, valid, tokens, requantize, max_pages), new_scale


@functools.partial(jax.jit, static_argnames=("whole_pages", "max_seqs"))
def write_kv(
    kv: KVPages,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    whole_pages: bool = False,
    max_seqs: int | None = None,
) -> KVPages:
    """Writes token t's K/V to slot `slot_mapping[t] = page * ps + offset` (-1: padding, skipped).

    kv: KVPages with pages [P, Hkv, ps, D] (or token-minor [P, Hkv, D, ps]); k, v: [T, Hkv, D];
    slot_mapping: [T] int32.
    `whole_pages` (the TPU path): no scatter into the pool; each page written is put back whole
    by dynamic-update-slice. Otherwise float pages take a token scatter and FP8 pages one scatter
    of whole pages. Same result either way.
    `max_seqs` (with `whole_pages`): the most sequences the step's tokens belong to (each a run of
    consecutive slots), which bounds the pages gathered at once to T // ps + 2 * max_seqs (None: T).
    Returns the updated KVPages (donate `kv` at the call site to update in place).
    """
    if k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {k.shape} and {v.shape}")
    if k.shape[1:] != (kv.num_kv_heads, kv.head_dim):
        raise ValueError(f"k is {k.shape}, pages hold Hkv={kv.num_kv_heads}, D={kv.head_dim}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    slot_mapping = slot_mapping.astype(jnp.int32)
    valid = slot_mapping >= 0
    page = jnp.where(valid, slot_mapping // kv.page_size, kv.num_pages)  # out of range -> dropped
    offset = jnp.where(valid, slot_mapping % kv.page_size, 0)
    T = k.shape[0]
    max_pages = T if max_seqs is None else min(T, T // kv.page_size + 2 * max_seqs)
    max_pages = max_pages if whole_pages else None
    if not kv.quantized:
        return dataclasses.replace(
            kv,
            k=_write_plain(kv, kv.k, k, page, offset, valid, max_pages),
            v=_write_plain(kv, kv.v, v, page, offset, valid, max_pages),
        )
    k_pages, k_scale = _write_fp8(kv, kv.k, kv.k_scale, k, page, offset, valid, max_pages)
    v_pages, v_scale = _write_fp8(kv, kv.v, kv.v_scale, v, page, offset, valid, max_pages)
    return dataclasses.replace(kv, k=k_pages, v=v_pages, k_scale=k_scale, v_scale=v_scale)
