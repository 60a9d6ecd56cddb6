"""Gated delta rule over a ragged batch: Mosaic TPU Pallas kernel (spec: `gdn.py`).

Grid (sequence slot s, value head h). Per grid step, with cu_q_lens / slot ids / flags in SMEM
(scalar prefetch): load the state [K,V] of slot `state_slot_ids[s]` (or zeros), run the WY
chunked form over the sequence's full chunks of C tokens, then the per-token recurrence over
the remaining < C tokens (a decode step is that remainder), and DMA the state back. All token
arrays stay in HBM and are copied chunk by chunk, so a sequence costs what its tokens cost.
Padded sequences (s >= num_seqs) and empty ones do nothing; padding tokens are never read
into a real sequence's math and their outputs stay zero.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kernel_math import F32, unit_lower_inverse
from pallas_kernels.kernel_math import dot as _dot
from pallas_kernels.kernel_math import dot_nt as _dot_nt


def _row_to_column(row, eye):
    """[1,C] -> [C,1] without a reshape: keep the diagonal of the broadcast, sum over lanes."""
    square = jnp.broadcast_to(row, eye.shape)
    return jnp.sum(jnp.where(eye, square, 0.0), axis=1, keepdims=True)


def _column_to_row(col, eye):
    square = jnp.broadcast_to(col, eye.shape)
    return jnp.sum(jnp.where(eye, square, 0.0), axis=0, keepdims=True)


def _wy_chunk(state, q, k, v, g_row, beta_row):
    """One full chunk. state [K,V], q/k [C,K], v [C,V], g_row/beta_row [1,C] (f32).

    Returns (o [C,V], state after the chunk [K,V]).
    """
    c = q.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye, inclusive, strict = rows == cols, rows >= cols, rows > cols
    cum_g = jnp.sum(jnp.where(inclusive, jnp.broadcast_to(g_row, (c, c)), 0.0), axis=1, keepdims=True)  # G [C,1]
    cum_g_row = _column_to_row(cum_g, eye)  # G [1,C]
    last = lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    cum_g_last = jnp.sum(jnp.where(last, cum_g, 0.0), axis=0, keepdims=True)  # G_C [1,1]
    beta_col = _row_to_column(beta_row, eye)  # [C,1]

    # Mask before exp: above the diagonal G_r - G_s > 0 and could overflow.
    gamma = jnp.where(inclusive, jnp.exp(jnp.where(inclusive, cum_g - cum_g_row, 0.0)), 0.0)
    a = jnp.where(strict, beta_col * gamma * _dot_nt(k, k), 0.0)
    inverse = unit_lower_inverse(a)
    decay_in = jnp.exp(cum_g)  # [C,1]
    w = _dot(inverse, beta_col * decay_in * k)  # [C,K]
    u = _dot(inverse, beta_col * v) - _dot(w, state)  # [C,V]
    o = decay_in * _dot(q, state) + _dot(jnp.where(inclusive, gamma * _dot_nt(q, k), 0.0), u)
    k_decayed = jnp.exp(cum_g_last - cum_g) * k  # [C,K]
    state = jnp.exp(cum_g_last) * state + _dot(k_decayed.T, u)
    return o, state


def _recurrent_token(state, row, q_t, k_t, v, g_row, beta_row):
    """Token `row` of the chunk buffers. q_t/k_t [K,C] (transposed), v [C,V] -> (o [1,V], state)."""
    lane = lax.broadcasted_iota(jnp.int32, g_row.shape, 1)
    alpha = jnp.exp(jnp.sum(jnp.where(lane == row, g_row, 0.0), axis=1, keepdims=True))  # [1,1]
    beta = jnp.sum(jnp.where(lane == row, beta_row, 0.0), axis=1, keepdims=True)  # [1,1]
    key_lane = lax.broadcasted_iota(jnp.int32, k_t.shape, 1)
    q_col = jnp.sum(jnp.where(key_lane == row, q_t, 0.0), axis=1, keepdims=True)  # [K,1]
    k_col = jnp.sum(jnp.where(key_lane == row, k_t, 0.0), axis=1, keepdims=True)  # [K,1]
    value_row = lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v_row = jnp.sum(jnp.where(value_row == row, v, 0.0), axis=0, keepdims=True)  # [1,V]
    decayed = alpha * state
    update = beta * (v_row - jnp.sum(k_col * decayed, axis=0, keepdims=True))  # [1,V]
    state = decayed + k_col * update
    return jnp.sum(q_col * state, axis=0, keepdims=True), state


def _gdn_kernel(
    cu_ref,
    slot_ref,
    has_init_ref,
    num_seqs_ref,  # SMEM
    q_hbm,
    k_hbm,
    v_hbm,
    g_hbm,
    beta_hbm,
    state_in,
    o_in,  # HBM
    o_hbm,
    state_hbm,  # HBM outputs
    q_buf,
    k_buf,
    v_buf,
    g_buf,
    beta_buf,
    o_buf,
    o_row_buf,
    state_buf,
    state_io,
    sems,
    *,
    chunk_size,
    heads_per_key_head,
    padded_tokens,
):
    del o_in  # aliased to o_hbm; state_in is aliased to state_hbm
    c = chunk_size
    s, h = pl.program_id(0), pl.program_id(1)
    start, end = cu_ref[s], cu_ref[s + 1]
    length = end - start
    key_head = lax.div(h, heads_per_key_head)  # not //: floor division lowers via sign

    def copy(src, dst, sem_index):
        dma = pltpu.make_async_copy(src, dst, sems.at[sem_index])
        dma.start()
        dma.wait()

    def load_chunk(first_token):
        # Token arrays are [heads, Tp, 1, ·]: tokens are a leading (untiled) dim, so a chunk may
        # start at any token (Mosaic rejects unaligned offsets on the two minor, tiled dims).
        copy(q_hbm.at[key_head, pl.ds(first_token, c)], q_buf, 0)
        copy(k_hbm.at[key_head, pl.ds(first_token, c)], k_buf, 1)
        copy(v_hbm.at[h, pl.ds(first_token, c)], v_buf, 2)
        copy(g_hbm.at[h, pl.ds(first_token, c)], g_buf, 3)
        copy(beta_hbm.at[h, pl.ds(first_token, c)], beta_buf, 4)

    eye = lax.broadcasted_iota(jnp.int32, (c, c), 0) == lax.broadcasted_iota(jnp.int32, (c, c), 1)

    def matrix(buf):  # [C, 1, D] buffer -> [C, D] f32
        return buf[...].reshape(c, buf.shape[-1]).astype(F32)

    def row(buf):  # [C, 1, 1] buffer -> [1, C] f32
        return _column_to_row(buf[...].reshape(c, 1), eye)

    @pl.when((s < num_seqs_ref[0]) & (length > 0))
    def _():
        slot = slot_ref[s]

        @pl.when(has_init_ref[s] != 0)
        def _():
            if state_io is None:
                copy(state_in.at[slot, h], state_buf, 5)
            else:  # a bf16 slot: DMA it as stored, compute in f32
                copy(state_in.at[slot, h], state_io, 5)
                state_buf[...] = state_io[...].astype(F32)

        @pl.when(has_init_ref[s] == 0)
        def _():
            state_buf[...] = jnp.zeros(state_buf.shape, F32)

        num_full = lax.div(length, c)

        def full_chunk(i, carry):
            first = start + i * c
            load_chunk(first)
            o, state = _wy_chunk(state_buf[...], matrix(q_buf), matrix(k_buf), matrix(v_buf), row(g_buf), row(beta_buf))
            state_buf[...] = state
            o_buf[...] = o.reshape(o_buf.shape).astype(o_buf.dtype)
            copy(o_buf, o_hbm.at[h, pl.ds(first, c)], 6)
            return carry

        lax.fori_loop(0, num_full, full_chunk, 0)
        remainder = length - num_full * c

        @pl.when(remainder > 0)
        def _():
            first = start + num_full * c
            # A window of C tokens that contains the remainder and stays inside the arrays.
            window = jnp.minimum(first, padded_tokens - c)
            offset = first - window
            load_chunk(window)
            q_t, k_t = matrix(q_buf).T, matrix(k_buf).T
            v, g_row, beta_row = matrix(v_buf), row(g_buf), row(beta_buf)

            def token(i, state):
                o_row, state = _recurrent_token(state, offset + i, q_t, k_t, v, g_row, beta_row)
                o_row_buf[...] = o_row.reshape(o_row_buf.shape).astype(o_row_buf.dtype)
                copy(o_row_buf, o_hbm.at[h, pl.ds(first + i, 1)], 6)
                return state

            state_buf[...] = lax.fori_loop(0, remainder, token, state_buf[...])

        if state_io is None:
            copy(state_buf, state_hbm.at[slot, h], 7)
        else:
            state_io[...] = state_buf[...].astype(state_io.dtype)
            copy(state_io, state_hbm.at[slot, h], 7)


def _kernel(*refs, staged: bool, **options):
    """`_gdn_kernel`; `staged`: the scratch has a VMEM buffer in the slots' dtype (bf16 state) for
    the state's DMAs, which cannot convert (the recurrence carries f32 either way)."""
    *head, state_buf, state_io, sems = refs if staged else (*refs[:-1], None, refs[-1])
    return _gdn_kernel(*head, state_buf, state_io, sems, **options)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size"))
def gated_delta_rule_tpu(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, *, interpret=False, chunk_size=64
):
    """Ragged gated delta rule on TPU; shapes as `gdn.gated_delta_rule`.

    cu_q_lens [S+1], state_slot_ids [S], has_initial_state [S] (int32 0/1), num_seqs [1] int32.
    interpret: False, True (plain interpret) or `pltpu.InterpretParams()` (TPU simulator).
    """
    num_tokens, num_key_heads, key_dim = q.shape
    _, num_heads, value_dim = v.shape
    c = chunk_size
    if c % 8:
        raise ValueError(f"chunk_size must be a multiple of 8, got {c}")
    padded_tokens = max(num_tokens, c)  # the remainder window needs C rows to exist
    pad = padded_tokens - num_tokens
    pad_tokens = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
    head_major = lambda x: pad_tokens(x).swapaxes(0, 1)[:, :, None]  # [heads, Tp, 1, ·]
    q_heads, k_heads, v_heads = head_major(q), head_major(k), head_major(v)
    g_heads = head_major(g.astype(F32)[..., None])  # [H, Tp, 1, 1]
    beta_heads = head_major(beta.astype(F32)[..., None])  # [H, Tp, 1, 1]
    o_zeros = jnp.zeros((num_heads, padded_tokens, 1, value_dim), v.dtype)

    any_space = pl.BlockSpec(memory_space=pl.ANY)
    staged = state.dtype != F32  # slots stored narrower than the f32 state the kernel carries
    kernel = functools.partial(
        _kernel, staged=staged, chunk_size=c, heads_per_key_head=num_heads // num_key_heads, padded_tokens=padded_tokens
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(state_slot_ids.shape[0], num_heads),
        in_specs=[any_space] * 7,
        out_specs=[any_space, any_space],
        scratch_shapes=[
            pltpu.VMEM((c, 1, key_dim), q.dtype),
            pltpu.VMEM((c, 1, key_dim), k.dtype),
            pltpu.VMEM((c, 1, value_dim), v.dtype),
            pltpu.VMEM((c, 1, 1), F32),
            pltpu.VMEM((c, 1, 1), F32),
            pltpu.VMEM((c, 1, value_dim), v.dtype),
            pltpu.VMEM((1, 1, value_dim), v.dtype),
            pltpu.VMEM((key_dim, value_dim), F32),
            *([pltpu.VMEM((key_dim, value_dim), state.dtype)] if staged else []),
            pltpu.SemaphoreType.DMA((8,)),
        ],
    )
    o, state = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(o_zeros.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        # operand indices count the 4 scalar-prefetch operands: state is 9, o_zeros is 10
        input_output_aliases={9: 1, 10: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(
        cu_q_lens,
        state_slot_ids,
        has_initial_state,
        num_seqs,
        q_heads,
        k_heads,
        v_heads,
        g_heads,
        beta_heads,
        state,
        o_zeros,
    )
    return o[:, :num_tokens, 0].swapaxes(0, 1), state
