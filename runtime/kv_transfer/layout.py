"""Gather one request's KV pages + GDN state out of the caches; write them into another layout.

Prefill side: `gather_request_state` -> a flat list of single-device arrays (the descriptor's
`arrays`, in order). Decode side: `expected_arrays` re-derives that list from the descriptor and
this model (any difference is a TransferError), and `write_request_state` copies the pages (and
FP8 scales) verbatim into this engine's block table when both sides hold the same KV dtype and
page size, and otherwise maps them token by token through the model's own KV write op: so the
decode side's page size, KV dtype (FP8: quantized with this side's per-page scales) and
tensor-parallel sharding all apply, whatever the prefill side used. The wire holds the
checkpoint's KV heads: a side that repeats them (fewer KV heads than chips, models/sharding.py)
sends one copy of each and repeats what it receives. Page and token counts are padded to powers of two (one compile per size).
MLA pools (DeepSeek-V3, Kimi Linear) travel as latent rows: runtime/kv_transfer/latent_layout.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import mamba2_tp, ops
from models.config import ATTENTION
from models.mamba2_config import NO_MIXER
from models.sharding import qkv_permutation
from runtime.kv_transfer.base import TransferError
from runtime.kv_transfer.descriptor import LAST_TOKEN_RULE, build_descriptor, model_signature
from runtime.kv_transfer.latent_layout import (
    check_latent_arrays,
    expected_latent,
    gather_latent,
    is_latent,
    latent_names,
    pool_pages,
    write_latent_pages,
)
from runtime.kv_transfer.window_layout import (
    check_window,
    first_window_block,
    window_descriptor,
    window_layers,
    window_mappings,
    window_pages_of,
)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _bits(dtype) -> jnp.dtype:
    return jnp.dtype({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize])


def _to_wire(x, dtype):
    """Values of logical `dtype` as sent: raw bits for anything narrower than float32 (the
    transfer server moves plain integer buffers for bf16 / FP8 alike)."""
    return x if jnp.dtype(dtype) == jnp.float32 else jax.lax.bitcast_convert_type(x, _bits(dtype))


@functools.partial(jax.jit, static_argnames=("num_pages", "num_slots", "kv_repeat", "windowed", "num_window_pages"))
def _gather(
    caches, pages, window_pages, slot, *, num_pages: int, num_slots: int, kv_repeat: int, windowed, num_window_pages
):
    out = []
    for j, (kv, conv, rec) in enumerate(zip(caches["kv"], caches["conv"], caches["rec"])):
        if is_latent(kv):  # MLA: one latent row per token (latent_layout.py)
            G = kv.c.shape[0] // num_pages
            out += gather_latent(kv, (jnp.arange(G)[:, None] * num_pages + pages[None]).reshape(-1), _to_wire)
        elif kv is not None:
            P, own = (num_window_pages, window_pages) if windowed[j] else (num_pages, pages)  # window pool
            G = kv.k.shape[0] // P
            idx = (jnp.arange(G)[:, None] * P + own[None]).reshape(-1)  # [G*n]
            heads = slice(None, None, kv_repeat)  # one copy of each repeated KV head
            # the wire carries [G*n, Hkv, ps, D] whatever the pool's layout (token-minor on TPU, D < 128)
            k, v = kv.logical(kv.load(kv.k[idx]))[:, heads], kv.logical(kv.load(kv.v[idx]))[:, heads]
            out += [_to_wire(k, kv.dtype), _to_wire(v, kv.dtype)]
            if kv.k_scale is not None:
                out += [kv.k_scale[idx][:, heads], kv.v_scale[idx][:, heads]]
        elif rec is not None:
            G = rec.shape[0] // num_slots
            idx = jnp.arange(G) * num_slots + slot
            out += [_to_wire(conv[idx], conv.dtype), _to_wire(rec[idx], rec.dtype)]
    return out


def _names(caches) -> list[str]:
    names = []
    for j, (kv, rec) in enumerate(zip(caches["kv"], caches["rec"])):
        if is_latent(kv):
            names += latent_names(j, kv)
        elif kv is not None:
            names += [f"kv{j}.k", f"kv{j}.v"] + ([f"kv{j}.k_scale", f"kv{j}.v_scale"] if kv.k_scale is not None else [])
        elif rec is not None:
            names += [f"conv{j}", f"rec{j}"]
    return names


def conv_permutation(model) -> np.ndarray | None:
    """The conv-state channel order of a GDN- or Mamba-2-split TP engine (models/sharding.py), or None."""
    tp = model.tp
    if tp is not None and tp.mamba:
        held = mamba2_tp.held(model.cfg.mamba, tp)
        if held.n_groups != model.cfg.mamba.n_groups:  # the wire carries the checkpoint's conv width
            raise ValueError(
                f"P/D transfer of Mamba-2 states with B/C groups replicated over model axis {tp.size} "
                f"({model.cfg.mamba.n_groups} groups held {held.n_groups // model.cfg.mamba.n_groups} times) "
                "is not supported: use a model axis that divides n_groups"
            )
        return mamba2_tp.conv_permutation(held, tp.size)
    if tp is None or not tp.gdn:
        return None
    return qkv_permutation(tp.gdn_qkv_widths, tp.size)


def _reorder_conv(arrays: list, names: list[str], order: np.ndarray | None) -> list:
    if order is None:
        return arrays
    return [a[..., order] if name.startswith("conv") else a for a, name in zip(arrays, names)]


def gather_request_state(
    caches,
    cfg,
    *,
    prompt_token_ids,
    num_tokens: int,
    block_table,
    state_slot: int,
    page_size: int,
    num_pages: int,
    num_slots: int,
    conv_perm: np.ndarray | None = None,
    rule: str = LAST_TOKEN_RULE,
    signature: dict | None = None,
    window_block_table=None,
    num_window_pages: int = 0,
) -> tuple[list, dict]:
    """-> (arrays on one device, descriptor) for the first `num_tokens` tokens of a request.
    The wire format is canonical: unsharded, the checkpoint's KV heads (a repeat undone), conv
    channels in checkpoint order (`conv_perm` undone). With window paging (`window_block_table`,
    the window pool's `num_window_pages`) the window layers ship their live blocks only
    (runtime/kv_transfer/window_layout.py)."""
    num_blocks = -(-num_tokens // page_size)
    n = _pow2(num_blocks)
    pages = np.zeros(n, np.int32)
    used = list(block_table)[:num_blocks]
    pages[: len(used)] = used
    windowed = window_layers(cfg, len(caches["kv"]), window_block_table is not None)
    window = None
    window_pages = np.zeros(1, np.int32)
    if window_block_table is not None:
        window = window_descriptor(first_window_block(cfg, num_tokens, page_size), num_blocks)
        window_pages = np.zeros(window["num_pages"], np.int32)
        live = list(window_block_table)[window["first_block"] : num_blocks]
        window_pages[: len(live)] = live
    arrays = _gather(
        caches,
        jnp.asarray(pages),
        jnp.asarray(window_pages),
        jnp.int32(state_slot),
        num_pages=num_pages,
        num_slots=num_slots,
        kv_repeat=kv_repeat_of(caches, cfg),
        windowed=windowed,
        num_window_pages=num_window_pages,
    )
    device = jax.devices()[0]  # TP bridging: the wire format is unsharded
    arrays = [jax.device_put(a, device) for a in arrays]
    arrays = _reorder_conv(arrays, _names(caches), None if conv_perm is None else np.argsort(conv_perm))
    kv = next((x for x in caches["kv"] if x is not None), None)
    kv_dtype = jnp.dtype(kv.dtype).name if kv is not None else "float32"
    rec = next((x for x in caches["rec"] if x is not None), None)
    G = model_groups(caches, num_pages, num_slots, windowed)
    entries = [[name, list(a.shape), a.dtype.name] for name, a in zip(_names(caches), arrays)]
    desc = build_descriptor(
        prompt_token_ids=prompt_token_ids,
        num_tokens=num_tokens,
        rule=rule,
        page_size=page_size,
        num_pages=n,
        kv_dtype=kv_dtype,
        kv_wire="values" if kv_dtype == "float32" else "bits",
        signature=signature or model_signature(cfg, G),
        arrays=entries,
        state_dtype="float32" if rec is None else rec.dtype.name,
    )
    if window is not None:
        desc["window"] = window
    return arrays, desc


def kv_repeat_of(caches, cfg) -> int:
    """How many times the caches hold each of the checkpoint's KV heads (models.sharding.repeat_kv_heads)."""
    kv = next((x for x in caches["kv"] if x is not None), None)
    return 1 if kv is None or is_latent(kv) else kv.num_kv_heads // cfg.num_kv_heads


def model_groups(caches, num_pages: int, num_slots: int, windowed=()) -> int:
    """The layer groups G (`windowed`: the positions whose pages live in the window pool: skipped)."""
    for j, (kv, rec) in enumerate(zip(caches["kv"], caches["rec"])):
        if (kv is not None and not (j < len(windowed) and windowed[j])) or rec is not None:
            return pool_pages(kv) // num_pages if kv is not None else rec.shape[0] // num_slots
    return 1


def expected_arrays(desc: dict, cfg, window_paging: bool = False, extra: list = ()) -> list[list]:
    """The [name, shape, dtype] list a descriptor must carry for this model (TransferError if not);
    `window_paging`: whether this side pages its window layers apart (window_layout.check_window);
    `extra`: the entries that follow the model's."""
    check_window(desc, cfg, window_paging)
    sig, ps = desc["model"], desc["page_size"]
    G = sig["num_groups"]
    kv_dtype = jnp.dtype(desc["kv_dtype"])  # one of descriptor.KV_DTYPES (check_descriptor)
    wire = kv_dtype.name if kv_dtype == jnp.float32 else _bits(kv_dtype).name
    state_dtype = jnp.dtype(desc.get("state_dtype", "float32"))  # one of descriptor.STATE_DTYPES
    state_wire = state_dtype.name if state_dtype == jnp.float32 else _bits(state_dtype).name
    want = []
    for j, kind in enumerate(sig["layer_types"]):
        if kind == ATTENTION and cfg.mla is not None:  # MLA latent rows (latent_layout.py)
            want += expected_latent(j, cfg, G, desc["num_pages"], ps, kv_dtype, wire)
        elif kind == ATTENTION:
            n = window_pages_of(desc) if cfg.sliding_window(j) is not None else desc["num_pages"]
            page = [G * n, cfg.num_kv_heads, ps, cfg.head_dim]
            want += [[f"kv{j}.k", page, wire], [f"kv{j}.v", page, wire]]
            if kv_dtype.itemsize == 1:
                want += [[f"kv{j}.k_scale", page[:2], "float32"], [f"kv{j}.v_scale", page[:2], "float32"]]
        elif kind != NO_MIXER:
            want += [[f"conv{j}", [G] + sig["conv"], state_wire], [f"rec{j}", [G] + sig["rec"], state_wire]]
    want += list(extra)  # the MTP layer's rows and carry, when sent (spec_layout.expected_mtp)
    if cfg.mla is not None:
        check_latent_arrays(desc["arrays"], want)
    if desc["arrays"] != want:
        raise TransferError(f"descriptor arrays {desc['arrays']} differ from what this model expects {want}")
    return want


def pull_specs(desc: dict) -> list:
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    return [
        jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding) for _, shape, dtype in desc["arrays"]
    ]


def _copy_pages(kv, k, v, scales, page_mapping):
    """Verbatim: the prefill side's pages (and FP8 scales) land as they are in this side's pages
    `page_mapping` [G*n] (out of range: padding, dropped). Same KV dtype and page size only."""

    def stored(x):  # wire form (raw bits below float32) -> this pool's storage form
        x = kv.stored(x)  # [n, Hkv, ps, D] -> the pool's layout
        return x if x.dtype == kv.k.dtype else jax.lax.bitcast_convert_type(x, kv.k.dtype)

    k_pages = kv.k.at[page_mapping].set(stored(k), mode="drop")
    v_pages = kv.v.at[page_mapping].set(stored(v), mode="drop")
    if kv.k_scale is None:
        return dataclasses.replace(kv, k=k_pages, v=v_pages)
    return dataclasses.replace(
        kv,
        k=k_pages,
        v=v_pages,
        k_scale=kv.k_scale.at[page_mapping].set(scales[0], mode="drop"),
        v_scale=kv.v_scale.at[page_mapping].set(scales[1], mode="drop"),
    )


@functools.partial(
    jax.jit,
    donate_argnums=(0,),
    static_argnames=(
        "src_page_size",
        "kv_dtype",
        "state_dtype",
        "num_tokens_pad",
        "num_slots",
        "opts",
        "verbatim",
        "windowed",
    ),
)
def _write(
    caches,
    arrays,
    slot_mapping,
    page_mapping,
    window_slot_mapping,
    window_page_mapping,
    slot,
    *,
    src_page_size: int,
    kv_dtype: str,
    state_dtype: str,
    num_tokens_pad: int,
    num_slots: int,
    opts,
    verbatim: bool,
    windowed: tuple[bool, ...],
):
    arrays = list(arrays)
    G = slot_mapping.shape[0] // num_tokens_pad  # the layer groups
    kv_out, conv_out, rec_out = list(caches["kv"]), list(caches["conv"]), list(caches["rec"])
    logical = jnp.dtype(kv_dtype)
    for j, kv in enumerate(caches["kv"]):
        if kv is None and caches["rec"][j] is None:  # an MLP-only block
            continue
        if is_latent(kv):  # MLA latent rows (latent_layout.py)
            c = arrays.pop(0)
            scale = arrays.pop(0) if logical.itemsize == 1 else None
            kv_out[j] = write_latent_pages(
                kv,
                c,
                scale,
                logical=logical,
                page_mapping=page_mapping,
                slot_mapping=slot_mapping,
                num_groups=G,
                num_tokens=num_tokens_pad,
                verbatim=verbatim,
                opts=opts,
            )
            continue
        if kv is None:
            conv, rec = arrays.pop(0), arrays.pop(0)
            G = conv.shape[0]
            idx = jnp.arange(G) * num_slots + slot
            # the prefill side's state dtype (bf16 as bits) cast to this side's
            sent = jnp.dtype(state_dtype)
            state = [x if x.dtype == sent else jax.lax.bitcast_convert_type(x, sent) for x in (conv, rec)]
            conv_out[j] = caches["conv"][j].at[idx].set(state[0].astype(caches["conv"][j].dtype))
            rec_out[j] = caches["rec"][j].at[idx].set(state[1].astype(caches["rec"][j].dtype))
            continue
        k, v = arrays.pop(0), arrays.pop(0)
        scales = (arrays.pop(0), arrays.pop(0)) if logical.itemsize == 1 else (None, None)
        r = kv.num_kv_heads // k.shape[1]  # this side repeats each KV head r times: so does the copy
        if r > 1:
            k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
            scales = tuple(None if x is None else jnp.repeat(x, r, axis=1) for x in scales)
        pages, slots, num_tokens = page_mapping, slot_mapping, num_tokens_pad
        if windowed[j]:  # this side's window pool: every token of the sent pages (window_layout.py)
            pages, slots, num_tokens = window_page_mapping, window_slot_mapping, k.shape[0] // G * src_page_size
        if verbatim:
            kv_out[j] = _copy_pages(kv, k, v, scales, pages)
            continue
        tokens = []
        for x, scale in zip((k, v), scales):
            if x.dtype != logical:
                x = jax.lax.bitcast_convert_type(x, logical)
            x = x.astype(jnp.float32)
            if scale is not None:
                x = x * scale[:, :, None, None]
            Gn, H, ps, D = x.shape
            x = x.reshape(G, Gn // G, H, ps, D).transpose(0, 1, 3, 2, 4).reshape(G, -1, H, D)  # [G, n*ps, H, D]
            tokens.append(x[:, :num_tokens].reshape(G * num_tokens, H, D))
        kv_out[j] = ops.write_kv(kv, tokens[0], tokens[1], slots, opts)
    return {"kv": tuple(kv_out), "conv": tuple(conv_out), "rec": tuple(rec_out)}


def write_request_state(
    caches,
    arrays: list,
    desc: dict,
    *,
    block_table,
    state_slot: int,
    page_size: int,
    num_pages: int,
    num_slots: int,
    opts,
    conv_perm: np.ndarray | None = None,
    window_block_table=None,
    num_window_pages: int = 0,
    windowed: tuple[bool, ...] = (),
) -> dict:
    """Write a pulled request's K tokens into `block_table` / `state_slot`; -> the new caches.

    Same KV dtype and page size on both sides: pages and FP8 scales are copied verbatim (an FP8
    prefill side's pages are then bit for bit what this side would have computed). Otherwise
    token by token through this side's KV write (dequantized, requantized with its own scales).
    With window paging here (`window_block_table`, the window pool's `num_window_pages`, `windowed`:
    `window_layout.window_layers`) the window layers' tokens go to the window pool, those below this
    side's window dropped (window_layout.py)."""
    arrays = _reorder_conv(arrays, [name for name, _, _ in desc["arrays"]], conv_perm)
    shardings = jax.tree.map(lambda x: x.sharding, caches)
    mesh = getattr(jax.tree.leaves(shardings)[0], "mesh", None)
    if mesh is not None and mesh.size > 1:  # a TP decode side: the pulled (one-device) arrays replicated on its mesh
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arrays = [jax.device_put(a, replicated) for a in arrays]
    K, G = desc["num_tokens"], desc["model"]["num_groups"]
    kv = next((x for x in caches["kv"] if x is not None), None)
    verbatim = kv is not None and desc["page_size"] == page_size and desc["kv_dtype"] == jnp.dtype(kv.dtype).name
    n, used = desc["num_pages"], -(-K // page_size)
    own = np.full(n, num_pages * G, np.int64)  # out of range: dropped
    own[:used] = np.asarray(list(block_table)[:used], np.int64)
    page_mapping = (
        np.where(own[None] < num_pages * G, (np.arange(G) * num_pages)[:, None] + own[None], num_pages * G)
        .astype(np.int32)
        .reshape(-1)
    )  # [G*n]
    T = _pow2(K)
    t = np.arange(T)
    bt = np.asarray(list(block_table) + [0], np.int64)
    local = bt[np.minimum(t // page_size, len(bt) - 1)] * page_size + t % page_size  # [T]
    group_offset = (np.arange(G) * num_pages * page_size)[:, None]  # [G, 1]
    slots = np.where(t[None] < K, group_offset + local[None], -1).astype(np.int32).reshape(-1)
    windowed = tuple(windowed) or (False,) * len(caches["kv"])
    window_pages, window_slots = np.zeros(1, np.int32), np.zeros(1, np.int32)
    if window_block_table is not None:
        window_pages, window_slots = window_mappings(
            desc, window_block_table, page_size=page_size, num_window_pages=num_window_pages, num_groups=G
        )
    caches = _write(
        caches,
        tuple(arrays),
        jnp.asarray(slots),
        jnp.asarray(page_mapping),
        jnp.asarray(window_slots),
        jnp.asarray(window_pages),
        jnp.int32(state_slot),
        src_page_size=desc["page_size"],
        kv_dtype=desc["kv_dtype"],
        state_dtype=desc.get("state_dtype", "float32"),
        num_tokens_pad=T,
        num_slots=num_slots,
        opts=opts,
        verbatim=verbatim,
        windowed=windowed,
    )
    return jax.device_put(caches, shardings)  # the layout the step executables were compiled for
