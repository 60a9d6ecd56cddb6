"""Gated delta rule over a ragged batch: Pallas GPU kernel, Triton lowering (spec: `gdn.py`).

Grid (sequence slot s, value head h, value block j); one program keeps the state columns
[K, BV] of one head in registers (value columns of the recurrence are independent). It loads the state from slot `state_slot_ids[s]` (or zeros), runs the WY chunked
form over the sequence's full chunks of C tokens, the per-token recurrence over the last
< C tokens (a decode step is that remainder), and stores the state back. Every load and
store stays inside the sequence's own rows, so padding (and its NaN poison) is never read;
outputs of padding tokens stay zero. Triton needs K, V, C powers of two and >= 16.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kernel_math import F32
from pallas_kernels.kernel_math import dot as _dot
from pallas_kernels.kernel_math import dot_nt as _dot_nt
from pallas_kernels.kernel_math import dot_tn as _dot_tn


def _unit_lower_inverse(a):
    """(I + A)^-1 for strictly lower-triangular A [C,C], by forward substitution over rows."""
    c = a.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(F32)

    def substitute_row(i, inverse):
        a_row = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C]
        e_row = jnp.sum(jnp.where(rows == i, eye, 0.0), axis=0)  # [C]
        new_row = e_row - jnp.sum(a_row[:, None] * inverse, axis=0)  # rows >= i meet 0
        return jnp.where(rows == i, new_row[None, :], inverse)

    return lax.fori_loop(1, c, substitute_row, eye)


def _wy_chunk(state, q, k, v, g, beta):
    """One full chunk. state [K,V], q/k [C,K], v [C,V], g/beta [C] (f32) -> (o [C,V], state)."""
    c = q.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    inclusive, strict = rows >= cols, rows > cols
    cum_g = jnp.cumsum(g)  # G [C]
    last = lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1
    cum_g_last = jnp.sum(jnp.where(last, cum_g, 0.0))  # G_C
    # Mask before exp: above the diagonal G_r - G_s > 0 and could overflow.
    gamma = jnp.where(inclusive, jnp.exp(jnp.where(inclusive, cum_g[:, None] - cum_g[None, :], 0.0)), 0.0)
    a = jnp.where(strict, beta[:, None] * gamma * _dot_nt(k, k), 0.0)
    inverse = _unit_lower_inverse(a)
    decay_in = jnp.exp(cum_g)[:, None]  # [C,1]
    w = _dot(inverse, (beta * jnp.exp(cum_g))[:, None] * k)  # [C,K]
    u = _dot(inverse, beta[:, None] * v) - _dot(w, state)  # [C,V]
    o = decay_in * _dot(q, state) + _dot(jnp.where(inclusive, gamma * _dot_nt(q, k), 0.0), u)
    k_decayed = jnp.exp(cum_g_last - cum_g)[:, None] * k  # [C,K]
    state = jnp.exp(cum_g_last) * state + _dot_tn(k_decayed, u)
    return o, state


def _gdn_kernel(
    cu_ref,
    slot_ref,
    has_init_ref,
    num_seqs_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    state_in_ref,
    o_in_ref,
    o_ref,
    state_ref,
    *,
    chunk_size,
    heads_per_key_head,
    block_v,
):
    del o_in_ref, state_in_ref  # aliased to o_ref / state_ref
    c = chunk_size
    s, h = pl.program_id(0), pl.program_id(1)
    columns = pl.ds(pl.program_id(2) * block_v, block_v)
    start, end = cu_ref[s], cu_ref[s + 1]
    length = end - start
    key_head = lax.div(h, heads_per_key_head)

    @pl.when((s < num_seqs_ref[0]) & (length > 0))
    def _():
        slot = slot_ref[s]
        stored = state_ref[slot, h, :, columns].astype(F32)  # f32 or bf16 slots; the recurrence is f32
        state = jnp.where(has_init_ref[s] != 0, stored, 0.0)  # [K,BV]
        num_full = lax.div(length, c)

        def full_chunk(i, state):
            rows = pl.ds(start + i * c, c)
            o, state = _wy_chunk(
                state,
                q_ref[rows, key_head, :].astype(F32),
                k_ref[rows, key_head, :].astype(F32),
                v_ref[rows, h, columns].astype(F32),
                g_ref[rows, h].astype(F32),
                beta_ref[rows, h].astype(F32),
            )
            o_ref[rows, h, columns] = o.astype(o_ref.dtype)
            return state

        def token(t, state):
            q_t = q_ref[t, key_head, :].astype(F32)  # [K]
            k_t = k_ref[t, key_head, :].astype(F32)  # [K]
            decayed = jnp.exp(g_ref[t, h].astype(F32)) * state
            predicted = jnp.sum(k_t[:, None] * decayed, axis=0)  # [BV]
            update = beta_ref[t, h].astype(F32) * (v_ref[t, h, columns].astype(F32) - predicted)
            state = decayed + k_t[:, None] * update[None, :]
            o_ref[t, h, columns] = jnp.sum(q_t[:, None] * state, axis=0).astype(o_ref.dtype)
            return state

        state = lax.fori_loop(0, num_full, full_chunk, state)
        state = lax.fori_loop(start + num_full * c, end, token, state)
        state_ref[slot, h, :, columns] = state.astype(state_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size", "block_v"))
def gated_delta_rule_gpu(
    q,
    k,
    v,
    g,
    beta,
    state,
    cu_q_lens,
    state_slot_ids,
    has_initial_state,
    num_seqs,
    *,
    interpret=False,
    chunk_size=64,
    block_v=None,
):
    """Ragged gated delta rule on GPU; shapes as `gdn.gated_delta_rule`.

    block_v: value columns per program (default min(V, 64)); must divide V.

    cu_q_lens [S+1], state_slot_ids [S], has_initial_state [S] (int32 0/1), num_seqs [1] int32.
    """
    _, num_key_heads, key_dim = q.shape
    num_tokens, num_heads, value_dim = v.shape
    block_v = block_v or min(value_dim, 64)
    if value_dim % block_v:
        raise ValueError(f"block_v={block_v} must divide V={value_dim}")
    for name, size in (("K", key_dim), ("block_v", block_v), ("chunk_size", chunk_size)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 for the Triton kernel")
    kernel = functools.partial(
        _gdn_kernel, chunk_size=chunk_size, heads_per_key_head=num_heads // num_key_heads, block_v=block_v
    )
    o_zeros = jnp.zeros((num_tokens, num_heads, value_dim), v.dtype)
    # The 4 metadata operands are plain inputs here (no scalar prefetch on GPU).
    return pl.pallas_call(
        kernel,
        grid=(state_slot_ids.shape[0], num_heads, value_dim // block_v),
        out_shape=[jax.ShapeDtypeStruct(o_zeros.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={9: 1, 10: 0},
        # Triton compiler params select the Triton lowering (the default GPU one is Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(cu_q_lens, state_slot_ids, has_initial_state, num_seqs, q, k, v, g.astype(F32), beta.astype(F32), state, o_zeros)
