"""Mamba-2 SSD (state-space duality) scan: pure-jnp references and the ragged serving op.

The selective scan of HF transformers' `nemotron_h` Mamba-2 mixer (`mamba2_chunk_scan` for
prefill, `mamba2_selective_state_update` for decode). Per token t and head h, with group
g = h // (H // G) (B and C are repeat-interleaved over heads), state S [P, N] in fp32:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D_h x_t

dt is processed inside the op, in HF's order: `clip(softplus(dt_raw + dt_bias), *dt_limit)`
(`ssd_dt`). A [H] is the negative decay rate, HF's `-exp(A_log)`. y includes D x and excludes the
gated RMSNorm (the layer's).

- `ssd_recurrent_step`: one token for all heads (the decode step).
- `ssd_ragged_reference`: the ragged op as one per-token loop (the spec).
- `ssd_ragged_chunked`: the ragged op in the chunked SSD form, chunks never spanning two
  sequences. Per chunk (C rows, S0 the state entering it, a = dt A, Acum its cumsum inside the
  chunk): L[r,s] = exp(Acum_r - Acum_s) for r >= s (masked before the exp, so never exp of a
  positive number), y = (L * C B^T) (dt x) + exp(Acum) * C S0^T,
  S = exp(Acum_last) S0 + ((dt x) * exp(Acum_last - Acum))^T B. Rows past a sequence's end are
  identity steps (dt = 0).
- `ssd`: the ragged op; `impl` names the implementation through `KERNELS`.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn import ragged_chunk_layout, ragged_token_layout
from pallas_kernels.kernel_impls import Kernel, by_backend, ragged_state_args
from pallas_kernels.kernel_math import add_skip

HIGHEST = lax.Precision.HIGHEST
CPU_CHUNK = 16
NO_LIMIT = (0.0, float("inf"))


def ssd_dt(dt, dt_bias, dt_limit=NO_LIMIT):
    """HF's dt processing: raw dt [T,H] + dt_bias [H] -> softplus (torch's: linear above 20) ->
    clamp to dt_limit. f32."""
    x = dt.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
    return jnp.clip(softplus, dt_limit[0], dt_limit[1])


def expand_groups(bc, num_heads):
    """[T, G, N] -> [T, H, N], repeat-interleaved: head h reads group h // (H // G)."""
    return jnp.repeat(bc, num_heads // bc.shape[1], axis=1)


def _check_shapes(x, dt, a, b, c, d, dt_bias):
    t, h, p = x.shape
    g, n = b.shape[1:]
    if dt.shape != (t, h) or a.shape != (h,) or d.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError(
            f"bad shapes: dt {dt.shape}, A {a.shape}, D {d.shape}, dt_bias {dt_bias.shape} for x {x.shape}"
        )
    if b.shape != (t, g, n) or c.shape != b.shape:
        raise ValueError(f"B {b.shape} and C {c.shape} must both be [T, G, N] with T={t}")
    if h % g:
        raise ValueError(f"heads {h} must be a multiple of groups {g}")
    return t, h, p, g, n


def ssd_recurrent_step(state, x_t, dt_t, a, b_t, c_t, d):
    """One token for all heads (dt already processed).

    state [H,P,N] f32, x_t [H,P], dt_t [H], a [H], b_t/c_t [H,N] (groups expanded), d [H]
    -> (state, y_t [H,P]) f32.
    """
    decay = jnp.exp(dt_t * a)[:, None, None]
    state = decay * state + (dt_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]
    y_t = jnp.einsum("hpn,hn->hp", state, c_t, precision=HIGHEST) + d[:, None] * x_t
    return state, y_t


def ssd_chunk(state, x, dt, a, b, c):
    """One chunk of the SSD form for all heads, without the D skip.

    state [H,P,N], x [H,C,P], dt [H,C], a [H] (f32; dt = 0 rows are identity steps), b/c [H,C,N]
    -> (state [H,P,N], y [H,C,P]).
    """
    size = dt.shape[-1]
    log_decay = dt * a[:, None]  # [H,C], <= 0
    cum = jnp.cumsum(log_decay, axis=-1)
    inclusive = jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]
    diff = cum[:, :, None] - cum[:, None, :]
    decay = jnp.exp(jnp.where(inclusive, diff, -jnp.inf))  # L [H,C,C]
    scores = jnp.einsum("hrn,hsn->hrs", c, b, precision=HIGHEST) * decay
    x_dt = x * dt[..., None]
    y = jnp.einsum("hrs,hsp->hrp", scores, x_dt, precision=HIGHEST)
    y = y + jnp.exp(cum)[..., None] * jnp.einsum("hrn,hpn->hrp", c, state, precision=HIGHEST)
    decay_out = jnp.exp(cum[:, -1:] - cum)  # [H,C]
    state = jnp.exp(cum[:, -1])[:, None, None] * state
    state = state + jnp.einsum("hcp,hcn->hpn", x_dt * decay_out[..., None], b, precision=HIGHEST)
    return state, y


def ssd_ragged_reference(x, dt, a, b, c, d, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs):
    """Ragged op, pure jnp, dt processed: one per-token loop over the flat batch's real tokens.

    The carry holds the current sequence's state: loaded from its slot (or zeros) at its first
    token, written back at its last. Padding tokens write nothing, so NaN poison in padding
    cannot reach real outputs or slots.
    """
    t, h = dt.shape
    seq, is_first, is_last, is_valid = ragged_token_layout(cu_q_lens, num_seqs, t)
    slot = state_slot_ids[seq]

    def clean(v):
        return jnp.where(is_valid.reshape((t,) + (1,) * (v.ndim - 1)), v.astype(jnp.float32), 0.0)

    tokens = (clean(x), clean(dt), clean(expand_groups(b, h)), clean(expand_groups(c, h)))
    xs = tokens + (slot, has_initial_state[seq], is_first, is_last & is_valid)
    a, d = a.astype(jnp.float32), d.astype(jnp.float32)

    def step(i, carry):
        current, pool, y = carry
        x_t, dt_t, b_t, c_t, slot_t, from_slot, first, last = (v[i] for v in xs)
        current = jnp.where(first, jnp.where(from_slot, pool[slot_t], 0.0), current)
        current, y_t = ssd_recurrent_step(current, x_t, dt_t, a, b_t, c_t, d)
        pool = pool.at[slot_t].set(jnp.where(last, current, pool[slot_t]))
        return current, pool, y.at[i].set(y_t)

    num_real = cu_q_lens[jnp.reshape(num_seqs, (-1,))[0]]
    init = (jnp.zeros(state.shape[1:], jnp.float32), state, jnp.zeros(x.shape, jnp.float32))
    _, state, y = lax.fori_loop(0, jnp.clip(num_real, 0, t), step, init)
    return y.astype(x.dtype), state


def ssd_ragged_chunked(
    x, dt, a, b, c, d, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, chunk_size=CPU_CHUNK
):
    """Ragged op, pure jnp, dt processed, chunked SSD form: real sequences tiled with chunks that
    never span two sequences (`gdn.ragged_chunk_layout`); one loop over the chunk slots in use
    carries the current sequence's state from and back to its slot."""
    t, h, p = x.shape
    seq, token, row_valid, is_first, is_last, num_used = ragged_chunk_layout(cu_q_lens, num_seqs, t, chunk_size)
    gather_at = jnp.clip(token, 0, t - 1)

    def to_chunks(v):  # [T,H,...] -> [NC,H,C,...] f32, identity (zero) rows where invalid
        rows = v[gather_at].astype(jnp.float32)
        rows = jnp.where(row_valid.reshape(row_valid.shape + (1,) * (v.ndim - 1)), rows, 0.0)
        return jnp.swapaxes(rows, 1, 2)

    chunks = tuple(to_chunks(v) for v in (x, dt, expand_groups(b, h), expand_groups(c, h)))
    xs = chunks + (state_slot_ids[seq], has_initial_state[seq], is_first, is_last)
    a = a.astype(jnp.float32)

    def step(i, carry):
        current, pool, y = carry
        x_n, dt_n, b_n, c_n, slot_n, from_slot_n, first_n, last_n = (v[i] for v in xs)
        current = jnp.where(first_n, jnp.where(from_slot_n, pool[slot_n], 0.0), current)
        current, y_n = ssd_chunk(current, x_n, dt_n, a, b_n, c_n)
        pool = pool.at[slot_n].set(jnp.where(last_n, current, pool[slot_n]))
        return current, pool, y.at[i].set(y_n)

    init = (jnp.zeros(state.shape[1:], jnp.float32), state, jnp.zeros_like(chunks[0]))  # y [NC,H,C,P]
    _, state, y = lax.fori_loop(0, num_used, step, init)
    scatter_at = jnp.where(row_valid, token, t)  # t: dropped
    y = jnp.zeros((t, h, p), jnp.float32).at[scatter_at].set(jnp.swapaxes(y, 1, 2), mode="drop")
    return add_skip(y, x, d, cu_q_lens, num_seqs), state


def _reference(*args, interpret, chunk_size):
    return ssd_ragged_reference(*args)


def _chunked(*args, interpret, chunk_size):
    return ssd_ragged_chunked(*args, chunk_size=chunk_size or CPU_CHUNK)


def _pallas_tpu(*args, interpret, chunk_size):
    from pallas_kernels import ssd_kernel_tpu

    return ssd_kernel_tpu.ssd_tpu(*ragged_state_args(args), interpret=interpret, chunk_size=chunk_size or 64)


def _pallas_gpu(*args, interpret, chunk_size):
    from pallas_kernels import ssd_kernel_gpu

    return ssd_kernel_gpu.ssd_gpu(*ragged_state_args(args), interpret=interpret, chunk_size=chunk_size or 64)


_pallas = by_backend(_pallas_tpu, _pallas_gpu)


# The implementations, by `impl` name (pallas_kernels/kernel_impls.py). Not in the launch schema:
# models/mamba2.py picks one by the GDN back-end's name where this table has it. "auto" on CPU
# picks the per-token loop: no CPU timing of "chunked" against it exists yet.
KERNELS = {
    "reference": Kernel(_reference, auto=("cpu",)),
    "chunked": Kernel(_chunked),
    "pallas": Kernel(_pallas, per_shard=True, auto=("tpu", "gpu", "interpret")),
    "pallas_tpu": Kernel(_pallas_tpu, per_shard=True),
    "pallas_gpu": Kernel(_pallas_gpu, per_shard=True),
}


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "chunk_size", "dt_limit"))
def ssd(
    x,
    dt,
    a,
    b,
    c,
    d,
    dt_bias,
    state,
    cu_q_lens,
    state_slot_ids,
    has_initial_state,
    num_seqs,
    *,
    impl="reference",
    interpret=False,
    chunk_size=None,
    dt_limit=NO_LIMIT,
):
    """The Mamba-2 selective scan over a ragged batch of sequences, from and back to state slots.

    x [T,H,P] (after the conv), dt [T,H] raw (before bias and softplus), a [H] (= -exp(A_log)),
    b, c [T,G,N], d [H], dt_bias [H], state [slots,H,P,N] f32 pool, cu_q_lens [S+1] int32,
    state_slot_ids [S] int32 (slot 0 = null slot), has_initial_state [S] bool,
    num_seqs int32 [] or [1]. dt_limit: static (lo, hi) clamp after the softplus (HF's mixer
    passes (time_step_min, inf) to its prefill scan).
    Returns (y [T,H,P] in x.dtype with D x, zero on padding tokens, the state pool).

    impl: "reference" (per-token loop, the spec), "chunked" (jnp SSD form, chunk default
    CPU_CHUNK), "pallas" (TPU kernel on TPU and CPU, GPU kernel on GPU), "pallas_tpu",
    "pallas_gpu". interpret: False, True, or `pltpu.InterpretParams()` (TPU kernel only).
    A sequence of one token is a decode step (`ssd_recurrent_step`).
    """
    _, h, p, _, n = _check_shapes(x, dt, a, b, c, d, dt_bias)
    if state.shape[1:] != (h, p, n):
        raise ValueError(f"state {state.shape} does not match [slots, H={h}, P={p}, N={n}]")
    if impl not in KERNELS:
        raise ValueError(f"unknown impl {impl!r}; known: {tuple(KERNELS)}")
    args = (x, ssd_dt(dt, dt_bias, dt_limit), a, b, c, d, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs)
    return KERNELS[impl](*args, interpret=interpret, chunk_size=chunk_size)
