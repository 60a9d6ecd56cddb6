"""MLA over paged latent rows, Pallas GPU kernel (Triton lowering).

Grid (work items, head blocks): a work item is `block_q` query tokens of one sequence
(rpa_common's work list); a head block is `block_h` of the H query heads (H padded with zero
heads to a power of two), rows = token * block_h + head forming one [block_q * block_h, W]
query tile. The program walks the sequence's pages one at a time with an online softmax in f32:
each latent page [ps, W] serves every head of the block as the key (all W lanes) and as the
value (its first lanes). Triton tiles are powers of two, so W (a multiple of 16; DeepSeek's
576 = 512 + 64) is read as its binary pieces, the scores summed over them, and the value read
from the pieces that start below v_dim. FP8 pages are converted exactly to the query dtype;
the per-page scale multiplies the scores (K) and the probabilities (V). Rows past the
sequence's end are not stored (masked store).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.rpa_common import MASK_VALUE, build_work_list, work_item

if TYPE_CHECKING:  # mla.py imports this module lazily, at dispatch
    from pallas_kernels.mla import LatentPages


def _kernel(
    kv_lens_ref,
    block_tables_ref,
    cu_q_lens_ref,
    work_seq_ref,
    work_start_ref,
    num_work_ref,
    q_ref,
    c_ref,
    *rest,
    block_h,
    block_q,
    sm_scale,
    pieces,
    value_pieces,
    quantized,
):
    rest = list(rest)
    scale_ref = rest.pop(0) if quantized else None  # [P] f32
    (o_ref,) = rest
    work = pl.program_id(0)
    head_block = pl.program_id(1)
    rows = block_q * block_h
    page_size = c_ref.shape[1]

    @pl.when(work < num_work_ref[0])
    def _attend():
        seq, q_start, q_len, kv_len, first_row, first_pos, last_pos = work_item(
            work, work_seq_ref, work_start_ref, cu_q_lens_ref, kv_lens_ref, block_q
        )

        q_rows = pl.ds(q_start * block_h, rows)
        qs = [q_ref[head_block, q_rows, pl.ds(start, size)] for start, size in pieces]  # [rows, size] each
        dtype = qs[0].dtype
        row_pos = first_pos + lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // block_h
        col = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)

        def attend_page(block, carry):
            m_prev, l_prev, accs = carry
            page = block_tables_ref[seq, block]
            tiles = []
            for start, size in pieces:
                tile = c_ref[page, :, pl.ds(start, size)].astype(dtype)  # [ps, size]
                # Slots past the context may hold NaN, and 0 * NaN = NaN inside the matmuls.
                key = block * page_size + lax.broadcasted_iota(jnp.int32, (page_size, size), 0)
                tiles.append(jnp.where(key < kv_len, tile, jnp.zeros((), dtype)))
            scores = jnp.dot(qs[0], tiles[0].T, preferred_element_type=jnp.float32)  # [rows, ps]
            for q_piece, tile in zip(qs[1:], tiles[1:]):
                scores += jnp.dot(q_piece, tile.T, preferred_element_type=jnp.float32)
            if quantized:
                scores = scores * scale_ref[page]
            key_pos = block * page_size + col
            visible = (key_pos <= row_pos) & (key_pos < kv_len)
            scores = jnp.where(visible, scores * sm_scale, MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))  # [rows]
            probs = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + jnp.sum(probs, axis=1)
            if quantized:  # a page scale past the context may be NaN: keep the where outside
                probs = jnp.where(visible, probs * scale_ref[page], 0.0)
            probs = probs.astype(dtype)
            accs = tuple(
                alpha[:, None] * acc + jnp.dot(probs, tile, preferred_element_type=jnp.float32)
                for acc, tile in zip(accs, tiles[: len(value_pieces)])
            )
            return m_next, l_next, accs

        init = (
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, size), jnp.float32) for _, size in value_pieces),
        )
        _, l_final, accs = lax.fori_loop(0, last_pos // page_size + 1, attend_page, init)
        for (start, size), acc in zip(value_pieces, accs):
            row_valid = first_row + lax.broadcasted_iota(jnp.int32, (rows, size), 0) // block_h < q_len
            out = (acc / l_final[:, None]).astype(o_ref.dtype)
            plgpu.store(o_ref.at[head_block, q_rows, pl.ds(start, size)], out, mask=row_valid)


def lane_pieces(width: int) -> tuple[tuple[int, int], ...]:
    """(start, size) power-of-two pieces of [0, width), largest first: 576 -> (0, 512), (512, 64)."""
    pieces, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            pieces.append((start, 1 << bit))
            start += 1 << bit
    return tuple(pieces)


def default_block_h(num_heads_padded: int) -> int:
    """Heads per program: all of them up to 64 (a [64, 512] f32 accumulator per program)."""
    return min(num_heads_padded, 64)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "v_dim", "block_h", "block_q", "num_warps", "num_stages", "interpret"),
)
def mla_ragged_paged_attention_gpu(
    q: jax.Array,
    latent: LatentPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    v_dim: int,
    block_h: int | None = None,
    block_q: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    interpret=False,
) -> jax.Array:
    """GPU kernel; arguments as `mla.mla_ragged_paged_attention` (int32 metadata, num_seqs []).

    Triton needs power-of-two tiles of at least 16: page_size a power of two >= 16, W a
    multiple of 16, block_h * block_q >= 16 (the defaults give 64 rows).
    Returns [T, H, v_dim] in q's dtype.
    """
    num_tokens, num_heads, width = q.shape
    page_size = latent.c.shape[1]
    if page_size & (page_size - 1) or page_size < 16:
        raise ValueError(f"GPU kernel needs a power-of-two page_size >= 16, got {page_size}")
    if width % 16:
        raise ValueError(f"GPU kernel needs a row width W that is a multiple of 16, got {width}")
    heads_padded = 1 << (num_heads - 1).bit_length()
    block_h = block_h or default_block_h(heads_padded)
    block_q = block_q or max(1, 64 // block_h)
    rows = block_h * block_q
    if block_h & (block_h - 1) or heads_padded % block_h or rows & (rows - 1) or rows < 16:
        raise ValueError(f"GPU kernel needs power-of-two block_h | {heads_padded} and block_h * block_q >= 16")
    pieces = lane_pieces(width)
    value_pieces = tuple(p for p in pieces if p[0] < v_dim)
    v_width = sum(size for _, size in value_pieces)
    num_work = pl.cdiv(num_tokens, block_q) + block_tables.shape[0]
    work_seq, work_start, num_work_valid = build_work_list(cu_q_lens, num_seqs, block_q, num_work)

    # q_rows: [H / bh, (T + bq) * bh, W], row = token * bh + head within the block.
    padded_tokens = num_tokens + block_q
    num_head_blocks = heads_padded // block_h
    q_rows = (
        jnp.pad(q, ((0, block_q), (0, heads_padded - num_heads), (0, 0)))
        .reshape(padded_tokens, num_head_blocks, block_h, width)
        .transpose(1, 0, 2, 3)
        .reshape(num_head_blocks, padded_tokens * block_h, width)
    )
    inputs = [kv_lens, block_tables, cu_q_lens, work_seq, work_start, num_work_valid, q_rows, latent.c]
    if latent.quantized:
        inputs.append(latent.c_scale.astype(jnp.float32))

    kernel = functools.partial(
        _kernel,
        block_h=block_h,
        block_q=block_q,
        sm_scale=sm_scale,
        pieces=pieces,
        value_pieces=value_pieces,
        quantized=latent.quantized,
    )
    out_rows = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_head_blocks, padded_tokens * block_h, v_width), q.dtype),
        grid=(num_work, num_head_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*inputs)
    out = out_rows.reshape(num_head_blocks, padded_tokens, block_h, v_width).transpose(1, 0, 2, 3)
    return out.reshape(padded_tokens, heads_padded, v_width)[:num_tokens, :num_heads, :v_dim]
