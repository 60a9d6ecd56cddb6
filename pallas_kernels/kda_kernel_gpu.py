"""Kimi delta attention over a ragged batch: Pallas GPU kernel, Triton lowering (spec: `kda.py`).

Grid (sequence slot s, value head h, value block j); one program keeps the state columns
[K, BV] of one head in registers (value columns of the recurrence are independent). It loads
the state from slot `state_slot_ids[s]` (or zeros), runs the WY chunked form over the
sequence's full chunks of C tokens, the per-token recurrence over the last < C tokens (a decode
step is that remainder), and stores the state back. Every load and store stays inside the
sequence's own rows, so padding (and its NaN poison) is never read; outputs of padding tokens
stay zero. Triton needs K, BV, C powers of two and >= 16.

As in the TPU kernel, the [C,C,K] decay tile is never materialised: a loop over the chunk's
rows r builds exp(G_r - G_s) [C,K] for s <= r and reduces it into row r of the score matrices.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kernel_math import F32, dot, dot_tn, unit_lower_inverse


def _row(x, index):
    """Row `index` of x [R,C] as [C] (a masked reduction, no dynamic slicing)."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == index, x, 0.0), axis=0)


def _decayed_scores(q, k, cum_g):
    """Row r of (K K^T) and (Q K^T) weighted per channel by exp(G_r - G_s), s <= r (else 0).

    q, k, cum_g [C,K] -> (kk [C,C], qk [C,C]). Masked before the exp: G_r - G_s > 0 for s > r.
    """
    c = q.shape[0]
    earlier = lax.broadcasted_iota(jnp.int32, (c,), 0)[:, None]  # s, [C,1]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)

    def row(r, scores):
        kk, qk = scores
        at_or_before = earlier <= r
        gamma = jnp.where(at_or_before, jnp.exp(jnp.where(at_or_before, _row(cum_g, r)[None, :] - cum_g, 0.0)), 0.0)
        k_gamma = gamma * k  # [C,K]: exp(G_r - G_s) * k_s
        kk = jnp.where(rows == r, jnp.sum(k_gamma * _row(k, r)[None, :], axis=1)[None, :], kk)
        qk = jnp.where(rows == r, jnp.sum(k_gamma * _row(q, r)[None, :], axis=1)[None, :], qk)
        return kk, qk

    zeros = jnp.zeros((c, c), F32)
    return lax.fori_loop(0, c, row, (zeros, zeros))


def _wy_chunk(state, q, k, v, g, beta):
    """One full chunk. state [K,BV], q/k/g [C,K], v [C,BV], beta [C] (f32) -> (o [C,BV], state)."""
    c = q.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    cum_g = dot(jnp.where(rows >= cols, 1.0, 0.0), g)  # G [C,K]: a prefix sum as a matmul
    kk, qk = _decayed_scores(q, k, cum_g)
    inverse = unit_lower_inverse(jnp.where(rows > cols, beta[:, None] * kk, 0.0))
    decay_in = jnp.exp(cum_g)  # [C,K], <= 1
    w = dot(inverse, beta[:, None] * decay_in * k)  # [C,K]
    u = dot(inverse, beta[:, None] * v) - dot(w, state)  # [C,BV]
    o = dot(q * decay_in, state) + dot(qk, u)
    cum_g_last = _row(cum_g, c - 1)  # G_C [K]
    k_decayed = jnp.exp(cum_g_last[None, :] - cum_g) * k  # [C,K]
    state = jnp.exp(cum_g_last)[:, None] * state + dot_tn(k_decayed, u)
    return o, state


def _kda_kernel(
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
    key_head = lax.div(h, heads_per_key_head)

    length = end - start

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
                g_ref[rows, h, :].astype(F32),
                beta_ref[rows, h].astype(F32),
            )
            o_ref[rows, h, columns] = o.astype(o_ref.dtype)
            return state

        def token(t, state):
            q_t = q_ref[t, key_head, :].astype(F32)  # [K]
            k_t = k_ref[t, key_head, :].astype(F32)  # [K]
            decayed = jnp.exp(g_ref[t, h, :].astype(F32))[:, None] * state  # diag(exp(g)) S
            predicted = jnp.sum(k_t[:, None] * decayed, axis=0)  # [BV]
            update = beta_ref[t, h].astype(F32) * (v_ref[t, h, columns].astype(F32) - predicted)
            state = decayed + k_t[:, None] * update[None, :]
            o_ref[t, h, columns] = jnp.sum(q_t[:, None] * state, axis=0).astype(o_ref.dtype)
            return state

        state = lax.fori_loop(0, num_full, full_chunk, state)
        state_ref[slot, h, :, columns] = lax.fori_loop(start + num_full * c, end, token, state).astype(state_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size", "block_v"))
def kda_gpu(
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
    """Ragged KDA on GPU; shapes as `kda.kda` (g [T,H,K]).

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
        _kda_kernel, chunk_size=chunk_size, heads_per_key_head=num_heads // num_key_heads, block_v=block_v
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
