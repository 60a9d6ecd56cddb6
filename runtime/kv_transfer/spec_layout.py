"""The speculative drafters' state under P/D disaggregation (issue 35): what travels, what the decode side recomputes.

`method: mtp`: the MTP layer's K/V (models/mtp.py) needs the target's hidden state at every prompt
token, which only the prefill side has. A prefill instance with `speculative_config: {method: mtp}`
(opt-in; one device; runtime/engine/construction.py `computes_mtp`) computes it over every prompt and
drafts nothing, and its
descriptor then carries `"mtp": {"hidden_dtype": ...}` and, after the target's arrays,

    mtp.k, mtp.v  [n, Hkv, ps, D]   the MTP pool's rows of the request's pages (ungrouped: row = page id)
    mtp.k_scale, mtp.v_scale [n, Hkv]   FP8 KV only
    mtp.hidden    [1, H]            the carry: the target's final-norm output at the last shipped token

in the wire form of the target's pages (runtime/kv_transfer/layout.py: raw bits below float32). The
decode side feeds the last prompt token itself (the N-1 rule) and its forward pass writes the MTP row
before it from that carry, as a colocated engine's would. A decode side with MTP caches refuses a
descriptor without them (`TransferError`: its drafts would attend over stale rows; the request then
prefills locally or fails, `kv_transfer.on_pull_failure`); one without drops them after the pull.

`method: draft_model`: the draft model's K/V depends on the prompt tokens only, so nothing travels:
the decode side runs the draft model over the pulled tokens into the request's pages before its first
step (`recompute_draft`; a draft's prefill, roughly draft/target parameters of the prompt's FLOPs).
The prefill instance needs no draft and no speculative_config (refused on the prefill role).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.batch import ForwardBatch
from models.draft_model import absorb
from runtime.kv_transfer.base import TransferError
from runtime.kv_transfer.layout import _bits, _gather, _pow2, _to_wire, write_request_state

MTP = "mtp"  # the descriptor's field, and the arrays' name prefix
HIDDEN_DTYPES = ("float32", "bfloat16", "float16")


def _view(kv) -> dict:
    """The MTP pool as a one-position cache tree of layout.py (one group: row = page id)."""
    return {"kv": (kv,), "conv": (None,), "rec": (None,)}


def gather_mtp(caches, arrays: list, desc: dict, *, block_table, state_slot: int, num_pages: int, num_slots: int):
    """(arrays, desc) with the MTP's K/V of the request's pages and its carry appended."""
    kv, hidden = caches[MTP]["kv"], caches[MTP]["hidden"]
    used = list(block_table)[: -(-desc["num_tokens"] // desc["page_size"])]
    pages = np.zeros(desc["num_pages"], np.int32)
    pages[: len(used)] = used
    out = _gather(
        _view(kv),
        jnp.asarray(pages),
        jnp.zeros(1, jnp.int32),
        jnp.int32(state_slot),
        num_pages=num_pages,
        num_slots=num_slots,
        kv_repeat=1,
        windowed=(False,),
        num_window_pages=0,
    )
    out.append(_to_wire(hidden[state_slot][None], hidden.dtype))
    device = jax.devices()[0]
    out = [jax.device_put(a, device) for a in out]
    names = ["k", "v"] + (["k_scale", "v_scale"] if kv.k_scale is not None else []) + ["hidden"]
    entries = [[f"{MTP}.{name}", list(a.shape), a.dtype.name] for name, a in zip(names, out)]
    desc = {**desc, MTP: {"hidden_dtype": jnp.dtype(hidden.dtype).name}, "arrays": desc["arrays"] + entries}
    return arrays + out, desc


def expected_mtp(desc: dict, cfg) -> list[list]:
    """The MTP arrays `desc` must list after the target's (none without its `mtp` field)."""
    info = desc.get(MTP)
    if info is None:
        return []
    if not isinstance(info, dict) or set(info) != {"hidden_dtype"} or info["hidden_dtype"] not in HIDDEN_DTYPES:
        raise TransferError(
            f"descriptor field mtp {str(info)[:200]!r} must be {{'hidden_dtype': one of {HIDDEN_DTYPES}}}"
        )
    kv_dtype, hidden_dtype = jnp.dtype(desc["kv_dtype"]), jnp.dtype(info["hidden_dtype"])
    wire = kv_dtype.name if kv_dtype == jnp.float32 else _bits(kv_dtype).name
    page = [desc["num_pages"], cfg.num_kv_heads, desc["page_size"], cfg.head_dim]
    want = [[f"{MTP}.k", page, wire], [f"{MTP}.v", page, wire]]
    if kv_dtype.itemsize == 1:
        want += [[f"{MTP}.k_scale", page[:2], "float32"], [f"{MTP}.v_scale", page[:2], "float32"]]
    hidden_wire = hidden_dtype.name if hidden_dtype == jnp.float32 else _bits(hidden_dtype).name
    return want + [[f"{MTP}.hidden", [1, cfg.hidden_size], hidden_wire]]


def check_drafter(desc: dict, has_mtp: bool) -> None:
    """TransferError where this decode side drafts with the MTP and the descriptor brings none."""
    if has_mtp and MTP not in desc:
        raise TransferError(
            "the prefill instance sent no MTP state (it ships it when given speculative_config: {method: mtp}, "
            "on one device): this instance's MTP drafts would attend over stale pages"
        )


def num_mtp_arrays(desc: dict) -> int:
    return sum(1 for name, _, _ in desc["arrays"] if name.startswith(f"{MTP}."))


def write_mtp(caches, arrays: list, desc: dict, *, block_table, state_slot, page_size, num_pages, num_slots, opts):
    """`caches` with the pulled MTP rows in the request's pages and the carry in its state slot."""
    kv_arrays, hidden = arrays[:-1], arrays[-1]
    sub = {**desc, "model": {**desc["model"], "num_groups": 1}, "arrays": desc["arrays"][-len(arrays) : -1]}
    view = write_request_state(
        _view(caches[MTP]["kv"]),
        kv_arrays,
        sub,
        block_table=block_table,
        state_slot=state_slot,
        page_size=page_size,
        num_pages=num_pages,
        num_slots=num_slots,
        opts=opts,
        windowed=(False,),
    )
    sent, carry = jnp.dtype(desc[MTP]["hidden_dtype"]), caches[MTP]["hidden"]
    hidden = hidden if hidden.dtype == sent else jax.lax.bitcast_convert_type(hidden, sent)
    carry = carry.at[state_slot].set(hidden[0].astype(carry.dtype))
    return {**caches, MTP: {**caches[MTP], "kv": view["kv"][0], "hidden": carry}}


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(1,))
def _absorb(draft_params, draft_cache, batch, draft_cfg, opts):
    return absorb(draft_params, draft_cache, batch, draft_cfg, opts)


def recompute_draft(draft_params, draft_cache: dict, token_ids, block_table, *, page_size: int, draft_cfg, opts):
    """The draft model's K/V of `token_ids` (positions 0 ..) written into `block_table`'s pages; tokens
    and pages padded to powers of two (one compile per size)."""
    K = len(token_ids)
    T, blocks = _pow2(K), -(-K // page_size)
    table = np.zeros(_pow2(blocks), np.int32)
    table[:blocks] = list(block_table)[:blocks]
    pos = np.arange(T, dtype=np.int32)
    slots = np.where(pos < K, table[np.minimum(pos // page_size, blocks - 1)] * page_size + pos % page_size, -1)
    ids = np.zeros(T, np.int32)
    ids[:K] = token_ids
    batch = ForwardBatch(
        input_ids=jnp.asarray(ids),
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(slots.astype(np.int32)),
        cu_q_lens=jnp.asarray([0, K], jnp.int32),
        kv_lens=jnp.asarray([K], jnp.int32),
        block_tables=jnp.asarray(table[None]),
        state_slot_ids=jnp.zeros(1, jnp.int32),
        has_initial_state=jnp.zeros(1, bool),
        num_seqs=jnp.asarray(1, jnp.int32),
        logits_indices=jnp.asarray([K - 1], jnp.int32),
    )
    return _absorb(draft_params, draft_cache, batch, draft_cfg, opts)
