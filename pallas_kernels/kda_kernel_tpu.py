"""Kimi delta attention over a ragged batch: Mosaic TPU Pallas kernel (spec: `kda.py`).

Grid (sequence slot s, value head h). Per grid step, with cu_q_lens / slot ids / flags in SMEM
(scalar prefetch): load the state [K,V] of slot `state_slot_ids[s]` (or zeros), run the WY
chunked form over the sequence's full chunks of C tokens, then the per-token recurrence over
the remaining < C tokens (a decode step is that remainder), and DMA the state back. Token
arrays stay in HBM and are copied chunk by chunk (tokens a leading untiled dim, so a chunk may
start at any token). Padded sequences (s >= num_seqs) and empty ones do nothing; tokens outside
the sequence are never read into its math, and outputs of padding tokens stay zero.

The [C,C,K] decay tile of the chunked form (`kda.kda_chunk`) is never materialised: one loop
over the chunk's rows r builds exp(G_r - G_s) [C,K] for s <= r and reduces it into row r of
the two [C,C] score matrices, so every value is 2-D (Mosaic's shapes) and VMEM stays O(C K).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kernel_math import F32, dot, unit_lower_inverse


def _lane(x, index):
    """Column `index` of x [R,C] as [R,1] (a masked lane reduction, no dynamic lane slicing)."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(lane == index, x, 0.0), axis=1, keepdims=True)


def _sublane(x, index):
    """Row `index` of x [R,C] as [1,C]."""
    sublane = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(sublane == index, x, 0.0), axis=0, keepdims=True)


def _recurrent_token(state, row, q_t, k_t, g_t, v, beta_t):
    """Token `row` of the window. state [K,V]; q_t/k_t/g_t [K,C] (transposed), v [C,V],
    beta_t [1,C] -> (o [1,V], state)."""
    decayed = jnp.exp(_lane(g_t, row)) * state  # diag(exp(g)) S
    k_col = _lane(k_t, row)  # [K,1]
    predicted = jnp.sum(k_col * decayed, axis=0, keepdims=True)  # S'^T k: [1,V]
    update = _lane(beta_t, row) * (_sublane(v, row) - predicted)  # [1,V]
    state = decayed + k_col * update
    return jnp.sum(_lane(q_t, row) * state, axis=0, keepdims=True), state


def _decayed_scores(q, k, cum_g):
    """Row r of (K K^T) and (Q K^T) weighted per channel by exp(G_r - G_s), s <= r (else 0).

    q, k, cum_g [C,K] -> (kk [C,C], qk [C,C]). Masked before the exp: G_r - G_s > 0 for s > r.
    """
    c = q.shape[0]
    earlier = lax.broadcasted_iota(jnp.int32, (c, 1), 0)  # s, as a column
    lane = lax.broadcasted_iota(jnp.int32, (c, c), 1)

    def row(r, scores):
        kk_t, qk_t = scores  # transposed: column r holds row r
        at_or_before = earlier <= r
        gamma = jnp.where(at_or_before, jnp.exp(jnp.where(at_or_before, _sublane(cum_g, r) - cum_g, 0.0)), 0.0)
        k_gamma = gamma * k  # [C,K]: exp(G_r - G_s) * k_s
        kk_t = jnp.where(lane == r, jnp.sum(k_gamma * _sublane(k, r), axis=1, keepdims=True), kk_t)
        qk_t = jnp.where(lane == r, jnp.sum(k_gamma * _sublane(q, r), axis=1, keepdims=True), qk_t)
        return kk_t, qk_t

    zeros = jnp.zeros((c, c), F32)
    kk_t, qk_t = lax.fori_loop(0, c, row, (zeros, zeros))
    return kk_t.T, qk_t.T


def _wy_chunk(state, q, k, v, g, beta_col):
    """One full chunk. state [K,V], q/k/g [C,K], v [C,V], beta_col [C,1] (f32) -> (o [C,V], state)."""
    c = q.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    cum_g = dot(jnp.where(rows >= cols, 1.0, 0.0), g)  # G [C,K]: a prefix sum on the MXU
    kk, qk = _decayed_scores(q, k, cum_g)
    inverse = unit_lower_inverse(jnp.where(rows > cols, beta_col * kk, 0.0))
    decay_in = jnp.exp(cum_g)  # [C,K], <= 1
    w = dot(inverse, beta_col * decay_in * k)  # [C,K]
    u = dot(inverse, beta_col * v) - dot(w, state)  # [C,V]
    o = dot(q * decay_in, state) + dot(qk, u)
    cum_g_last = _sublane(cum_g, c - 1)  # G_C [1,K]
    k_decayed = jnp.exp(cum_g_last - cum_g) * k  # [C,K]
    state = jnp.exp(_lane(cum_g.T, c - 1)) * state + dot(k_decayed.T, u)  # diag(e^{G_C}) S0 + ...
    return o, state


def _kda_kernel(
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

    def matrix(buf):  # [C, 1, D] buffer -> [C, D] f32
        return buf[...].reshape(c, buf.shape[-1]).astype(F32)

    eye = lax.broadcasted_iota(jnp.int32, (c, c), 0) == lax.broadcasted_iota(jnp.int32, (c, c), 1)

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

        def load_chunk(first_token):
            copy(q_hbm.at[key_head, pl.ds(first_token, c)], q_buf, 0)
            copy(k_hbm.at[key_head, pl.ds(first_token, c)], k_buf, 1)
            copy(v_hbm.at[h, pl.ds(first_token, c)], v_buf, 2)
            copy(g_hbm.at[h, pl.ds(first_token, c)], g_buf, 3)
            copy(beta_hbm.at[h, pl.ds(first_token, c)], beta_buf, 4)

        num_full = lax.div(length, c)

        def full_chunk(i, carry):
            first = start + i * c
            load_chunk(first)
            o, state = _wy_chunk(
                state_buf[...], matrix(q_buf), matrix(k_buf), matrix(v_buf), matrix(g_buf), matrix(beta_buf)
            )
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
            q_t, k_t, g_t = matrix(q_buf).T, matrix(k_buf).T, matrix(g_buf).T  # [K,C]
            v = matrix(v_buf)  # [C,V]
            # [C,1] -> [1,C] without a transpose: keep the diagonal of the broadcast.
            beta_t = jnp.sum(jnp.where(eye, jnp.broadcast_to(matrix(beta_buf), eye.shape), 0.0), axis=0, keepdims=True)

            def token(j, state):
                o_row, state = _recurrent_token(state, offset + j, q_t, k_t, g_t, v, beta_t)
                o_row_buf[...] = o_row.reshape(o_row_buf.shape).astype(o_row_buf.dtype)
                copy(o_row_buf, o_hbm.at[h, pl.ds(first + j, 1)], 6)
                return state

            state_buf[...] = lax.fori_loop(0, remainder, token, state_buf[...])

        if state_io is None:
            copy(state_buf, state_hbm.at[slot, h], 7)
        else:
            state_io[...] = state_buf[...].astype(state_io.dtype)
            copy(state_io, state_hbm.at[slot, h], 7)


def _kernel(*refs, staged: bool, **options):
    """`_kda_kernel`; `staged`: the scratch has a VMEM buffer in the slots' dtype (bf16 state) for
    the state's DMAs, which cannot convert (the recurrence carries f32 either way)."""
    *head, state_buf, state_io, sems = refs if staged else (*refs[:-1], None, refs[-1])
    return _kda_kernel(*head, state_buf, state_io, sems, **options)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size"))
def kda_tpu(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, *, interpret=False, chunk_size=64
):
    """Ragged KDA on TPU; shapes as `kda.kda` (g [T,H,K]).

    cu_q_lens [S+1], state_slot_ids [S], has_initial_state [S] (int32 0/1), num_seqs [1] int32.
    chunk_size: the WY chunk length C (a multiple of 8).
    interpret: False, True (plain interpret) or `pltpu.InterpretParams()` (TPU simulator).
    """
    num_tokens, num_key_heads, key_dim = q.shape
    _, num_heads, value_dim = v.shape
    c = chunk_size
    if c % 8:
        raise ValueError(f"chunk_size must be a multiple of 8, got {c}")
    padded_tokens = max(num_tokens, c)  # a window needs C rows to exist
    pad = padded_tokens - num_tokens
    pad_tokens = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
    head_major = lambda x: pad_tokens(x).swapaxes(0, 1)[:, :, None]  # [heads, Tp, 1, ·]
    q_heads, k_heads, v_heads = head_major(q), head_major(k), head_major(v)
    g_heads = head_major(g.astype(F32))  # [H, Tp, 1, K]
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
            pltpu.VMEM((c, 1, key_dim), F32),
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
