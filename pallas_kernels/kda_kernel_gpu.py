"""Kimi delta attention over a ragged batch: Pallas GPU kernel, Triton lowering (spec: `kda.py`).

Grid (sequence slot s, value head h, value block j); one program keeps the state columns
[K, BV] of one head in registers (value columns of the recurrence are independent). It loads
the state from slot `state_slot_ids[s]` (or zeros), runs the per-token recurrence over the
sequence's tokens, and stores the state back. Every load and store stays inside the sequence's
own rows, so padding (and its NaN poison) is never read; outputs of padding tokens stay zero.
Triton needs K and BV powers of two and >= 16.

This is the recurrent form for every token: the chunked WY form with its [C,C,K] decay tile
(`kda.kda_chunk`) is not in this kernel yet.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


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
    heads_per_key_head,
    block_v,
):
    del o_in_ref, state_in_ref  # aliased to o_ref / state_ref
    s, h = pl.program_id(0), pl.program_id(1)
    columns = pl.ds(pl.program_id(2) * block_v, block_v)
    start, end = cu_ref[s], cu_ref[s + 1]
    key_head = lax.div(h, heads_per_key_head)

    @pl.when((s < num_seqs_ref[0]) & (end > start))
    def _():
        slot = slot_ref[s]
        stored = state_ref[slot, h, :, columns]
        state = jnp.where(has_init_ref[s] != 0, stored, 0.0)  # [K,BV]

        def token(t, state):
            q_t = q_ref[t, key_head, :].astype(F32)  # [K]
            k_t = k_ref[t, key_head, :].astype(F32)  # [K]
            decayed = jnp.exp(g_ref[t, h, :].astype(F32))[:, None] * state  # diag(exp(g)) S
            predicted = jnp.sum(k_t[:, None] * decayed, axis=0)  # [BV]
            update = beta_ref[t, h].astype(F32) * (v_ref[t, h, columns].astype(F32) - predicted)
            state = decayed + k_t[:, None] * update[None, :]
            o_ref[t, h, columns] = jnp.sum(q_t[:, None] * state, axis=0).astype(o_ref.dtype)
            return state

        state_ref[slot, h, :, columns] = lax.fori_loop(start, end, token, state)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v"))
def kda_gpu(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, *, interpret=False, block_v=None
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
    for name, size in (("K", key_dim), ("block_v", block_v)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 for the Triton kernel")
    kernel = functools.partial(_kda_kernel, heads_per_key_head=num_heads // num_key_heads, block_v=block_v)
    o_zeros = jnp.zeros((num_tokens, num_heads, value_dim), v.dtype)
    # The 4 metadata operands are plain inputs here (no scalar prefetch on GPU).
    return pl.pallas_call(
        kernel,
        grid=(state_slot_ids.shape[0], num_heads, value_dim // block_v),
        out_shape=[jax.ShapeDtypeStruct(o_zeros.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, F32)],
        input_output_aliases={9: 1, 10: 0},
        # Triton compiler params select the Triton lowering (the default GPU one is Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(cu_q_lens, state_slot_ids, has_initial_state, num_seqs, q, k, v, g.astype(F32), beta.astype(F32), state, o_zeros)
