"""Gated DeltaNet (gated delta rule): pure-jnp references and the ragged serving op.

Owns the spec of the GDN recurrence (see /work/shared/GDN.md):

    u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t),  S_t = alpha_t S_{t-1} + k_t u_t^T,  o_t = S_t^T q_t

with alpha_t = exp(g_t), state S in [K, V] layout, fp32. Value head h reads key head h // (H // Hk).

- `gdn_recurrent_reference`: one sequence, per-token `lax.scan` (obviously right).
- `gdn_chunked_reference`: one sequence, the WY chunked form (the algorithm the kernels use).
- `gated_delta_rule`: the ragged op of docs/interfaces.md. `impl="reference"` (per-token loop)
  is the spec; `impl="reference_chunked"` is the same op in the WY chunked form for every row;
  `impl="native"` is the CPU serving path: every row's recurrence in C++ (pallas_kernels/cpu_native.py;
  `gated_delta_rule_native`). `impl="chunked"`, the all-jnp CPU path (and native's fallback): the per-token loop for decode-sized token buckets
  (T < CHUNKED_MIN_TOKENS), else WY chunks of CPU_CHUNK = 16 for the multi-token rows and one
  batched recurrence step for the one-token rows (`gated_delta_rule_mixed`). Measured by
  `benchmarks/gdn_prefill.py` on the 2-core box (H=8, K=V=128; docs/benchmarks.md round 5):
  WY chunks of 16 are 1.2-3.9x faster than the per-token loop from T = 128 on and mostly
  slower below; C = 64 is slower almost everywhere (each sequence's partial chunk is a whole
  64-row pass); mixed vs every row chunked was within the shared machine's noise. `impl="pallas"` dispatches to the Mosaic TPU or
  Triton GPU kernel.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import cpu_native
from pallas_kernels.kernel_impls import Kernel, by_backend, ragged_state_args

HIGHEST = lax.Precision.HIGHEST


def _expand_key_heads(x, num_value_heads):
    """[T, Hk, K] -> [T, H, K], repeat-interleaved: value head h reads key head h // (H // Hk)."""
    return jnp.repeat(x, num_value_heads // x.shape[1], axis=1)


def _check_shapes(q, k, v, g, beta):
    t, hk, kd = q.shape
    h = v.shape[1]
    if k.shape != q.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must match")
    if v.shape[0] != t or g.shape != (t, h) or beta.shape != (t, h):
        raise ValueError(f"bad shapes: v {v.shape}, g {g.shape}, beta {beta.shape} for T={t}, H={h}")
    if h % hk:
        raise ValueError(f"value heads {h} must be a multiple of key heads {hk}")
    return t, hk, h, kd, v.shape[2]


def recurrent_step(state, q_t, k_t, v_t, g_t, beta_t):
    """One token of the gated delta rule for all heads.

    state [H,K,V] f32, q_t/k_t [H,K] f32, v_t [H,V] f32, g_t/beta_t [H] f32 -> (state, o_t [H,V]).
    """
    decayed = jnp.exp(g_t)[:, None, None] * state
    predicted = jnp.einsum("hk,hkv->hv", k_t, decayed, precision=HIGHEST)
    update = beta_t[:, None] * (v_t - predicted)
    state = decayed + k_t[:, :, None] * update[:, None, :]
    o_t = jnp.einsum("hk,hkv->hv", q_t, state, precision=HIGHEST)
    return state, o_t


@jax.jit
def gdn_recurrent_reference(q, k, v, g, beta, initial_state):
    """Per-token recurrence over ONE sequence.

    q, k [T,Hk,K] (L2-normalised, q pre-scaled), v [T,H,V], g (log-decay <= 0), beta [T,H],
    initial_state [H,K,V] f32 -> (o [T,H,V] in v.dtype, final_state [H,K,V] f32).
    """
    _, _, h, _, _ = _check_shapes(q, k, v, g, beta)
    f32 = lambda x: x.astype(jnp.float32)
    xs = (f32(_expand_key_heads(q, h)), f32(_expand_key_heads(k, h)), f32(v), f32(g), f32(beta))

    def step(state, x):
        return recurrent_step(state, *x)

    final_state, o = lax.scan(step, initial_state.astype(jnp.float32), xs)
    return o.astype(v.dtype), final_state


def unit_lower_inverse(a):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by repeated squaring.

    A is nilpotent (A^C = 0), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(2^m)) with
    2^(m+1) >= C: 2 log2(C) batched matmuls instead of a C-step forward substitution. XLA's
    batched triangular solve runs row by row on CPU: with it the ragged chunked op took
    1.39 s for one 256-token sequence (H=8, K=V=128, C=64), with this 0.13 s.
    """
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)
    inverse = eye - a
    power = a
    span = 2
    while span < c:
        power = jnp.einsum("...rs,...st->...rt", power, power, precision=HIGHEST)
        inverse = inverse + jnp.einsum("...rs,...st->...rt", inverse, power, precision=HIGHEST)
        span *= 2
    return inverse


def chunk_preparation(q, k, v, g, beta):
    """State-independent part of the WY chunked form, batched over chunks and heads.

    Inputs [N,H,C,K|V] / [N,H,C] f32, padded with identity steps. Returns
    (decay_in [N,H,C] = e^G, decay_out [N,H,C] = e^{G_C - G}, chunk_decay [N,H] = e^{G_C},
     w [N,H,C,K], u0 [N,H,C,V], qk_decayed [N,H,C,C] = lower_incl(Gamma * Q K^T)).
    """
    c = g.shape[-1]
    cum_g = jnp.cumsum(g, axis=-1)  # G: [N,H,C]
    rows = jnp.arange(c)[:, None]
    cols = jnp.arange(c)[None, :]
    inclusive, strict = rows >= cols, rows > cols
    # Mask before exp: the upper triangle would be exp(positive), which can overflow.
    gamma = jnp.exp(jnp.where(inclusive, cum_g[..., :, None] - cum_g[..., None, :], -jnp.inf))
    kk = jnp.einsum("nhrk,nhsk->nhrs", k, k, precision=HIGHEST)
    a = jnp.where(strict, beta[..., :, None] * gamma * kk, 0.0)
    decay_in = jnp.exp(cum_g)
    rhs = jnp.concatenate([(beta * decay_in)[..., None] * k, beta[..., None] * v], axis=-1)
    solved = jnp.einsum("...rs,...sd->...rd", unit_lower_inverse(a), rhs, precision=HIGHEST)
    w, u0 = solved[..., : k.shape[-1]], solved[..., k.shape[-1] :]
    qk = jnp.einsum("nhrk,nhsk->nhrs", q, k, precision=HIGHEST)
    qk_decayed = jnp.where(inclusive, gamma * qk, 0.0)
    chunk_decay = decay_in[..., -1]
    decay_out = jnp.exp(cum_g[..., -1:] - cum_g)
    return decay_in, decay_out, chunk_decay, w, u0, qk_decayed


def chunk_state_pass(state, q, k, prepared):
    """The sequential part of one chunk: state [H,K,V], q,k [H,C,K] -> (state, o [H,C,V])."""
    decay_in, decay_out, chunk_decay, w, u0, qk_decayed = prepared
    u = u0 - jnp.einsum("hck,hkv->hcv", w, state, precision=HIGHEST)
    o = decay_in[..., None] * jnp.einsum("hck,hkv->hcv", q, state, precision=HIGHEST)
    o = o + jnp.einsum("hrs,hsv->hrv", qk_decayed, u, precision=HIGHEST)
    state = chunk_decay[:, None, None] * state + jnp.einsum(
        "hck,hcv->hkv", decay_out[..., None] * k, u, precision=HIGHEST
    )
    return state, o


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def gdn_chunked_reference(q, k, v, g, beta, initial_state, chunk_size=64):
    """WY chunked form over ONE sequence; same signature and result as the recurrent reference.

    A ragged last chunk is padded with identity steps (g=0, beta=0, k=0), which leave the
    state unchanged.
    """
    t, _, h, _kd, vd = _check_shapes(q, k, v, g, beta)
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def to_chunks(x):  # [T,H,...] -> [N,H,C,...] f32, identity-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape((n, c) + x.shape[1:])
        return jnp.moveaxis(x, 2, 1) if x.ndim == 4 else jnp.swapaxes(x, 1, 2)

    qc, kc = to_chunks(_expand_key_heads(q, h)), to_chunks(_expand_key_heads(k, h))
    vc, gc, bc = to_chunks(v), to_chunks(g), to_chunks(beta)
    prepared = chunk_preparation(qc, kc, vc, gc, bc)

    def step(state, xs):
        q_n, k_n, prep_n = xs
        return chunk_state_pass(state, q_n, k_n, prep_n)

    final_state, o = lax.scan(step, initial_state.astype(jnp.float32), (qc, kc, prepared))
    o = jnp.swapaxes(o, 1, 2).reshape(n * c, h, vd)[:t]
    return o.astype(v.dtype), final_state


def ragged_token_layout(cu_q_lens, num_seqs, num_tokens):
    """Per flat token: (sequence index [T], is_first [T], is_last [T], is_valid [T])."""
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seq_slots = cu_q_lens.shape[0] - 1
    seq = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seq_slots - 1)
    is_valid = tokens < cu_q_lens[num_seqs]
    is_first = tokens == cu_q_lens[seq]
    is_last = tokens == cu_q_lens[seq + 1] - 1
    return seq, is_first, is_last, is_valid


def gated_delta_rule_reference(q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs):
    """Ragged op, pure jnp: one per-token loop over the flat batch's real tokens.

    The carry holds the current sequence's state: it is loaded from its slot (or zeros) at the
    sequence's first token and written back at its last token. Padding tokens are replaced by
    identity steps and write nothing, so NaN poison in padding cannot reach real outputs or slots.
    """
    t, _, h, _, _ = _check_shapes(q, k, v, g, beta)
    seq, is_first, is_last, is_valid = ragged_token_layout(cu_q_lens, num_seqs, t)
    slot = state_slot_ids[seq]
    starts_from_slot = has_initial_state[seq]

    def clean(x):
        mask = is_valid.reshape((t,) + (1,) * (x.ndim - 1))
        return jnp.where(mask, x.astype(jnp.float32), 0.0)

    xs = (
        clean(_expand_key_heads(q, h)),
        clean(_expand_key_heads(k, h)),
        clean(v),
        clean(g),
        clean(beta),
        slot,
        starts_from_slot,
        is_first,
        is_last & is_valid,
    )

    def step(t, carry):
        current, pool, o = carry
        q_t, k_t, v_t, g_t, b_t, slot_t, from_slot, first, last = (x[t] for x in xs)
        loaded = jnp.where(from_slot, pool[slot_t].astype(jnp.float32), 0.0)
        current = jnp.where(first, loaded, current)
        current, o_t = recurrent_step(current, q_t, k_t, v_t, g_t, b_t)
        pool = pool.at[slot_t].set(jnp.where(last, current.astype(pool.dtype), pool[slot_t]))
        return current, pool, o.at[t].set(o_t)

    # The loop runs over the real tokens only (a dynamic bound; padding rows stay zero): a decode
    # step of one sequence in a 16-token bucket costs one iteration, not sixteen.
    num_real = cu_q_lens[jnp.reshape(num_seqs, (-1,))[0]]
    init = (jnp.zeros(state.shape[1:], jnp.float32), state, jnp.zeros(v.shape, jnp.float32))
    _, state, o = lax.fori_loop(0, jnp.clip(num_real, 0, t), step, init)
    return o.astype(v.dtype), state


def ragged_chunk_layout(cu_q_lens, num_seqs, num_tokens, chunk_size, min_len=1):
    """Tiles every real sequence of at least `min_len` tokens with chunks that never span two
    sequences (shorter sequences get no chunk: another path handles them).

    At most T // C + S chunks exist (each sequence adds at most one partial chunk). Returns, per
    chunk slot n: seq [NC], token [NC,C] (flat token of each row), row_valid [NC,C],
    is_first [NC], is_last [NC] (first / last chunk of its sequence; False for unused slots),
    and num_used [] (chunk slots in use: they come first).
    """
    c = chunk_size
    num_seq_slots = cu_q_lens.shape[0] - 1
    num_chunk_slots = num_tokens // c + num_seq_slots
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]
    lengths = cu_q_lens[1:] - cu_q_lens[:-1]
    is_real = (jnp.arange(num_seq_slots) < num_seqs) & (lengths >= min_len)
    chunks_per_seq = jnp.where(is_real, (lengths + c - 1) // c, 0)
    chunk_end = jnp.cumsum(chunks_per_seq)
    chunk_slots = jnp.arange(num_chunk_slots, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(chunk_end, chunk_slots, side="right"), num_seq_slots - 1)
    index_in_seq = chunk_slots - (chunk_end - chunks_per_seq)[seq]
    chunk_used = chunk_slots < chunk_end[-1]
    first_token = cu_q_lens[seq] + index_in_seq * c
    rows_used = jnp.where(chunk_used, jnp.clip(cu_q_lens[seq + 1] - first_token, 0, c), 0)
    token = first_token[:, None] + jnp.arange(c)[None, :]
    row_valid = jnp.arange(c)[None, :] < rows_used[:, None]
    is_first = chunk_used & (index_in_seq == 0)
    is_last = chunk_used & (index_in_seq == chunks_per_seq[seq] - 1)
    return seq, token, row_valid, is_first, is_last, chunk_end[-1]


def gated_delta_rule_chunked_reference(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, chunk_size=64, min_len=1
):
    """Ragged op, pure jnp, WY chunked form over the sequences of at least `min_len` tokens
    (the others are left alone: zero output rows, slots untouched).

    Tokens are gathered into per-sequence chunks (rows past a sequence's end are identity
    steps), the state-independent work runs batched over all chunk slots, and one loop over the
    chunk slots in use (a dynamic bound, like the per-token path's) carries the current
    sequence's state from and back to its slot.
    """
    t, _, h, _, vd = _check_shapes(q, k, v, g, beta)
    seq, token, row_valid, is_first, is_last, num_used = ragged_chunk_layout(
        cu_q_lens, num_seqs, t, chunk_size, min_len
    )
    gather_at = jnp.clip(token, 0, t - 1)

    def to_chunks(x):  # [T,H,...] -> [NC,H,C,...] f32, identity rows where invalid
        rows = x[gather_at].astype(jnp.float32)
        rows = jnp.where(row_valid.reshape(row_valid.shape + (1,) * (x.ndim - 1)), rows, 0.0)
        return jnp.swapaxes(rows, 1, 2)

    qc, kc = to_chunks(_expand_key_heads(q, h)), to_chunks(_expand_key_heads(k, h))
    prepared = chunk_preparation(qc, kc, to_chunks(v), to_chunks(g), to_chunks(beta))

    xs = (qc, kc, prepared, state_slot_ids[seq], has_initial_state[seq], is_first, is_last)

    def step(n, carry):
        current, pool, o = carry
        q_n, k_n, prep_n, slot_n, from_slot_n, first_n, last_n = jax.tree.map(lambda x: x[n], xs)
        current = jnp.where(first_n, jnp.where(from_slot_n, pool[slot_n].astype(jnp.float32), 0.0), current)
        current, o_n = chunk_state_pass(current, q_n, k_n, prep_n)
        pool = pool.at[slot_n].set(jnp.where(last_n, current.astype(pool.dtype), pool[slot_n]))
        return current, pool, o.at[n].set(o_n)

    o = jnp.zeros(qc.shape[:3] + (vd,), jnp.float32)  # [NC,H,C,V]
    init = (jnp.zeros(state.shape[1:], jnp.float32), state, o)
    _, state, o = lax.fori_loop(0, num_used, step, init)
    o = jnp.swapaxes(o, 1, 2)  # [NC,C,H,V]
    scatter_at = jnp.where(row_valid, token, t)  # t: dropped
    o = jnp.zeros((t, h, vd), jnp.float32).at[scatter_at].set(o, mode="drop")
    return o.astype(v.dtype), state


def gated_delta_rule_single_token_rows(q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs):
    """Ragged op for the sequences with exactly one new token (decode rows), batched: one
    recurrence step for all of them at once; other sequences are left alone (zero output rows,
    slots untouched)."""
    t, _, h, _, vd = _check_shapes(q, k, v, g, beta)
    num_seq_slots = cu_q_lens.shape[0] - 1
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]
    lengths = cu_q_lens[1:] - cu_q_lens[:-1]
    is_single = (jnp.arange(num_seq_slots) < num_seqs) & (lengths == 1)  # [S]
    at = jnp.clip(cu_q_lens[:-1], 0, t - 1)  # [S] its token
    rows = lambda x: jnp.where(is_single.reshape((-1,) + (1,) * (x.ndim - 1)), x[at].astype(jnp.float32), 0.0)
    slots = state_slot_ids
    current = jnp.where((is_single & has_initial_state)[:, None, None, None], state[slots].astype(jnp.float32), 0.0)
    new_state, o = jax.vmap(recurrent_step)(
        current, rows(_expand_key_heads(q, h)), rows(_expand_key_heads(k, h)), rows(v), rows(g), rows(beta)
    )
    state = state.at[jnp.where(is_single, slots, state.shape[0])].set(new_state.astype(state.dtype), mode="drop")
    o = jnp.zeros((t, h, vd), jnp.float32).at[jnp.where(is_single, at, t)].set(o, mode="drop")
    return o.astype(v.dtype), state


# The CPU serving path ("chunked"): measured by benchmarks/gdn_prefill.py on the 2-core box
# (docs/benchmarks.md, GDN prefill). Token buckets below CHUNKED_MIN_TOKENS (decode-sized steps)
# keep the per-token loop, which wins there; from it on, sequences with several new tokens run
# the WY form in chunks of CPU_CHUNK and the one-token rows one batched recurrence step.
CHUNKED_MIN_TOKENS = 128
CPU_CHUNK = 16


def gated_delta_rule_mixed(
    q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, chunk_size=CPU_CHUNK
):
    """Ragged op, pure jnp: WY chunked form for the multi-token rows, one batched recurrence
    step for the single-token rows (disjoint rows and slots, so the two compose)."""
    args = (cu_q_lens, state_slot_ids, has_initial_state, num_seqs)
    o_multi, state = gated_delta_rule_chunked_reference(
        q, k, v, g, beta, state, *args, chunk_size=chunk_size, min_len=2
    )
    o_single, state = gated_delta_rule_single_token_rows(q, k, v, g, beta, state, *args)
    return o_multi + o_single, state


def gated_delta_rule_native(q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs):
    """The CPU serving path: every row's per-token recurrence in C++ (`cpu_native.gdn_recurrent`),
    prefill rows included. With the state pool donated (the engine's steps), per GDN layer (H=8,
    Hk=4, K=V=128; `python -m benchmarks.cpu_native`): 16 decode rows 2.0 -> 0.4 ms against the
    jnp per-token loop; a 512-token prefill (4 x 128) 15.6 -> 7.5 ms against the jnp WY chunks
    ("chunked"), which the C++ recurrence also beats."""
    live = jnp.arange(cu_q_lens.shape[0] - 1) < jnp.reshape(num_seqs, (-1,))[0]
    o, state = cpu_native.gdn_recurrent(q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, live)
    return o.astype(v.dtype), state


def _reference(*args, interpret, chunk_size):
    return gated_delta_rule_reference(*args)


def _chunked(*args, interpret, chunk_size):  # a static choice per token bucket
    if args[0].shape[0] < CHUNKED_MIN_TOKENS:
        return gated_delta_rule_reference(*args)
    return gated_delta_rule_mixed(*args, chunk_size=chunk_size or CPU_CHUNK)


def _native(*args, interpret, chunk_size):
    if cpu_native.available() and args[5].dtype == jnp.float32:  # the C++ recurrence keeps f32 slots
        return gated_delta_rule_native(*args)
    return _chunked(*args, interpret=interpret, chunk_size=chunk_size)


def _reference_chunked(*args, interpret, chunk_size):
    return gated_delta_rule_chunked_reference(*args, chunk_size=chunk_size or 64)


def _pallas_tpu(*args, interpret, chunk_size):
    from pallas_kernels import gdn_kernel_tpu

    return gdn_kernel_tpu.gated_delta_rule_tpu(
        *ragged_state_args(args), interpret=interpret, chunk_size=chunk_size or 64
    )


def _pallas_gpu(*args, interpret, chunk_size):
    from pallas_kernels import gdn_kernel_gpu

    return gdn_kernel_gpu.gated_delta_rule_gpu(
        *ragged_state_args(args), interpret=interpret, chunk_size=chunk_size or 64
    )


_pallas = by_backend(_pallas_tpu, _pallas_gpu)


# The implementations, by `impl` name (pallas_kernels/kernel_impls.py); "auto" picks "native" on CPU.
KERNELS = {
    "reference": Kernel(_reference),
    "chunked": Kernel(_chunked),
    "native": Kernel(_native, per_shard=True, auto=("cpu",)),
    "reference_chunked": Kernel(_reference_chunked),
    "pallas": Kernel(_pallas, per_shard=True, auto=("tpu", "gpu", "interpret")),
    "pallas_tpu": Kernel(_pallas_tpu, per_shard=True),
    "pallas_gpu": Kernel(_pallas_gpu, per_shard=True),
}


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "chunk_size"))
def gated_delta_rule(
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
    """Gated delta rule over a ragged batch of sequences, from and back to state slots.

    q, k [T,Hk,K] (L2-normalised, q scaled by K^-1/2), v [T,H,V], g [T,H] f32 log-decay,
    beta [T,H] f32, state [N,H,K,V] f32 or bf16 slot pool (cache.state_dtype: every path computes
    in f32 and rounds only what it stores back), cu_q_lens [S+1] int32, state_slot_ids [S]
    int32 (slot 0 = null slot), has_initial_state [S] bool, num_seqs int32 [] or [1].
    Returns (o [T,H,V] in v.dtype, zero on padding tokens for the reference, state pool).

    impl: "reference" (pure jnp per-token loop, the spec), "chunked" (jnp CPU path: the
    per-token loop below CHUNKED_MIN_TOKENS tokens, else `gated_delta_rule_mixed`), "native" (the
    CPU serving path: every row's recurrence in C++, `gated_delta_rule_native`; "chunked" where the
    native kernels can't be built or the state pool is not f32),
    "reference_chunked" (pure jnp WY form for every row), "pallas" (TPU kernel on TPU and CPU,
    GPU kernel on GPU), "pallas_tpu", "pallas_gpu".
    interpret: False, True, or a `pltpu.InterpretParams()` (TPU kernel only). chunk_size is the
    WY chunk length (all impls but "reference"; default CPU_CHUNK for "chunked", else 64).
    """
    if state.shape[1:] != (v.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"state {state.shape} does not match heads/dims of q {q.shape}, v {v.shape}")
    if impl not in KERNELS:
        raise ValueError(f"unknown impl {impl!r}; known: {tuple(KERNELS)}")
    args = (q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs)
    return KERNELS[impl](*args, interpret=interpret, chunk_size=chunk_size)
