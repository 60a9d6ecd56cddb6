"""Kimi Delta Attention (KDA): pure-jnp references and the ragged serving op.

KDA is the gated delta rule with a per-channel decay: the log-decay g_t is a vector over the K
key channels of each head instead of GDN's one scalar (HF transformers' `kimi_linear`,
`recurrent_kimi_delta_attention`). Per token t and value head h, state S in [K, V] layout, fp32:

    S' = diag(exp(g_t)) S,  u_t = beta_t (v_t - S'^T k_t),  S_t = S' + k_t u_t^T,  o_t = S_t^T q_t

Value head h reads key head h // (H // Hk). As in `gdn.py`, q and k come in L2-normalised and q
pre-scaled by K^-1/2 (`kda_normalize_qk`); `kda_gate` is HF's gate, g = -exp(A_log) softplus(f + dt_bias).

- `kda_recurrent_reference`: one sequence, per-token `lax.scan` (the spec).
- `kda_chunked_reference`: one sequence, the WY chunked form with the [C, C, K] decay tile.
- `kda`: the ragged op (shapes as `gdn.gated_delta_rule`, but g [T,H,K]); `impl` names the
  implementation through `KERNELS`.

Chunked form (chunk C, S0 the state entering it, G = per-chunk cumsum of g, [C,K]):
Gamma[r,s,:] = exp(G_r - G_s) for r >= s (masked before the exp, so never exp of a positive
number), A = strict_lower(beta_r sum_c k_rc k_sc Gamma_rsc), T = (I + A)^-1,
W = T diag(beta) (K * e^G), U = T diag(beta) V - W S0, O = (Q * e^G) S0 + lower_incl(QK_Gamma) U,
S_C = diag(e^{G_C}) S0 + (K * e^{G_C - G})^T U.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn import ragged_chunk_layout, ragged_token_layout, unit_lower_inverse
from pallas_kernels.kernel_impls import Kernel, by_backend, ragged_state_args

HIGHEST = lax.Precision.HIGHEST
CPU_CHUNK = 16  # the "chunked" impl's default chunk: the decay tile is [H, C, C, K] per chunk


def kda_normalize_qk(q, k, eps=1e-6):
    """HF's in-kernel l2norm (`x / sqrt(sum x^2 + eps)`, fp32) and q's K^-1/2 scale: raw q, k
    [..., K] -> what `kda` takes."""
    l2 = lambda x: x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    return l2(q) * q.shape[-1] ** -0.5, l2(k)


def kda_gate(gate_logits, a_log, dt_bias):
    """HF's `KimiLinearForgetGate` after its projections: gate_logits [T,H,K] (f_b_proj output),
    a_log [H], dt_bias [H*K] -> g [T,H,K] f32 = -exp(A_log) softplus(logits + dt_bias) (<= 0)."""
    _, h, kd = gate_logits.shape
    x = gate_logits.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(h, kd)
    softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
    return -jnp.exp(a_log.astype(jnp.float32))[:, None] * softplus


def _expand_key_heads(x, num_value_heads):
    """[T, Hk, K] -> [T, H, K], repeat-interleaved: value head h reads key head h // (H // Hk)."""
    return jnp.repeat(x, num_value_heads // x.shape[1], axis=1)


def _check_shapes(q, k, v, g, beta):
    t, hk, kd = q.shape
    h = v.shape[1]
    if k.shape != q.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must match")
    if v.shape[0] != t or g.shape != (t, h, kd) or beta.shape != (t, h):
        raise ValueError(f"bad shapes: v {v.shape}, g {g.shape}, beta {beta.shape} for T={t}, H={h}, K={kd}")
    if h % hk:
        raise ValueError(f"value heads {h} must be a multiple of key heads {hk}")
    return t, hk, h, kd, v.shape[2]


def kda_recurrent_step(state, q_t, k_t, v_t, g_t, beta_t):
    """One token for all heads (the decode step).

    state [H,K,V] f32, q_t/k_t/g_t [H,K] f32, v_t [H,V] f32, beta_t [H] f32 -> (state, o_t [H,V]).
    """
    decayed = jnp.exp(g_t)[:, :, None] * state
    predicted = jnp.einsum("hk,hkv->hv", k_t, decayed, precision=HIGHEST)
    update = beta_t[:, None] * (v_t - predicted)
    state = decayed + k_t[:, :, None] * update[:, None, :]
    o_t = jnp.einsum("hk,hkv->hv", q_t, state, precision=HIGHEST)
    return state, o_t


@jax.jit
def kda_recurrent_reference(q, k, v, g, beta, initial_state):
    """Per-token recurrence over ONE sequence.

    q, k [T,Hk,K] (L2-normalised, q pre-scaled), v [T,H,V], g [T,H,K] (log-decay <= 0),
    beta [T,H], initial_state [H,K,V] f32 -> (o [T,H,V] in v.dtype, final_state [H,K,V] f32).
    """
    _, _, h, _, _ = _check_shapes(q, k, v, g, beta)
    f32 = lambda x: x.astype(jnp.float32)
    xs = (f32(_expand_key_heads(q, h)), f32(_expand_key_heads(k, h)), f32(v), f32(g), f32(beta))

    def step(state, x):
        return kda_recurrent_step(state, *x)

    final_state, o = lax.scan(step, initial_state.astype(jnp.float32), xs)
    return o.astype(v.dtype), final_state


def kda_chunk(state, q, k, v, g, beta):
    """One chunk of the WY form for all heads (rows past a sequence's end are identity steps:
    g = 0, beta = 0, k = 0).

    state [H,K,V], q/k/g [H,C,K], v [H,C,V], beta [H,C] (f32) -> (state [H,K,V], o [H,C,V]).
    """
    c, kd = g.shape[-2:]
    cum_g = jnp.cumsum(g, axis=-2)  # G [H,C,K]
    rows = jnp.arange(c)[:, None]
    cols = jnp.arange(c)[None, :]
    inclusive, strict = rows >= cols, rows > cols
    # The decay tile Gamma [H,C,C,K]; masked before the exp (above the diagonal G_r - G_s > 0).
    diff = cum_g[..., :, None, :] - cum_g[..., None, :, :]
    gamma = jnp.exp(jnp.where(inclusive[..., None], diff, -jnp.inf))
    k_gamma = gamma * k[..., None, :, :]  # [H,C,C,K]: Gamma_rs * k_s
    kk = jnp.einsum("hrk,hrsk->hrs", k, k_gamma, precision=HIGHEST)
    qk = jnp.einsum("hrk,hrsk->hrs", q, k_gamma, precision=HIGHEST)
    a = jnp.where(strict, beta[..., :, None] * kk, 0.0)
    decay_in = jnp.exp(cum_g)  # [H,C,K], <= 1
    rhs = jnp.concatenate([beta[..., None] * decay_in * k, beta[..., None] * v], axis=-1)
    solved = jnp.einsum("hrs,hsd->hrd", unit_lower_inverse(a), rhs, precision=HIGHEST)
    w, u0 = solved[..., :kd], solved[..., kd:]
    u = u0 - jnp.einsum("hck,hkv->hcv", w, state, precision=HIGHEST)
    o = jnp.einsum("hck,hkv->hcv", q * decay_in, state, precision=HIGHEST)
    o = o + jnp.einsum("hrs,hsv->hrv", jnp.where(inclusive, qk, 0.0), u, precision=HIGHEST)
    last = cum_g[..., -1:, :]  # G_C [H,1,K]
    k_decayed = jnp.exp(last - cum_g) * k  # [H,C,K]
    state = jnp.swapaxes(jnp.exp(last), 1, 2) * state
    state = state + jnp.einsum("hck,hcv->hkv", k_decayed, u, precision=HIGHEST)
    return state, o


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def kda_chunked_reference(q, k, v, g, beta, initial_state, chunk_size=64):
    """WY chunked form over ONE sequence; same signature and result as the recurrent reference.
    A ragged last chunk is padded with identity steps."""
    t, _, h, _, vd = _check_shapes(q, k, v, g, beta)
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def to_chunks(x):  # [T,H,...] -> [N,H,C,...] f32, identity-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.swapaxes(x.reshape((n, c) + x.shape[1:]), 1, 2)

    xs = tuple(to_chunks(x) for x in (_expand_key_heads(q, h), _expand_key_heads(k, h), v, g, beta))

    def step(state, x):
        return kda_chunk(state, *x)

    final_state, o = lax.scan(step, initial_state.astype(jnp.float32), xs)
    o = jnp.swapaxes(o, 1, 2).reshape(n * c, h, vd)[:t]
    return o.astype(v.dtype), final_state


def kda_ragged_reference(q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs):
    """Ragged op, pure jnp: one per-token loop over the flat batch's real tokens (the spec).

    The carry holds the current sequence's state: loaded from its slot (or zeros) at the
    sequence's first token, written back at its last. Padding tokens are identity steps and
    write nothing, so NaN poison in padding cannot reach real outputs or slots.
    """
    t, _, h, _, _ = _check_shapes(q, k, v, g, beta)
    seq, is_first, is_last, is_valid = ragged_token_layout(cu_q_lens, num_seqs, t)
    slot = state_slot_ids[seq]

    def clean(x):
        mask = is_valid.reshape((t,) + (1,) * (x.ndim - 1))
        return jnp.where(mask, x.astype(jnp.float32), 0.0)

    tokens = (clean(_expand_key_heads(q, h)), clean(_expand_key_heads(k, h)), clean(v), clean(g), clean(beta))
    xs = tokens + (slot, has_initial_state[seq], is_first, is_last & is_valid)

    def step(i, carry):
        current, pool, o = carry
        q_t, k_t, v_t, g_t, b_t, slot_t, from_slot, first, last = (x[i] for x in xs)
        current = jnp.where(first, jnp.where(from_slot, pool[slot_t].astype(jnp.float32), 0.0), current)
        current, o_t = kda_recurrent_step(current, q_t, k_t, v_t, g_t, b_t)
        pool = pool.at[slot_t].set(jnp.where(last, current.astype(pool.dtype), pool[slot_t]))
        return current, pool, o.at[i].set(o_t)

    num_real = cu_q_lens[jnp.reshape(num_seqs, (-1,))[0]]
    init = (jnp.zeros(state.shape[1:], jnp.float32), state, jnp.zeros(v.shape, jnp.float32))
    _, state, o = lax.fori_loop(0, jnp.clip(num_real, 0, t), step, init)
    return o.astype(v.dtype), state


def kda_ragged_chunked(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, chunk_size=CPU_CHUNK
):
    """Ragged op, pure jnp, WY chunked form: every real sequence is tiled with chunks that never
    span two sequences (`gdn.ragged_chunk_layout`); one loop over the chunk slots in use carries
    the current sequence's state from and back to its slot. The [H,C,C,K] decay tile is built
    per chunk inside the loop, so memory does not grow with the token count."""
    t, _, h, _, vd = _check_shapes(q, k, v, g, beta)
    seq, token, row_valid, is_first, is_last, num_used = ragged_chunk_layout(cu_q_lens, num_seqs, t, chunk_size)
    gather_at = jnp.clip(token, 0, t - 1)

    def to_chunks(x):  # [T,H,...] -> [NC,H,C,...] f32, identity rows where invalid
        rows = x[gather_at].astype(jnp.float32)
        rows = jnp.where(row_valid.reshape(row_valid.shape + (1,) * (x.ndim - 1)), rows, 0.0)
        return jnp.swapaxes(rows, 1, 2)

    chunks = tuple(to_chunks(x) for x in (_expand_key_heads(q, h), _expand_key_heads(k, h), v, g, beta))
    xs = chunks + (state_slot_ids[seq], has_initial_state[seq], is_first, is_last)

    def step(n, carry):
        current, pool, o = carry
        q_n, k_n, v_n, g_n, b_n, slot_n, from_slot_n, first_n, last_n = (x[n] for x in xs)
        current = jnp.where(first_n, jnp.where(from_slot_n, pool[slot_n].astype(jnp.float32), 0.0), current)
        current, o_n = kda_chunk(current, q_n, k_n, v_n, g_n, b_n)
        pool = pool.at[slot_n].set(jnp.where(last_n, current.astype(pool.dtype), pool[slot_n]))
        return current, pool, o.at[n].set(o_n)

    o = jnp.zeros(chunks[2].shape[:3] + (vd,), jnp.float32)  # [NC,H,C,V]
    init = (jnp.zeros(state.shape[1:], jnp.float32), state, o)
    _, state, o = lax.fori_loop(0, num_used, step, init)
    o = jnp.swapaxes(o, 1, 2)  # [NC,C,H,V]
    scatter_at = jnp.where(row_valid, token, t)  # t: dropped
    o = jnp.zeros((t, h, vd), jnp.float32).at[scatter_at].set(o, mode="drop")
    return o.astype(v.dtype), state


def _reference(*args, interpret, chunk_size):
    return kda_ragged_reference(*args)


def _chunked(*args, interpret, chunk_size):
    return kda_ragged_chunked(*args, chunk_size=chunk_size or CPU_CHUNK)


def _pallas_tpu(*args, interpret, chunk_size):
    from pallas_kernels import kda_kernel_tpu

    return kda_kernel_tpu.kda_tpu(*ragged_state_args(args), interpret=interpret, chunk_size=chunk_size or 64)


def _pallas_gpu(*args, interpret, chunk_size):
    from pallas_kernels import kda_kernel_gpu

    return kda_kernel_gpu.kda_gpu(*ragged_state_args(args), interpret=interpret, chunk_size=chunk_size or 64)


_pallas = by_backend(_pallas_tpu, _pallas_gpu)


# The implementations, by `impl` name (pallas_kernels/kernel_impls.py). Not in the launch schema or
# the ops layer (tests/test_kernel_registry.py enumerates those): Kimi Linear's KDA layers take the
# GDN back-end's name where this table has it, else "auto" (models/kda_layer.py's `kda_impl`).
# "auto" on CPU picks the per-token loop: no CPU timing of "chunked" against it exists yet.
KERNELS = {
    "reference": Kernel(_reference, auto=("cpu",)),
    "chunked": Kernel(_chunked),
    "pallas": Kernel(_pallas, per_shard=True, auto=("tpu", "gpu", "interpret")),
    "pallas_tpu": Kernel(_pallas_tpu, per_shard=True),
    "pallas_gpu": Kernel(_pallas_gpu, per_shard=True),
}


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "chunk_size"))
def kda(
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
    impl="reference",
    interpret=False,
    chunk_size=None,
):
    """Kimi delta attention over a ragged batch of sequences, from and back to state slots.

    q, k [T,Hk,K] (L2-normalised, q scaled by K^-1/2: `kda_normalize_qk`), v [T,H,V],
    g [T,H,K] f32 per-channel log-decay (<= 0, `kda_gate`), beta [T,H] f32, state [N,H,K,V] f32
    or bf16 slot pool (cache.state_dtype: every impl computes in f32 and rounds only what it
    stores back), cu_q_lens [S+1] int32, state_slot_ids [S] int32 (slot 0 = null slot),
    has_initial_state [S] bool, num_seqs int32 [] or [1].
    Returns (o [T,H,V] in v.dtype, zero on padding tokens, the state pool).

    impl: "reference" (per-token loop, the spec), "chunked" (jnp WY form, chunk default
    CPU_CHUNK), "pallas" (TPU kernel on TPU and CPU, GPU kernel on GPU), "pallas_tpu",
    "pallas_gpu". interpret: False, True, or `pltpu.InterpretParams()` (TPU kernel only).
    A sequence of one token is a decode step (`kda_recurrent_step`).
    """
    if state.shape[1:] != (v.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"state {state.shape} does not match heads/dims of q {q.shape}, v {v.shape}")
    if impl not in KERNELS:
        raise ValueError(f"unknown impl {impl!r}; known: {tuple(KERNELS)}")
    args = (q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs)
    return KERNELS[impl](*args, interpret=interpret, chunk_size=chunk_size)
