"""Ragged paged attention: one call for a mixed batch of prefill chunks and decode tokens.

Public op `ragged_paged_attention` dispatches by `impl` through `KERNELS` (its one table of
implementations) to the pure-jnp reference (the spec), to a jnp
implementation whose work follows the real context (rpa_chunked.py, the CPU serving path), or
to a Pallas kernel (TPU Mosaic in rpa_kernel_tpu.py, GPU Triton lowering in
rpa_kernel_gpu.py). All share one signature and the semantics below.

Sequence s owns flat query tokens `cu_q_lens[s] : cu_q_lens[s+1]`; its i-th query sits at
position `kv_lens[s] - q_len[s] + i` and attends causally to the keys of its pages
(`block_tables[s]`), optionally only to the last `sliding_window` positions (HF's
`sliding_window_causal`: key k is visible to the query at p iff `p - sliding_window < k <= p`,
so the window counts the query itself), with optional logit soft cap `cap * tanh(scores / cap)`.
Query head h reads kv head `h // (Hq // Hkv)`. With `sinks` ([Hq] f32, gpt-oss), head h's softmax
has one more logit, `sinks[h]` as given (not scaled, not capped), whose probability is dropped:
`o = sum_k exp(s_k) v_k / (exp(sinks[h]) + sum_k exp(s_k))`.
Pages holding no key that some query of the call can see (wholly outside every window) are never
used, and may hold anything (NaN, another sequence's data): a window-aware pager may reuse them.
Tokens at or past `cu_q_lens[num_seqs]` are padding: their output is unspecified.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kernel_impls import Kernel, by_backend
from pallas_kernels.kv_cache import KVPages, dequantize
from pallas_kernels.rpa_common import MASK_VALUE, check_inputs, query_lengths, true_num_seqs


def _sequence_kv(
    pages: jax.Array, scale: jax.Array | None, page_ids: jax.Array, kv_len: jax.Array, load=lambda x: x
) -> jax.Array:
    """Gathers one sequence's K or V, dequantized to f32, zero past kv_len: [Hkv, MB*ps, D]."""
    gathered = load(pages[page_ids])  # [MB, Hkv, ps, D]
    page_scale = None if scale is None else scale[page_ids][:, :, None, None]  # [MB, Hkv, 1, 1]
    values = dequantize(gathered, page_scale)
    num_blocks, num_kv_heads, page_size, head_dim = values.shape
    values = values.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_blocks * page_size, head_dim)
    in_context = jnp.arange(num_blocks * page_size) < kv_len
    # where, not multiply: unused slots and the null page may hold NaN.
    return jnp.where(in_context[None, :, None], values, 0.0)


def _visible(q_pos, key_pos, kv_len, sliding_window):
    """[..., L] mask of the keys a query at q_pos [...] may attend to."""
    visible = (key_pos <= q_pos[..., None]) & (key_pos < kv_len)
    if sliding_window is not None:
        visible &= key_pos > q_pos[..., None] - sliding_window
    return visible


def _softmax_attend(scores, visible, values, subscripts, sm_scale, soft_cap, sinks=None):
    """sinks: None, or the sink logit of each score row, broadcastable to scores[..., :1]."""
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, MASK_VALUE)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # HF gpt-oss: the sink is one more column of the softmax, then dropped
        sink_column = jnp.broadcast_to(sinks, scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum(subscripts, probs, values)


def _seen_by_some_query(values, visible_any, sliding_window):
    """Zeroes keys that no query sees when a window is set: their pages may hold NaN."""
    if sliding_window is None:
        return values
    return jnp.where(visible_any, values, 0.0)


def _decode_batch(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, *, sm_scale, sliding_window, soft_cap):
    """All sequences at once when every one has at most one query (a pure decode step)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs_padded = kv_lens.shape[0]
    group = num_q_heads // kv.num_kv_heads
    token = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)  # [S]
    q_seq = q[token].astype(jnp.float32).reshape(num_seqs_padded, kv.num_kv_heads, group, head_dim)
    gather = jax.vmap(functools.partial(_sequence_kv, load=kv.load), in_axes=(None, None, 0, 0))
    keys = gather(kv.k, kv.k_scale, block_tables, kv_lens)  # [S, Hkv, L, D]
    values = gather(kv.v, kv.v_scale, block_tables, kv_lens)
    key_pos = jnp.arange(keys.shape[2])
    visible = _visible(kv_lens - 1, key_pos, kv_lens[:, None], sliding_window)  # [S, L]
    values = _seen_by_some_query(values, visible[:, None, :, None], sliding_window)
    scores = jnp.einsum("shgd,shld->shgl", q_seq, keys)
    sink = None if sinks is None else sinks.reshape(kv.num_kv_heads, group, 1)
    o_seq = _softmax_attend(scores, visible[:, None, None], values, "shgl,shld->shgd", sm_scale, soft_cap, sink)
    writes = (jnp.arange(num_seqs_padded) < num_seqs) & (cu_q_lens[1:] > cu_q_lens[:-1])
    token = jnp.where(writes, token, num_tokens)  # -> dropped
    out = jnp.zeros_like(q)
    return out.at[token].set(o_seq.reshape(-1, num_q_heads, head_dim).astype(q.dtype), mode="drop")


def _sequence_by_sequence(
    q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, *, sm_scale, sliding_window, soft_cap, block_q
):
    """Loops over the true sequences, and inside each over query blocks of `block_q` tokens
    (1 for a decode sequence), attending to the sequence's gathered pages."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv.num_kv_heads
    group = num_q_heads // num_kv_heads
    # q_blocks: [T + bq, Hkv, G, D]; the tail keeps every block slice in bounds.
    q_blocks = jnp.pad(q, ((0, block_q), (0, 0), (0, 0))).reshape(num_tokens + block_q, num_kv_heads, group, head_dim)
    key_pos = jnp.arange(block_tables.shape[1] * kv.page_size)

    def attend_sequence(s, out):
        kv_len = kv_lens[s]
        seq_start = cu_q_lens[s]
        q_len = cu_q_lens[s + 1] - seq_start
        keys = _sequence_kv(kv.k, kv.k_scale, block_tables[s], kv_len, kv.load)  # [Hkv, L, D]
        values = _sequence_kv(kv.v, kv.v_scale, block_tables[s], kv_len, kv.load)

        def attend_blocks(size, out):
            def attend_block(b, out):
                start = seq_start + b * size
                q_block = lax.dynamic_slice_in_dim(q_blocks, start, size).astype(jnp.float32)
                row_in_seq = b * size + jnp.arange(size)
                visible = _visible(kv_len - q_len + row_in_seq, key_pos, kv_len, sliding_window)
                seen = _seen_by_some_query(values, jnp.any(visible, axis=0)[None, :, None], sliding_window)
                scores = jnp.einsum("qhgd,hld->hgql", q_block, keys)  # [Hkv, G, bq, L]
                sink = None if sinks is None else sinks.reshape(num_kv_heads, group, 1, 1)
                o_block = _softmax_attend(scores, visible, seen, "hgql,hld->qhgd", sm_scale, soft_cap, sink)
                o_block = o_block.astype(out.dtype)
                previous = lax.dynamic_slice_in_dim(out, start, size)
                merged = jnp.where((row_in_seq < q_len)[:, None, None, None], o_block, previous)
                return lax.dynamic_update_slice_in_dim(out, merged, start, axis=0)

            return lax.fori_loop(0, (q_len + size - 1) // size, attend_block, out)

        return lax.cond(q_len <= 1, functools.partial(attend_blocks, 1), functools.partial(attend_blocks, block_q), out)

    out = lax.fori_loop(0, num_seqs, attend_sequence, jnp.zeros_like(q_blocks))
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention_reference(
    q: jax.Array,
    kv: KVPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int = 16,
) -> jax.Array:
    """Pure-jnp reference, jit-able with static shapes; see the module docstring.

    Scores and softmax in f32 over each sequence's gathered, dequantized pages (memory
    ~ MB * ps * Hkv * D per sequence; a pure decode step gathers all S sequences at once).
    Returns [T, Hq, D] in q's dtype.
    """
    num_seqs = true_num_seqs(num_seqs)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    sinks = None if sinks is None else sinks.astype(jnp.float32)
    args = (q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sinks)
    block_q = max(1, min(block_q, q.shape[0]))
    all_decode = jnp.max(query_lengths(cu_q_lens, num_seqs)) <= 1
    return lax.cond(
        all_decode,
        functools.partial(_decode_batch, **options),
        functools.partial(_sequence_by_sequence, **options, block_q=block_q),
        *args,
    )


def _head_major(args: tuple) -> tuple:
    """Token-minor pages (the TPU kernel's layout for head_dim < 128) as [P, Hkv, ps, D] for the
    paths that read that layout (a copy of the pool: these paths never serve token-minor pools)."""
    q, kv, *rest = args
    return (q, kv.with_token_minor(False), *rest)


def _reference(*args, interpret, **options):
    return ragged_paged_attention_reference(*_head_major(args), **options)


def _chunked(*args, interpret, native=False, **options):
    from pallas_kernels.rpa_chunked import ragged_paged_attention_chunked

    return ragged_paged_attention_chunked(*_head_major(args), **options, native=native)


def _pallas_tpu(*args, **options):
    from pallas_kernels.rpa_kernel_tpu import ragged_paged_attention_tpu

    return ragged_paged_attention_tpu(*args, **options)


def _pallas_gpu(*args, **options):
    from pallas_kernels.rpa_kernel_gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*_head_major(args), **options)


_pallas = by_backend(_pallas_tpu, _pallas_gpu, check_interpret=True)


# The implementations, by `impl` name (pallas_kernels/kernel_impls.py). "native" is "auto" on CPU:
# the whole batch in the C++ kernel of cpu_native.py ("chunked" where that can't be built);
# "pallas_tpu" / "pallas_gpu" name a target explicitly (`jaxserve plan` compiles for one from a CPU host).
KERNELS = {
    "reference": Kernel(_reference, kv_bits=True),
    "chunked": Kernel(_chunked, kv_bits=True),
    "native": Kernel(functools.partial(_chunked, native=True), kv_bits=True, per_shard=True, auto=("cpu",)),
    "pallas": Kernel(_pallas, per_shard=True, auto=("tpu", "gpu", "interpret")),
    "pallas_tpu": Kernel(_pallas_tpu, per_shard=True),
    "pallas_gpu": Kernel(_pallas_gpu, per_shard=True),
}


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl", "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    kv: KVPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    impl: str = "reference",
    interpret=False,
) -> jax.Array:
    """Causal attention of a ragged batch over paged KV.

    q:            [T, Hq, D] float32/bfloat16
    kv:           KVPages, pages [P, Hkv, ps, D] (FP8 pages carry [P, Hkv] f32 scales); token-minor
                  pages [P, Hkv, D, ps] are read in place by the TPU kernel, copied for the others
    kv_lens:      [S] int32, context length of each sequence including this step's tokens
    block_tables: [S, MB] int32, logical block -> physical page
    cu_q_lens:    [S+1] int32, sequence s owns tokens cu_q_lens[s]:cu_q_lens[s+1]
    num_seqs:     int32 [] or [1], the true number of sequences
    sliding_window: keys with `p - sliding_window < k <= p` only (HF's convention), or None
    soft_cap:     logits become `soft_cap * tanh(logits / soft_cap)` (Gemma 2), or None
    sinks:        [Hq] float32, one extra softmax logit per query head, dropped (gpt-oss), or None
    impl:         a name of `KERNELS`: "reference" (the spec) | "chunked" (jnp, work proportional
                  to the real context) | "native" (the CPU serving path: the whole batch in the
                  C++ kernel of pallas_kernels/cpu_native.py; "chunked" where that can't be built) |
                  "pallas" (kernel for the default backend; on CPU with
                  `interpret` the TPU kernel) | "pallas_tpu" | "pallas_gpu"
    interpret:    passed to pallas_call: False, True, or a `pltpu.InterpretParams()`
    Returns [T, Hq, D] in q's dtype; rows of padding tokens are unspecified.
    """
    check_inputs(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs)
    if impl not in KERNELS:
        raise ValueError(f"impl must be one of {tuple(KERNELS)}, got {impl!r}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}], got {sinks.shape}")
    if kv.view is not None and not KERNELS[impl].kv_bits:
        raise ValueError(
            f"KV pages in bit storage (KVPages.view set) are for {[n for n, k in KERNELS.items() if k.kv_bits]}; "
            f"impl {impl!r} takes float pages"
        )
    args = (
        q,
        kv,
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        true_num_seqs(num_seqs),
    )
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    if sinks is not None:  # not passed at all otherwise: the default calls stay as they were
        options["sinks"] = sinks.astype(jnp.float32)
    return KERNELS[impl](*args, **options)
