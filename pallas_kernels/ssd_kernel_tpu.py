"""Mamba-2 SSD scan over a ragged batch: Mosaic TPU Pallas kernel (spec: `ssd.py`).

Grid (sequence slot s, head h). Per grid step, with cu_q_lens / slot ids / flags in SMEM (scalar
prefetch): load the state [P,N] of slot `state_slot_ids[s]` (or zeros), then run the chunked SSD
form over the sequence in windows of C tokens, and DMA the state back. Token arrays stay in HBM
(tokens a leading untiled dim, so a window may start at any token) and are copied window by
window. The last, partial chunk is a window of C rows that ends inside the arrays; rows outside
the sequence are masked to identity steps (dt = 0, x = B = C = 0) before any arithmetic, so
padding and NaN poison never reach the math, and only the sequence's own rows are written back
(one row DMA each). Padded sequences (s >= num_seqs) and empty ones do nothing.

Every value is 2-D (Mosaic's shapes): the within-chunk cumsum is a masked lane reduction, and
[C,1] columns become [1,C] rows by keeping the diagonal of a broadcast.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kernel_math import F32, add_skip, dot, dot_nt, dot_tn


def _column_to_row(column, eye):
    """[C,1] -> [1,C] without a transpose: keep the diagonal of the broadcast."""
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(column, eye.shape), 0.0), axis=0, keepdims=True)


def _ssd_chunk(state, x, dt, log_decay, b, c):
    """One window, identity rows already masked. state [P,N], x [C,P], dt/log_decay [C,1],
    b/c [C,N] (f32) -> (y [C,P] without the D skip, state)."""
    size = x.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    inclusive, eye = rows >= cols, rows == cols
    cum = jnp.sum(jnp.where(inclusive, _column_to_row(log_decay, eye), 0.0), axis=1, keepdims=True)  # [C,1]
    # L [C,C] = exp(cum_r - cum_s) for s <= r, masked before the exp (else exp of a positive number)
    diff = jnp.where(inclusive, cum - _column_to_row(cum, eye), 0.0)
    scores = jnp.where(inclusive, jnp.exp(diff), 0.0) * dot_nt(c, b)
    x_dt = x * dt
    y = dot(scores, x_dt) + jnp.exp(cum) * dot_nt(c, state)
    total = jnp.sum(log_decay, axis=0, keepdims=True)  # [1,1]: cum at the last real row
    state = jnp.exp(total) * state + dot_tn(x_dt * jnp.exp(total - cum), b)
    return y, state


def _ssd_kernel(
    cu_ref,
    slot_ref,
    has_init_ref,
    num_seqs_ref,  # SMEM
    x_hbm,
    dt_hbm,
    log_decay_hbm,
    b_hbm,
    c_hbm,
    state_in,
    y_in,  # HBM
    y_hbm,
    state_hbm,  # HBM outputs
    x_buf,
    dt_buf,
    log_decay_buf,
    b_buf,
    c_buf,
    y_buf,
    state_buf,
    sems,
    *,
    chunk_size,
    heads_per_group,
    padded_tokens,
):
    del y_in  # aliased to y_hbm; state_in is aliased to state_hbm
    size = chunk_size
    s, h = pl.program_id(0), pl.program_id(1)
    start, end = cu_ref[s], cu_ref[s + 1]
    length = end - start
    group = lax.div(h, heads_per_group)  # not //: floor division lowers via sign

    def copy(src, dst, sem_index):
        dma = pltpu.make_async_copy(src, dst, sems.at[sem_index])
        dma.start()
        dma.wait()

    def matrix(buf, valid):  # [C, 1, D] buffer -> [C, D] f32, zero where not valid
        return jnp.where(valid, buf[...].reshape(size, buf.shape[-1]).astype(F32), 0.0)

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
            first = start + i * size
            count = jnp.minimum(end - first, size)
            window = jnp.minimum(first, padded_tokens - size)  # C rows that exist in the arrays
            offset = first - window
            copy(x_hbm.at[h, pl.ds(window, size)], x_buf, 0)
            copy(dt_hbm.at[h, pl.ds(window, size)], dt_buf, 1)
            copy(log_decay_hbm.at[h, pl.ds(window, size)], log_decay_buf, 2)
            copy(b_hbm.at[group, pl.ds(window, size)], b_buf, 3)
            copy(c_hbm.at[group, pl.ds(window, size)], c_buf, 4)
            row = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
            valid = (row >= offset) & (row < offset + count)
            y, state = _ssd_chunk(
                state_buf[...],
                matrix(x_buf, valid),
                matrix(dt_buf, valid),
                matrix(log_decay_buf, valid),
                matrix(b_buf, valid),
                matrix(c_buf, valid),
            )
            state_buf[...] = state
            y_buf[...] = y.reshape(y_buf.shape)

            @pl.when(count == size)  # a full chunk: offset is 0
            def _():
                copy(y_buf, y_hbm.at[h, pl.ds(first, size)], 6)

            @pl.when(count < size)
            def _():
                def write_row(j, carry):
                    copy(y_buf.at[pl.ds(offset + j, 1)], y_hbm.at[h, pl.ds(first + j, 1)], 6)
                    return carry

                lax.fori_loop(0, count, write_row, 0)

            return carry

        lax.fori_loop(0, lax.div(length + size - 1, size), window_step, 0)
        copy(state_buf, state_hbm.at[slot, h], 7)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size"))
def ssd_tpu(
    x, dt, a, b, c, d, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, *, interpret=False, chunk_size=64
):
    """Ragged SSD scan on TPU; shapes as `ssd.ssd`, dt already processed (`ssd.ssd_dt`).

    cu_q_lens [S+1], state_slot_ids [S], has_initial_state [S] (int32 0/1), num_seqs [1] int32.
    chunk_size: the chunk length C (a multiple of 8).
    interpret: False, True (plain interpret) or `pltpu.InterpretParams()` (TPU simulator).
    """
    num_tokens, num_heads, head_dim = x.shape
    _, num_groups, state_dim = b.shape
    size = chunk_size
    if size % 8:
        raise ValueError(f"chunk_size must be a multiple of 8, got {size}")
    padded_tokens = max(num_tokens, size)  # a window needs C rows to exist
    pad = padded_tokens - num_tokens
    pad_tokens = lambda v: jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) if pad else v
    head_major = lambda v: pad_tokens(v).swapaxes(0, 1)[:, :, None]  # [heads, Tp, 1, ·]
    dt = dt.astype(F32)
    log_decay = dt * a.astype(F32)  # [T,H]
    y_zeros = jnp.zeros((num_heads, padded_tokens, 1, head_dim), F32)

    any_space = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _ssd_kernel, chunk_size=size, heads_per_group=num_heads // num_groups, padded_tokens=padded_tokens
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(state_slot_ids.shape[0], num_heads),
        in_specs=[any_space] * 7,
        out_specs=[any_space, any_space],
        scratch_shapes=[
            pltpu.VMEM((size, 1, head_dim), x.dtype),
            pltpu.VMEM((size, 1, 1), F32),
            pltpu.VMEM((size, 1, 1), F32),
            pltpu.VMEM((size, 1, state_dim), b.dtype),
            pltpu.VMEM((size, 1, state_dim), c.dtype),
            pltpu.VMEM((size, 1, head_dim), F32),
            pltpu.VMEM((head_dim, state_dim), F32),
            pltpu.SemaphoreType.DMA((8,)),
        ],
    )
    y, state = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(y_zeros.shape, F32), jax.ShapeDtypeStruct(state.shape, F32)],
        # operand indices count the 4 scalar-prefetch operands: state is 9, y_zeros is 10
        input_output_aliases={9: 1, 10: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(
        cu_q_lens,
        state_slot_ids,
        has_initial_state,
        num_seqs,
        head_major(x),
        head_major(dt[..., None]),
        head_major(log_decay[..., None]),
        head_major(b),
        head_major(c),
        state,
        y_zeros,
    )
    return add_skip(y[:, :num_tokens, 0].swapaxes(0, 1), x, d, cu_q_lens, num_seqs), state
