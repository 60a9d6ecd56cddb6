"""P/D of MLA latent pages (DeepSeek-V3, Kimi Linear's MLA layers): gathered, checked, written.

An MLA layer's pool (pallas_kernels/mla.py `LatentPages`) holds one row per token, no heads: the
`kv_lora_rank` = L latent channels then the `qk_rope_head_dim` = R RoPE-key channels (W = L + R),
and FP8 pages one float32 scale per page. On the wire, per MLA position j of the layer pattern:

    kv{j}.c        [G*n, ps, W]  the request's pages of every layer group, g-major (raw bits
                                 below float32, as GQA pages: layout._to_wire)
    kv{j}.c_scale  [G*n]         FP8 pages only

and the model signature carries `"mla": {"kv_lora_rank": L, "qk_rope_head_dim": R, "rope": bool}`
(descriptor.model_signature), so a checkpoint whose latent splits differently is refused even at
the same width. The decode side checks the array list entry by entry (`check_latent_arrays`: the
first differing name, dimension or dtype in the message) before it allocates or pulls a byte, and
`check_pulled_scales` refuses pulled FP8 scales that are not finite and positive (one would turn a
page into NaNs or zeros) before the request is admitted. `write_latent_pages` copies pages and
scales verbatim when the KV dtype and page size match, and otherwise maps the rows token by token
through the model's own latent write (models/mla_attention.write_latent: dequantized, and
requantized with this side's per-page scales for FP8). Latent rows are replicated under tensor
parallelism (models/sharding.py), so no head repeat or channel order applies.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla import LatentPages
from runtime.kv_transfer.base import TransferError


def is_latent(kv) -> bool:
    return isinstance(kv, LatentPages)


def pool_pages(kv) -> int:
    """Pages in a KV pool (all layer groups): GQA `KVPages` or MLA `LatentPages`."""
    return kv.c.shape[0] if is_latent(kv) else kv.k.shape[0]


def is_quantized(kv) -> bool:
    """Whether the pool's pages carry FP8 scales."""
    return (kv.c_scale if is_latent(kv) else kv.k_scale) is not None


def latent_names(j: int, kv) -> list[str]:
    return [f"kv{j}.c"] + ([f"kv{j}.c_scale"] if kv.c_scale is not None else [])


def gather_latent(latent: LatentPages, idx, to_wire) -> list:
    """Inside a jit: the pages `idx` [G*n] of one MLA pool as wire arrays."""
    out = [to_wire(latent.load(latent.c[idx]), latent.dtype)]
    if latent.c_scale is not None:
        out.append(latent.c_scale[idx])
    return out


def expected_latent(j: int, cfg, num_groups: int, num_pages: int, page_size: int, kv_dtype, wire: str) -> list:
    """The [name, shape, dtype] entries of MLA position j for a descriptor of this model."""
    want = [[f"kv{j}.c", [num_groups * num_pages, page_size, cfg.mla.latent_width], wire]]
    if jnp.dtype(kv_dtype).itemsize == 1:
        want.append([f"kv{j}.c_scale", [num_groups * num_pages], "float32"])
    return want


def check_latent_arrays(got, want: list) -> None:
    """TransferError naming the first entry of `got` (the descriptor's arrays) that differs from
    `want` (this model's), field by field: the count, then each name, rank, dimension and dtype."""
    if len(got) != len(want):
        raise TransferError(
            f"descriptor carries {len(got)} arrays; this MLA model expects {len(want)} "
            f"({', '.join(name for name, _, _ in want)})"
        )
    fields = ("rows (layer groups x pages)", "page size", "latent width (kv_lora_rank + qk_rope_head_dim)")
    for (name, shape, dtype), (want_name, want_shape, want_dtype) in zip(got, want):
        if name != want_name:
            raise TransferError(f"descriptor array {name!r} where this model expects {want_name!r}")
        if len(shape) != len(want_shape):
            raise TransferError(f"descriptor array {name}: shape {shape}, this model expects {want_shape}")
        for axis, (have, need) in enumerate(zip(shape, want_shape)):
            if have != need:
                what = fields[axis] if name.endswith(".c") else f"dimension {axis}"
                raise TransferError(f"descriptor array {name}: {what} {have}, this model expects {need}")
        if dtype != want_dtype:
            raise TransferError(f"descriptor array {name}: wire dtype {dtype!r}, this model expects {want_dtype!r}")


def check_pulled_scales(arrays: list, desc: dict, cfg) -> None:
    """TransferError unless every pulled FP8 scale (GQA `k_scale` / `v_scale`, MLA `c_scale`) of
    the pages a request uses is finite and positive (padding pages are never read). A window
    layer's arrays (window_layout.py) carry blocks first_block .. of the descriptor's `window`.
    Host-side, once per pulled request, after `expected_arrays` accepted the list."""
    num_blocks = -(-desc["num_tokens"] // desc["page_size"])
    window, G = desc.get("window"), desc["model"]["num_groups"]
    for (name, _, _), array in zip(desc["arrays"], arrays):
        if not name.endswith("_scale"):
            continue
        mtp = name.startswith("mtp.")  # the MTP layer's pages: one group (spec_layout.py)
        used, groups = num_blocks, 1 if mtp else G
        if not mtp and window is not None and cfg.sliding_window(int(name[2 : name.index(".")])) is not None:
            used = num_blocks - window["first_block"]  # kv{j}.<k|v|c>_scale of a window layer
        scales = np.asarray(array).reshape(groups, array.shape[0] // groups, -1)[:, :used]
        if not np.all(np.isfinite(scales) & (scales > 0)):
            raise TransferError(f"pulled {name} holds scales that are not finite and positive")


def write_latent_pages(
    latent: LatentPages, c, scale, *, logical, page_mapping, slot_mapping, num_groups, num_tokens, verbatim, opts
):
    """Inside a jit: one MLA pool with the pulled pages `c` [G*n, ps_src, W] (wire form of the
    prefill side's `logical` dtype) and FP8 `scale` [G*n] (or None) written. Verbatim: pages and
    scales land at `page_mapping` [G*n] (out of range: dropped). Otherwise the first `num_tokens`
    rows of each group go through the latent write to `slot_mapping` [G*num_tokens] (-1: dropped)."""
    from models.mla_attention import write_latent  # the model's own write (FP8 scale rules)

    if verbatim:
        stored = c if c.dtype == latent.c.dtype else jax.lax.bitcast_convert_type(c, latent.c.dtype)
        pages = latent.c.at[page_mapping].set(stored, mode="drop")
        scales = None if latent.c_scale is None else latent.c_scale.at[page_mapping].set(scale, mode="drop")
        return dataclasses.replace(latent, c=pages, c_scale=scales)
    rows = (c if c.dtype == logical else jax.lax.bitcast_convert_type(c, logical)).astype(jnp.float32)
    if scale is not None:
        rows = rows * scale[:, None, None]
    Gn, ps, W = rows.shape
    rows = rows.reshape(num_groups, Gn // num_groups * ps, W)[:, :num_tokens].reshape(-1, W)
    return write_latent(latent, rows, slot_mapping, opts, None)
