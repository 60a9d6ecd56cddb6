"""Ragged paged attention, Pallas TPU (Mosaic) kernel.

Grid (Hkv, work items): a work item is `block_q` query tokens of one sequence (see
rpa_common.build_work_list); items past the true count return at once, so padded sequences
cost one empty grid step. Block tables, lengths, cu_q_lens and the work list are scalar-
prefetched into SMEM. Each item copies its query rows into VMEM, then walks the sequence's
pages `pages_per_block` at a time (only those its queries can see, causal + sliding window:
key blocks start at the window's first page, so no page before it is copied) with
double-buffered async copies HBM -> VMEM and an online softmax in f32; with attention sinks
each row's softmax starts from its head's sink logit (m = sink, l = 1). FP8 pages are
converted exactly to the query dtype and their per-(page, head) scales are applied to the
scores (K) and to the probabilities (V).

Layouts follow the real Mosaic compiler's tiling rules (checked by tests/test_kernels_tpu_aot.py):
every dynamic DMA offset is on a leading, untiled dim. Queries are [Hkv, T, G, D] (a block of
`block_q` tokens is reshaped in VMEM to rows = token * G + group member), a key block is
[pages_per_block, ps, D] in VMEM (one page per leading index, so FP8's (32, 128) tiles hold at
ps = 16), and FP8 scales are [P, 1, Hkv]. Token-minor pages (`KVPages.token_minor`, head_dim < 128)
arrive as [D, ps] tiles: scores are q @ k ([rows, D] x [D, keys]) and the output probs @ v^T,
so neither the pool nor a page is ever relaid out. An item writes all `block_q` tokens; rows past its sequence's end belong to later
sequences, which the sequential work axis writes afterwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache import KVPages
from pallas_kernels.rpa_common import MASK_VALUE, build_work_list, work_item


def _kernel(
    kv_lens_ref,
    block_tables_ref,
    cu_q_lens_ref,
    work_seq_ref,
    work_start_ref,
    num_work_ref,  # SMEM (scalar prefetch)
    q_hbm,
    k_hbm,
    v_hbm,
    *rest,  # HBM
    group,
    block_q,
    pages_per_block,
    max_blocks,
    sm_scale,
    sliding_window,
    soft_cap,
    quantized,
    has_sinks,
    page_size,
    token_minor,
):
    rest = list(rest)
    k_scale_hbm, v_scale_hbm = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
    sinks_vmem = rest.pop(0) if has_sinks else None  # [rows, 1] f32, this kv head's block
    if quantized:
        o_hbm, q_vmem, o_vmem, k_vmem, v_vmem, scale_smem, kv_sems, io_sem = rest
    else:
        o_hbm, q_vmem, o_vmem, k_vmem, v_vmem, kv_sems, io_sem = rest
    head = pl.program_id(0)
    work = pl.program_id(1)
    rows = block_q * group
    keys_per_block = pages_per_block * page_size

    @pl.when(work < num_work_ref[0])
    def _attend():
        seq, q_start, _, kv_len, _, first_pos, last_pos = work_item(
            work, work_seq_ref, work_start_ref, cu_q_lens_ref, kv_lens_ref, block_q
        )
        kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        # Key block b holds logical pages page_lo + b * pages_per_block + i: pages wholly before
        # the window are never copied (they may hold anything). lax.div (truncating) rather than
        # //: operands are >= 0 and floor division needs sign.
        page_lo = 0 if sliding_window is None else lax.div(kv_lo, page_size)
        num_pages = lax.div(last_pos, page_size) + 1 - page_lo
        num_blocks = lax.div(num_pages + pages_per_block - 1, pages_per_block)

        # Tokens are a leading (untiled) dim of q [Hkv, T, G, D]: any start offset is legal.
        q_copy = pltpu.make_async_copy(q_hbm.at[head, pl.ds(q_start, block_q)], q_vmem, io_sem)
        q_copy.start()

        def page_copies(block, slot):
            copies = []
            for i in range(pages_per_block):
                logical = jnp.minimum(page_lo + block * pages_per_block + i, max_blocks - 1)
                page = block_tables_ref[seq * max_blocks + logical]
                # One page per leading index: a row offset i * ps would break FP8's (32, 128) tiles.
                copies.append(pltpu.make_async_copy(k_hbm.at[page, head], k_vmem.at[slot, i], kv_sems.at[slot]))
                copies.append(pltpu.make_async_copy(v_hbm.at[page, head], v_vmem.at[slot, i], kv_sems.at[slot]))
                if quantized:
                    # Scales are [P, 1, Hkv]: the page is a leading (untiled) dim, so any page is legal.
                    copies.append(
                        pltpu.make_async_copy(k_scale_hbm.at[page], scale_smem.at[0, slot, i], kv_sems.at[slot])
                    )
                    copies.append(
                        pltpu.make_async_copy(v_scale_hbm.at[page], scale_smem.at[1, slot, i], kv_sems.at[slot])
                    )
            return copies

        for copy in page_copies(0, 0):
            copy.start()
        q_copy.wait()
        q = q_vmem[...].reshape(rows, q_vmem.shape[-1])  # [rows, D]
        shape = (rows, keys_per_block)
        row_pos = first_pos + lax.div(lax.broadcasted_iota(jnp.int32, shape, 0), group)
        col = lax.broadcasted_iota(jnp.int32, shape, 1)

        def column_scales(which, slot):
            # [1, keys]: the scale of the page each key column came from.
            page_of_col = lax.div(lax.broadcasted_iota(jnp.int32, (1, keys_per_block), 1), page_size)
            scales = jnp.zeros((1, keys_per_block), jnp.float32)
            for i in range(pages_per_block):
                scales = jnp.where(page_of_col == i, scale_smem[which, slot, i, 0, head], scales)
            return scales

        def attend_block(block, carry):
            m_prev, l_prev, acc_prev = carry
            slot = lax.rem(block, 2)
            first_key = (page_lo + block * pages_per_block) * page_size

            @pl.when(block + 1 < num_blocks)
            def _prefetch_next():
                for copy in page_copies(block + 1, 1 - slot):
                    copy.start()

            for copy in page_copies(block, slot):
                copy.wait()
            if token_minor:  # pages [D, ps]: keys on the lanes, whole 128-lane rows per page
                pages_k = [k_vmem[slot, i] for i in range(pages_per_block)]
                pages_v = [v_vmem[slot, i] for i in range(pages_per_block)]
                k = (pages_k[0] if pages_per_block == 1 else jnp.concatenate(pages_k, axis=1)).astype(q.dtype)
                v = pages_v[0] if pages_per_block == 1 else jnp.concatenate(pages_v, axis=1)  # [D, keys]
                scores = lax.dot_general(q, k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            else:
                k = k_vmem[slot].reshape(keys_per_block, -1).astype(q.dtype)  # [keys, D]
                v = v_vmem[slot].reshape(keys_per_block, -1)
                scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            key_pos = first_key + col  # [rows, keys]; scores [rows, keys]
            if quantized:
                scores = scores * column_scales(0, slot)
            scores = scores * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (key_pos <= row_pos) & (key_pos < kv_len)
            if sliding_window is not None:
                visible &= key_pos > row_pos - sliding_window
            scores = jnp.where(visible, scores, MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # [rows, 1]
            probs = jnp.where(visible, jnp.exp(scores - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
            if quantized:  # scales of pages past the context may be NaN: keep the where outside
                probs = jnp.where(visible, probs * column_scales(1, slot), 0.0)
            # Unused page slots may hold NaN, and 0 * NaN = NaN inside the matmul.
            # (Keys before the window in the first page are real: only whole pages are freed.)
            key_axis = 1 if token_minor else 0
            v_pos = first_key + lax.broadcasted_iota(jnp.int32, v.shape, key_axis)
            v = jnp.where(v_pos < kv_len, v.astype(q.dtype), jnp.zeros((), q.dtype))
            pv = lax.dot_general(
                probs.astype(q.dtype), v, (((1,), (key_axis,)), ((), ())), preferred_element_type=jnp.float32
            )  # [rows, D]
            return m_next, l_next, alpha * acc_prev + pv

        if has_sinks:  # a sink: a first key of logit sinks[head], value zero
            m_init, l_init = sinks_vmem[...], jnp.ones((rows, 1), jnp.float32)
        else:
            m_init, l_init = jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
        init = (m_init, l_init, jnp.zeros(q.shape, jnp.float32))
        _, l_final, acc = lax.fori_loop(0, num_blocks, attend_block, init)
        o_vmem[...] = (acc / l_final).reshape(o_vmem.shape).astype(o_vmem.dtype)
        out_copy = pltpu.make_async_copy(o_vmem, o_hbm.at[head, pl.ds(q_start, block_q)], io_sem)
        out_copy.start()
        out_copy.wait()


def default_block_q(group: int) -> int:
    """Query tokens per work item: 128 rows of (token, group member), at least 8 tokens."""
    return max(8, 128 // group)


def default_pages_per_block(page_size: int, max_blocks: int) -> int:
    """Pages per key block: about 128 keys."""
    return max(1, min(max_blocks, 128 // page_size))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "pages_per_block", "interpret")
)
def ragged_paged_attention_tpu(
    q: jax.Array,
    kv: KVPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret=False,
) -> jax.Array:
    """TPU kernel; arguments as `ragged_paged_attention` (int32 metadata, num_seqs shape [])."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.num_kv_heads, kv.page_size
    num_seqs_padded, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    block_q = block_q or default_block_q(group)
    pages_per_block = pages_per_block or default_pages_per_block(page_size, max_blocks)
    num_work = pl.cdiv(num_tokens, block_q) + num_seqs_padded
    work_seq, work_start, num_work_valid = build_work_list(cu_q_lens, num_seqs, block_q, num_work)

    # q_heads: [Hkv, T + bq, G, D]; in VMEM a block becomes rows = token * G + group member.
    padded_tokens = num_tokens + block_q
    q_heads = (
        jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
        .reshape(padded_tokens, num_kv_heads, group, head_dim)
        .transpose(1, 0, 2, 3)
    )

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    inputs = [q_heads, kv.k, kv.v]
    in_specs = [any_spec] * 3
    q_block = (block_q, group, head_dim)
    page_tile = (head_dim, page_size) if kv.token_minor else (page_size, head_dim)
    scratch = [
        pltpu.VMEM(q_block, q.dtype),
        pltpu.VMEM(q_block, q.dtype),
        pltpu.VMEM((2, pages_per_block, *page_tile), kv.k.dtype),
        pltpu.VMEM((2, pages_per_block, *page_tile), kv.v.dtype),
    ]
    if kv.quantized:
        inputs += [kv.k_scale[:, None, :], kv.v_scale[:, None, :]]  # [P, 1, Hkv]
        in_specs += [any_spec] * 2
        scratch.append(pltpu.SMEM((2, 2, pages_per_block, 1, num_kv_heads), jnp.float32))
    scratch += [pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA(())]
    if sinks is not None:
        # [Hkv, rows, 1]: row token * G + g holds sinks[head * G + g]; one VMEM block per kv head.
        rows = block_q * group
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, block_q))
        inputs.append(sink_rows.reshape(num_kv_heads, rows, 1))
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda head, work, *_: (head, 0, 0)))

    kernel = functools.partial(
        _kernel,
        group=group,
        block_q=block_q,
        pages_per_block=pages_per_block,
        max_blocks=max_blocks,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=kv.quantized,
        has_sinks=sinks is not None,
        page_size=page_size,
        token_minor=kv.token_minor,
    )
    out_rows = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_heads.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_kv_heads, num_work),
            in_specs=in_specs,
            out_specs=any_spec,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(kv_lens, block_tables.reshape(-1), cu_q_lens, work_seq, work_start, num_work_valid, *inputs)
    out = out_rows.transpose(1, 0, 2, 3)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
