"""KV write: scatter this step's K/V into the pages at `slot_mapping`, quantizing to FP8.

Pure jnp: float pages take a token scatter; FP8 pages are gathered, requantized and written back
whole. FP8 scale rule, per (page, kv head):
  * a write at offset 0 starts the page fresh: its scale comes from this step's tokens only;
  * otherwise the scale grows to cover the new tokens (never shrinks while the page lives), and
    the entries already in the page are requantized to the grown scale;
  * values are always clipped to the FP8 range before the cast.
Only pages written this step are touched (gathered, requantized, written back page by page), never
the whole pool: on TPU the pool stays in its own layout (docs/scaling.md, "The caches in place").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kv_cache import KVPages, fp8_max, quantize

# Smallest scale we store: keeps x / scale finite for an all-zero page.
_MIN_SCALE = 1e-30


def _write_pages(pages: jax.Array, merged: jax.Array, page: jax.Array, first: jax.Array, valid: jax.Array):
    """Writes back `merged[t]` (a whole page) to `page[t]` for each token t that is the first of
    its page (`first[t] == t`), by dynamic-update-slice: one per distinct page written.

    No scatter touches the pool. On TPU a scatter picks its own layout for the pool (token rows:
    offset-major; FP8: (8, 128) tiles against the pool's (32, 128)), and XLA copied the whole pool
    into it and back, every layer inside the layer scan (docs/scaling.md)."""
    T = page.shape[0]
    owns = valid & (first == jnp.arange(T))
    owners = jnp.nonzero(owns, size=T, fill_value=0)[0]  # the owning tokens first

    def put(j, pages):
        t = owners[j]
        return lax.dynamic_update_slice_in_dim(pages, merged[t][None], page[t], axis=0)

    return lax.fori_loop(0, jnp.sum(owns), put, pages)


def _first_of_page(page: jax.Array, num_pages: int) -> jax.Array:
    """[T]: the first token index writing the same page as token t."""
    T = page.shape[0]
    first = jnp.full((num_pages + 1,), T, jnp.int32).at[page].min(jnp.arange(T, dtype=jnp.int32))
    return first[page]


def _write_plain(kv: KVPages, pages, new, page, offset, valid, whole_pages: bool):
    # pages: [P, Hkv, ps, D]; new: [T, Hkv, D]; page/offset: [T] (page == P for padding -> dropped)
    if not whole_pages:
        return pages.at[page, :, offset].set(kv.store(new), mode="drop")
    num_pages = pages.shape[0]
    first = _first_of_page(page, num_pages)
    merged = pages[jnp.minimum(page, num_pages - 1)]  # [T, Hkv, ps, D]
    merged = merged.at[first, :, offset].set(kv.store(new), mode="drop")
    return _write_pages(pages, merged, page, first, valid)


def _write_fp8(
    kv: KVPages,
    pages: jax.Array,
    scale: jax.Array,
    new: jax.Array,
    page: jax.Array,
    offset: jax.Array,
    valid: jax.Array,
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

    # Every written page is gathered once per token that hits it and requantized to the grown
    # scale; this step's tokens go into the first of those copies, which alone goes back.
    safe_page = jnp.minimum(page, num_pages - 1)
    first = _first_of_page(page, num_pages)
    old_pages = kv.load(pages[safe_page]).astype(jnp.float32)  # [T, Hkv, ps, D]
    ratio = scale[safe_page] / new_scale[safe_page]  # [T, Hkv]
    merged = kv.store(jnp.clip(old_pages * ratio[:, :, None, None], -limit, limit))
    token_scale = new_scale[safe_page][:, :, None]  # [T, Hkv, 1]
    merged = merged.at[first, :, offset].set(kv.store(quantize(new, token_scale, kv.dtype)), mode="drop")
    return _write_pages(pages, merged, page, first, valid), new_scale


@functools.partial(jax.jit, static_argnames="whole_pages")
def write_kv(kv: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *, whole_pages: bool = False) -> KVPages:
    """Writes token t's K/V to slot `slot_mapping[t] = page * ps + offset` (-1: padding, skipped).

    kv: KVPages with pages [P, Hkv, ps, D]; k, v: [T, Hkv, D]; slot_mapping: [T] int32.
    `whole_pages`: float pages too are written back a whole page at a time, without a scatter
    into the pool (the TPU path; FP8 pages always are). Same result either way.
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
    if not kv.quantized:
        return KVPages(
            k=_write_plain(kv, kv.k, k, page, offset, valid, whole_pages),
            v=_write_plain(kv, kv.v, v, page, offset, valid, whole_pages),
            view=kv.view,
        )
    k_pages, k_scale = _write_fp8(kv, kv.k, kv.k_scale, k, page, offset, valid)
    v_pages, v_scale = _write_fp8(kv, kv.v, kv.v_scale, v, page, offset, valid)
    return KVPages(k=k_pages, v=v_pages, k_scale=k_scale, v_scale=v_scale, view=kv.view)
