"""Kimi delta attention over a ragged batch: Mosaic TPU Pallas kernel (spec: `kda.py`).

Grid (sequence slot s, value head h). Per grid step, with cu_q_lens / slot ids / flags in SMEM
(scalar prefetch): load the state [K,V] of slot `state_slot_ids[s]` (or zeros), walk the
sequence in windows of C tokens (DMA'd from HBM, tokens a leading untiled dim so a window may
start at any token), run the per-token recurrence over each window's tokens, and DMA the state
back. Padded sequences (s >= num_seqs) and empty ones do nothing; tokens outside the sequence
are never read into its math, and outputs of padding tokens stay zero.

This is the recurrent form for every token: the chunked WY form with its [C,C,K] decay tile
(`kda.kda_chunk`) is not in this kernel yet.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32


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
    o_row_buf,
    state_buf,
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
            copy(state_in.at[slot, h], state_buf, 5)

        @pl.when(has_init_ref[s] == 0)
        def _():
            state_buf[...] = jnp.zeros(state_buf.shape, F32)

        def window_step(i, carry):
            first = start + i * c
            # A window of C tokens that starts at `first` or, near the end of the arrays, earlier.
            window = jnp.minimum(first, padded_tokens - c)
            offset = first - window
            copy(q_hbm.at[key_head, pl.ds(window, c)], q_buf, 0)
            copy(k_hbm.at[key_head, pl.ds(window, c)], k_buf, 1)
            copy(v_hbm.at[h, pl.ds(window, c)], v_buf, 2)
            copy(g_hbm.at[h, pl.ds(window, c)], g_buf, 3)
            copy(beta_hbm.at[h, pl.ds(window, c)], beta_buf, 4)
            q_t, k_t, g_t = matrix(q_buf).T, matrix(k_buf).T, matrix(g_buf).T  # [K,C]
            v = matrix(v_buf)  # [C,V]
            # [C,1] -> [1,C] without a transpose: keep the diagonal of the broadcast.
            beta_t = jnp.sum(jnp.where(eye, jnp.broadcast_to(matrix(beta_buf), eye.shape), 0.0), axis=0, keepdims=True)

            def token(j, state):
                o_row, state = _recurrent_token(state, offset + j, q_t, k_t, g_t, v, beta_t)
                o_row_buf[...] = o_row.reshape(o_row_buf.shape).astype(o_row_buf.dtype)
                copy(o_row_buf, o_hbm.at[h, pl.ds(first + j, 1)], 6)
                return state

            state_buf[...] = lax.fori_loop(0, jnp.minimum(c, end - first), token, state_buf[...])
            return carry

        lax.fori_loop(0, lax.div(length + c - 1, c), window_step, 0)
        copy(state_buf, state_hbm.at[slot, h], 7)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size"))
def kda_tpu(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, *, interpret=False, chunk_size=64
):
    """Ragged KDA on TPU; shapes as `kda.kda` (g [T,H,K]).

    cu_q_lens [S+1], state_slot_ids [S], has_initial_state [S] (int32 0/1), num_seqs [1] int32.
    chunk_size: tokens per DMA window (a multiple of 8).
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
    kernel = functools.partial(
        _kda_kernel, chunk_size=c, heads_per_key_head=num_heads // num_key_heads, padded_tokens=padded_tokens
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
            pltpu.VMEM((1, 1, value_dim), v.dtype),
            pltpu.VMEM((key_dim, value_dim), F32),
            pltpu.SemaphoreType.DMA((8,)),
        ],
    )
    o, state = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(o_zeros.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, F32)],
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
