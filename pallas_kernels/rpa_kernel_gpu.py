"""Ragged paged attention, Pallas GPU kernel (Triton lowering).

Grid (work items, Hkv): a work item is `block_q` query tokens of one sequence (see
rpa_common.build_work_list); items past the true count return at once. Each program loads its
query rows (row = token * G + group member, so the Hq // Hkv heads sharing a kv head form one
[block_q * G, D] tile), walks the sequence's visible pages one page at a time with an online
softmax in f32 (starting from the head's sink logit with attention sinks), and stores only the
rows that belong to its sequence (masked store).
FP8 pages are converted exactly to the query dtype; their per-(page, head) scales multiply the
scores (K) and the probabilities (V).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache import KVPages
from pallas_kernels.rpa_common import MASK_VALUE, build_work_list, work_item


def _kernel(
    kv_lens_ref,
    block_tables_ref,
    cu_q_lens_ref,
    work_seq_ref,
    work_start_ref,
    num_work_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    group,
    block_q,
    sm_scale,
    sliding_window,
    soft_cap,
    quantized,
    has_sinks,
):
    rest = list(rest)
    k_scale_ref, v_scale_ref = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
    sinks_ref = rest.pop(0) if has_sinks else None  # [Hkv, rows] f32
    (o_ref,) = rest
    work = pl.program_id(0)
    head = pl.program_id(1)
    rows = block_q * group
    page_size, head_dim = k_ref.shape[2], k_ref.shape[3]

    @pl.when(work < num_work_ref[0])
    def _attend():
        seq, q_start, q_len, kv_len, first_row, first_pos, last_pos = work_item(
            work, work_seq_ref, work_start_ref, cu_q_lens_ref, kv_lens_ref, block_q
        )
        kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)

        q_rows = pl.ds(q_start * group, rows)
        q = q_ref[head, q_rows, :]  # [rows, D]
        row_in_block = lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // group
        row_pos = first_pos + row_in_block
        col = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        v_row = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)

        def attend_page(block, carry):
            m_prev, l_prev, acc_prev = carry
            page = block_tables_ref[seq, block]
            k = k_ref[page, head, :, :].astype(q.dtype)  # [ps, D]
            v = v_ref[page, head, :, :].astype(q.dtype)
            key_pos = block * page_size + col  # [rows, ps]
            scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [rows, ps]
            if quantized:
                scores = scores * k_scale_ref[page, head]
            scores = scores * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (key_pos <= row_pos) & (key_pos < kv_len)
            if sliding_window is not None:
                visible &= key_pos > row_pos - sliding_window
            scores = jnp.where(visible, scores, MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))  # [rows]
            probs = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + jnp.sum(probs, axis=1)
            if quantized:  # a page scale past the context may be NaN: keep the where outside
                probs = jnp.where(visible, probs * v_scale_ref[page, head], 0.0)
            # Unused page slots may hold NaN, and 0 * NaN = NaN inside the matmul. (Pages wholly
            # before the window are never loaded: the loop starts at the window's page.)
            v = jnp.where(block * page_size + v_row < kv_len, v, jnp.zeros((), q.dtype))
            pv = jnp.dot(probs.astype(q.dtype), v, preferred_element_type=jnp.float32)
            return m_next, l_next, alpha[:, None] * acc_prev + pv

        if has_sinks:  # a sink: a first key of logit sinks[head], value zero
            m_init, l_init = sinks_ref[head, :], jnp.ones((rows,), jnp.float32)
        else:
            m_init, l_init = jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
        init = (m_init, l_init, jnp.zeros((rows, head_dim), jnp.float32))
        _, l_final, acc = lax.fori_loop(kv_lo // page_size, last_pos // page_size + 1, attend_page, init)
        out = (acc / l_final[:, None]).astype(o_ref.dtype)
        row_valid = first_row + lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) // group < q_len
        plgpu.store(o_ref.at[head, q_rows, :], out, mask=row_valid)


def default_block_q(group: int) -> int:
    """Query tokens per program: 64 rows of (token, group member), at least 16 rows."""
    return max(1, 64 // group, pl.cdiv(16, group))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "num_warps", "num_stages", "interpret"),
)
def ragged_paged_attention_gpu(
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
    num_warps: int = 4,
    num_stages: int = 2,
    interpret=False,
) -> jax.Array:
    """GPU kernel; arguments as `ragged_paged_attention` (int32 metadata, num_seqs shape []).

    Triton needs power-of-two tiles of at least 16: page_size >= 16, head_dim in {64, 128, 256}.
    A head group Hq // Hkv that is not a power of two (SmolLM2: 9 // 3) is padded with zero
    query heads up to the next one; their rows are computed and dropped.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.num_kv_heads, kv.page_size
    true_group = num_q_heads // num_kv_heads
    group = 1 << (true_group - 1).bit_length()
    for name, value in (("page_size", page_size), ("head_dim", head_dim)):
        if value & (value - 1):
            raise ValueError(f"GPU kernel needs a power-of-two {name}, got {value}")
    if page_size < 16:
        raise ValueError(f"GPU kernel needs page_size >= 16, got {page_size}")
    block_q = block_q or default_block_q(group)
    num_work = pl.cdiv(num_tokens, block_q) + block_tables.shape[0]
    work_seq, work_start, num_work_valid = build_work_list(cu_q_lens, num_seqs, block_q, num_work)

    # q_rows: [Hkv, (T + bq) * G, D], row = token * G + member of the head group.
    padded_tokens = num_tokens + block_q
    q_groups = q.reshape(num_tokens, num_kv_heads, true_group, head_dim)
    q_rows = (
        jnp.pad(q_groups, ((0, block_q), (0, 0), (0, group - true_group), (0, 0)))
        .transpose(1, 0, 2, 3)
        .reshape(num_kv_heads, padded_tokens * group, head_dim)
    )
    inputs = [kv_lens, block_tables, cu_q_lens, work_seq, work_start, num_work_valid, q_rows, kv.k, kv.v]
    if kv.quantized:
        inputs += [kv.k_scale, kv.v_scale]
    if sinks is not None:
        # [Hkv, rows]: row token * G + g holds sinks[head * G + g] (padded group members: 0).
        sink_groups = jnp.pad(
            sinks.astype(jnp.float32).reshape(num_kv_heads, true_group), ((0, 0), (0, group - true_group))
        )
        inputs.append(jnp.tile(sink_groups, (1, block_q)))

    kernel = functools.partial(
        _kernel,
        group=group,
        block_q=block_q,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=kv.quantized,
        has_sinks=sinks is not None,
    )
    out_rows = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        grid=(num_work, num_kv_heads),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*inputs)
    out = out_rows.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out[:num_tokens, :, :true_group].reshape(num_tokens, num_q_heads, head_dim)
