"""Mamba-2 SSD scan over a ragged batch: Pallas GPU kernel, Triton lowering (spec: `ssd.py`).

Grid (sequence slot s, head h, head_dim block j); one program keeps the state rows [BP, N] of
one head in registers (rows of the state are independent). It loads the state from slot
`state_slot_ids[s]` (or zeros), runs the chunked SSD form over the sequence's full chunks of C
tokens, the per-token recurrence over the last < C tokens (a decode step is that remainder), and
stores the state back. Every load and store stays inside the sequence's own rows, so padding
(and its NaN poison) is never read; outputs of padding tokens stay zero. Triton needs N, BP, C
powers of two and >= 16.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kernel_math import F32, add_skip, dot, dot_nt, dot_tn


def _ssd_chunk(state, x, dt, log_decay, b, c):
    """One full chunk. state [BP,N], x [C,BP], dt/log_decay [C], b/c [C,N] (f32)
    -> (y [C,BP] without the D skip, state)."""
    size = x.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    inclusive = rows >= cols
    cum = jnp.sum(jnp.where(inclusive, log_decay[None, :], 0.0), axis=1)  # [C]: within-chunk cumsum
    # L [C,C] = exp(cum_r - cum_s) for s <= r, masked before the exp
    diff = jnp.where(inclusive, cum[:, None] - cum[None, :], 0.0)
    scores = jnp.where(inclusive, jnp.exp(diff), 0.0) * dot_nt(c, b)
    x_dt = x * dt[:, None]
    y = dot(scores, x_dt) + jnp.exp(cum)[:, None] * dot_nt(c, state)
    total = jnp.sum(log_decay)
    state = jnp.exp(total) * state + dot_tn(x_dt * jnp.exp(total - cum)[:, None], b)
    return y, state


def _ssd_kernel(
    cu_ref,
    slot_ref,
    has_init_ref,
    num_seqs_ref,
    x_ref,
    dt_ref,
    log_decay_ref,
    b_ref,
    c_ref,
    state_in_ref,
    y_in_ref,
    y_ref,
    state_ref,
    *,
    chunk_size,
    heads_per_group,
    block_p,
):
    del y_in_ref, state_in_ref  # aliased to y_ref / state_ref
    size = chunk_size
    s, h = pl.program_id(0), pl.program_id(1)
    columns = pl.ds(pl.program_id(2) * block_p, block_p)
    start, end = cu_ref[s], cu_ref[s + 1]
    group = lax.div(h, heads_per_group)
    length = end - start

    @pl.when((s < num_seqs_ref[0]) & (length > 0))
    def _():
        slot = slot_ref[s]
        stored = state_ref[slot, h, columns, :]
        state = jnp.where(has_init_ref[s] != 0, stored, 0.0)  # [BP,N]
        num_full = lax.div(length, size)

        def full_chunk(i, state):
            rows = pl.ds(start + i * size, size)
            y, state = _ssd_chunk(
                state,
                x_ref[rows, h, columns].astype(F32),
                dt_ref[rows, h],
                log_decay_ref[rows, h],
                b_ref[rows, group, :].astype(F32),
                c_ref[rows, group, :].astype(F32),
            )
            y_ref[rows, h, columns] = y
            return state

        def token(t, state):
            x_dt = dt_ref[t, h] * x_ref[t, h, columns].astype(F32)  # [BP]
            b_t = b_ref[t, group, :].astype(F32)  # [N]
            state = jnp.exp(log_decay_ref[t, h]) * state + x_dt[:, None] * b_t[None, :]
            y_ref[t, h, columns] = jnp.sum(state * c_ref[t, group, :].astype(F32)[None, :], axis=1)
            return state

        state = lax.fori_loop(0, num_full, full_chunk, state)
        state_ref[slot, h, columns, :] = lax.fori_loop(start + num_full * size, end, token, state)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size", "block_p"))
def ssd_gpu(
    x,
    dt,
    a,
    b,
    c,
    d,
    state,
    cu_q_lens,
    state_slot_ids,
    has_initial_state,
    num_seqs,
    *,
    interpret=False,
    chunk_size=64,
    block_p=None,
):
    """Ragged SSD scan on GPU; shapes as `ssd.ssd`, dt already processed (`ssd.ssd_dt`).

    block_p: head_dim rows of the state per program (default min(P, 64)); must divide P.
    cu_q_lens [S+1], state_slot_ids [S], has_initial_state [S] (int32 0/1), num_seqs [1] int32.
    """
    num_tokens, num_heads, head_dim = x.shape
    _, num_groups, state_dim = b.shape
    block_p = block_p or min(head_dim, 64)
    if head_dim % block_p:
        raise ValueError(f"block_p={block_p} must divide P={head_dim}")
    for name, size in (("N", state_dim), ("block_p", block_p), ("chunk_size", chunk_size)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 for the Triton kernel")
    kernel = functools.partial(
        _ssd_kernel, chunk_size=chunk_size, heads_per_group=num_heads // num_groups, block_p=block_p
    )
    dt = dt.astype(F32)
    log_decay = dt * a.astype(F32)
    # A chunk's static [C, ...] load must fit the arrays even when the batch is shorter than C
    # (it is never executed then, but it is traced and lowered).
    pad = max(chunk_size - num_tokens, 0)
    pad_tokens = lambda v: jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) if pad else v
    y_zeros = jnp.zeros((num_tokens + pad, num_heads, head_dim), F32)
    # The 4 metadata operands are plain inputs here (no scalar prefetch on GPU).
    y, state = pl.pallas_call(
        kernel,
        grid=(state_slot_ids.shape[0], num_heads, head_dim // block_p),
        out_shape=[jax.ShapeDtypeStruct(y_zeros.shape, F32), jax.ShapeDtypeStruct(state.shape, F32)],
        input_output_aliases={9: 1, 10: 0},
        # Triton compiler params select the Triton lowering (the default GPU one is Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(
        cu_q_lens,
        state_slot_ids,
        has_initial_state,
        num_seqs,
        *map(pad_tokens, (x, dt, log_decay, b, c)),
        state,
        y_zeros,
    )
    return add_skip(y[:num_tokens], x, d, cu_q_lens, num_seqs), state
