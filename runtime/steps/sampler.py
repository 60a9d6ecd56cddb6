"""On-device sampling: logit bias -> penalties -> temperature -> top-k / top-p / min-p -> one token per row.

Sort-free. One top-k of `max_top_k` candidates (`lax.top_k`, or on GPU a threshold select, see
`top_k`) is taken and every filter works on those candidates, which arrive best-first:
  * top-k keeps candidate positions `< top_k`;
  * top-p keeps position j while the probability mass *before* j is `< top_p`, with
    probabilities from the full-vocabulary softmax (renormalised over the top-k set when top-k
    is on, as HF and vLLM do), so it is exact whenever the nucleus fits in `max_top_k`;
    otherwise the nucleus is truncated to the `max_top_k` most likely tokens;
  * min-p keeps p_j >= min_p * p_max (a ratio, so normalisation does not matter);
  * a `top_k` above `max_top_k` is clamped to `max_top_k`.
Filters apply in the order top-k, top-p, min-p (HF's warper order; vLLM v1 applies min-p first,
so there top-p renormalises over the min-p survivors).

Rows with temperature > 0 and no filter at all must sample from the whole vocabulary: drawing
them from the top `max_top_k` would silently drop the tail mass (a few percent on flat
distributions). They are sampled exactly over the full vocabulary by a two-level inverse CDF
(`_full_vocab_inverse_cdf`), under a `lax.cond` so a batch with no such row pays nothing
(Gumbel-max over [S, V] noise cost 18 ms at S=16, V=49152 on the 2-core CPU, the inverse CDF
4 ms); `exact_unfiltered=False` trades that exactness for speed by sampling them among the
candidates too.

Greedy rows (temperature 0) take candidate 0 via `where`, so top_k's indices are gathered once
(using them twice made XLA CPU replace TopK by a full sort; see `hlo_has_full_sort`). Each
row's randomness is `fold_in(key(seed), step)`, independent of batch size and order.
Reported logprobs are log_softmax of the raw logits (vLLM's default), before any processing
(logit bias included). `score_tokens` gives prompt logprobs the same way, for the scoring
backbone (runtime/steps/executables.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax import lax

from models.transformer import compute_logits
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.types import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """tokens [S] i32; logprobs [S] f32 of each token under the raw model distribution;
    top_ids [S, n] i32 and top_logprobs [S, n] f32, the n most likely raw tokens, best first."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


jax.tree_util.register_dataclass(
    SamplerOutput,
    data_fields=["tokens", "logprobs", "top_ids", "top_logprobs"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """Prompt scoring of flat token rows: logprobs [T] f32 of each row's target (the next prompt
    token; rows without one hold garbage), its rank [T] i32 (1 = most likely), top_ids [T, n]
    i32 and top_logprobs [T, n] f32."""

    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


jax.tree_util.register_dataclass(
    TokenScores, data_fields=["logprobs", "ranks", "top_ids", "top_logprobs"], meta_fields=[]
)


def score_tokens(logits: jax.Array, targets: jax.Array, num_top: int, top_k_impl: str = "auto") -> TokenScores:
    """log_softmax of logits [T, V] at targets [T] (negative -> row 0, ignored by the caller),
    plus the num_top most likely tokens of each row."""
    raw = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(raw, axis=1, keepdims=True)  # [T, 1]
    picked_raw = jnp.take_along_axis(raw, jnp.maximum(targets, 0)[:, None], axis=1)  # [T, 1]
    ranks = 1 + jnp.sum(raw > picked_raw, axis=1).astype(jnp.int32)  # [T]
    top_raw, top_ids = top_k(raw, min(num_top, raw.shape[1]), top_k_impl)
    return TokenScores(picked_raw[:, 0] - lse[:, 0], ranks, top_ids.astype(jnp.int32), top_raw - lse)


def apply_logit_bias(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """OpenAI logit_bias: add each row's bias values at its ids ([S, B], -1 padded; zero-width
    when no row has a bias, and then free). logits [S, V] f32 -> [S, V]."""
    if not meta.num_logit_bias:
        return logits
    num_rows, vocab = logits.shape
    ids = jnp.where(meta.logit_bias_ids >= 0, meta.logit_bias_ids, vocab)  # vocab -> dropped
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    return logits.at[rows, ids].add(meta.logit_bias_values, mode="drop")


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Repetition (HF: over prompt + output tokens, positive logits divided, others multiplied),
    then frequency and presence (OpenAI: over output tokens). logits [S, V] f32 -> [S, V]."""
    if not meta.has_penalties:
        return logits
    num_rows, vocab = logits.shape
    output_counts = _token_counts(meta.output_ids, num_rows, vocab)  # [S, V]
    prompt_counts = _token_counts(meta.prompt_ids, num_rows, vocab)  # [S, V]
    seen = (output_counts > 0) | (prompt_counts > 0)
    penalty = meta.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - meta.frequency_penalty[:, None] * output_counts
    return logits - meta.presence_penalty[:, None] * (output_counts > 0)


def ban_tokens(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """-inf at each row's banned ids (EOS / stop tokens before `min_tokens`), -1 entries ignored."""
    if not meta.num_banned:
        return logits
    num_rows, vocab = logits.shape
    ids = jnp.where(meta.banned_ids >= 0, meta.banned_ids, vocab)  # vocab -> dropped
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array | None) -> jax.Array:
    """-inf where a row's packed bitmask forbids the token (structured output).

    logits [S, V] f32; bitmask [S, W] i32, W >= ceil(V / 32): bit t % 32 of word t // 32 set when
    token t is allowed (rows without a grammar are all ones). Unpacked here, inside the jitted
    sampler, so only S * W words cross to the device.
    """
    if bitmask is None:
        return logits
    num_rows, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0  # [S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def _token_counts(ids: jax.Array, num_rows: int, vocab: int) -> jax.Array:
    # ids [S, W] i32, -1 padded -> occurrences [S, V] f32; out-of-range ids are dropped.
    counts = jnp.zeros((num_rows, vocab), jnp.float32)
    if ids.shape[1] == 0:
        return counts
    ids = jnp.where((ids < 0) | (ids >= vocab), vocab, ids)
    rows = jnp.arange(num_rows)[:, None]
    return counts.at[rows, ids].add(1.0, mode="drop")


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """One typed PRNG key per row: fold_in(key(seed), step). seeds, steps [S] -> keys [S]."""
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seeds, steps)


def candidate_mask(scaled: jax.Array, full_lse: jax.Array, meta: SamplingMetadata, vocab: int) -> jax.Array:
    """Which of the best-first candidates survive top-k, top-p and min-p.

    scaled [S, K]: temperature-scaled candidate logits, descending; full_lse [S]: logsumexp of
    the scaled logits over the full vocabulary. Returns keep [S, K] bool; position 0 is always
    kept.
    """
    num_cand = scaled.shape[1]
    position = jnp.arange(num_cand)[None, :]
    top_k = meta.top_k[:, None]
    keep = (top_k <= 0) | (position < top_k)
    probs = jnp.exp(scaled - full_lse[:, None])  # [S, K], full-vocabulary softmax
    kept_mass = jnp.sum(jnp.where(keep, probs, 0.0), axis=1, keepdims=True)
    top_k_on = (top_k > 0) & (top_k < vocab)
    probs = jnp.where(top_k_on, probs / kept_mass, probs)
    mass_before = jnp.cumsum(probs, axis=1) - probs
    keep &= mass_before < meta.top_p[:, None]
    keep &= probs >= meta.min_p[:, None] * probs[:, :1]
    return keep.at[:, 0].set(True)


TOP_K_IMPLS = ("auto", "lax", "threshold")


def top_k(x: jax.Array, k: int, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row, best first (ties: lower id first), without a sort
    over the row. x [S, V] f32 -> (values [S, k] f32, ids [S, k] i32).

    impl "lax": `lax.top_k` (XLA's TopK; sort-free on CPU and TPU). "threshold": bisection for
    the k-th largest value, then a sort of only the k selected entries. XLA GPU lowers a TopK
    with k > 16 to a full sort of the row (its TopK specialiser stops at 16), so "auto" picks
    "threshold" on GPU and "lax" elsewhere.
    """
    if impl not in TOP_K_IMPLS:
        raise ValueError(f"impl must be one of {TOP_K_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "threshold" if jax.default_backend() == "gpu" else "lax"
    if impl == "lax":
        values, ids = lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    return _threshold_top_k(x, k)


def _threshold_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    num_rows, vocab = x.shape
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    # Order-preserving map float -> uint32: flip all bits of negatives, set the sign of the rest.
    key = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))  # [S, V]

    def raise_threshold(bit, threshold):  # build the k-th largest key one bit at a time
        candidate = threshold | (jnp.uint32(1) << (31 - bit).astype(jnp.uint32))  # [S]
        count = jnp.sum(key >= candidate[:, None], axis=1)
        return jnp.where(count >= k, candidate, threshold)

    kth = lax.fori_loop(0, 32, raise_threshold, jnp.zeros((num_rows,), jnp.uint32))  # [S]
    above = key > kth[:, None]
    ties = key == kth[:, None]
    ties_needed = k - jnp.sum(above, axis=1, keepdims=True)  # [S, 1]
    chosen = above | (ties & (jnp.cumsum(ties, axis=1) <= ties_needed))  # exactly k per row
    slot = jnp.where(chosen, jnp.cumsum(chosen, axis=1) - 1, k)  # [S, V]; k = dropped
    rows = jnp.arange(num_rows)[:, None]
    vocab_ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (num_rows, vocab))
    ids = jnp.zeros((num_rows, k), jnp.int32).at[rows, slot].set(vocab_ids, mode="drop")
    chosen_keys = jnp.take_along_axis(key, ids, axis=1)  # [S, k]
    _, ids = lax.sort((~chosen_keys, ids), dimension=1, num_keys=2)  # best first, then lower id
    return jnp.take_along_axis(x, ids, axis=1), ids


@functools.partial(
    jax.jit, static_argnames=("max_top_k", "num_logprobs", "exact_unfiltered", "top_k_impl", "all_greedy")
)
def sample(
    logits: jax.Array,
    meta: SamplingMetadata,
    token_bitmask: jax.Array | None = None,
    *,
    max_top_k: int = 256,
    num_logprobs: int = 0,
    exact_unfiltered: bool = True,
    top_k_impl: str = "auto",
    all_greedy: bool = False,
) -> SamplerOutput:
    """Sample one token per row. logits [S, V] (cast to f32); meta holds S rows.

    max_top_k: candidates kept by the single top-k (clamped to V); filters act within them.
    num_logprobs: how many raw top alternatives to report (0 -> zero-width arrays).
    exact_unfiltered: sample rows without any filter over the full vocabulary (see module doc).
    top_k_impl: "auto" | "lax" | "threshold", see `top_k`.
    all_greedy: the caller knows every row has temperature 0: tokens are the argmax of the
    penalized, banned logits (the same token the general path picks as candidate 0), with
    no top-k, filters or noise (vLLM's all-greedy fast path; ~4-5 ms less per step on CPU).
    token_bitmask: None, or [S, ceil(V/32)] i32 allowed tokens per row (`apply_token_bitmask`),
    applied after penalties and bans, before temperature and filters.
    """
    if logits.ndim != 2 or logits.shape[0] != meta.num_rows:
        raise ValueError(f"logits must be [S, V] with S = {meta.num_rows}, got {logits.shape}")
    raw = logits.astype(jnp.float32)  # [S, V]
    num_rows, vocab = raw.shape
    num_cand = min(max_top_k, vocab)

    penalized = apply_token_bitmask(
        ban_tokens(apply_penalties(apply_logit_bias(raw, meta), meta), meta), token_bitmask
    )  # [S, V]
    if all_greedy:
        return _with_logprobs(raw, jnp.argmax(penalized, axis=1).astype(jnp.int32), num_logprobs, top_k_impl)
    greedy = meta.temperature <= 0.0
    inv_temp = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, meta.temperature))[:, None]
    cand_logits, cand_ids = top_k(penalized, num_cand, top_k_impl)  # [S, K], [S, K]
    scaled = cand_logits * inv_temp  # [S, K]
    full_scaled = penalized * inv_temp  # [S, V]
    full_lse = jax.nn.logsumexp(full_scaled, axis=1)  # [S]
    keep = candidate_mask(scaled, full_lse, meta, vocab)  # [S, K]

    keys = row_keys(meta.seeds, meta.steps)  # [S]
    cand_keys, full_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)  # [S] each
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (num_cand,)))(cand_keys)  # [S, K]
    sampled_position = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf), axis=1)
    position = jnp.where(greedy, 0, sampled_position)  # [S]
    tokens = jnp.take_along_axis(cand_ids, position[:, None], axis=1)[:, 0]  # [S]

    if exact_unfiltered and num_cand < vocab:
        unfiltered = (
            ~greedy & ((meta.top_k <= 0) | (meta.top_k >= vocab)) & (meta.top_p >= 1.0) & (meta.min_p <= 0.0)
        )  # [S]
        full_tokens = lax.cond(
            jnp.any(unfiltered),
            _full_vocab_inverse_cdf,
            lambda scaled_logits, _: jnp.zeros((num_rows,), jnp.int32),
            full_scaled,
            full_keys,
        )
        tokens = jnp.where(unfiltered, full_tokens, tokens)
    return _with_logprobs(raw, tokens.astype(jnp.int32), num_logprobs, top_k_impl)


def _with_logprobs(raw: jax.Array, tokens: jax.Array, num_logprobs: int, top_k_impl: str) -> SamplerOutput:
    num_rows, vocab = raw.shape
    raw_lse = jax.nn.logsumexp(raw, axis=1, keepdims=True)  # [S, 1]
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=1)[:, 0] - raw_lse[:, 0]
    if num_logprobs > 0:
        top_raw, top_ids = top_k(raw, min(num_logprobs, vocab), top_k_impl)
        top_logprobs = top_raw - raw_lse
    else:
        top_ids = jnp.zeros((num_rows, 0), jnp.int32)
        top_logprobs = jnp.zeros((num_rows, 0), jnp.float32)
    return SamplerOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


_CDF_BLOCK = 256


def _full_vocab_inverse_cdf(scaled_logits: jax.Array, keys: jax.Array) -> jax.Array:
    """scaled_logits [S, V], keys [S] -> [S] i32: one exact categorical draw per row, by inverse
    CDF in two levels (a block of 256 tokens by its probability mass, then a token within the
    block), so no float32 prefix sum runs longer than max(V / 256, 256) terms. Two uniforms a
    row instead of V Gumbel draws: at S=16, V=49152 on the 2-core CPU 4 ms instead of 18 ms.
    A zero-probability token (a -inf logit) is never drawn."""
    num_rows, vocab = scaled_logits.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    x = jnp.pad(scaled_logits, ((0, 0), (0, num_blocks * _CDF_BLOCK - vocab)), constant_values=-jnp.inf)
    p = jnp.exp(x - jnp.max(x, axis=1, keepdims=True)).reshape(num_rows, num_blocks, _CDF_BLOCK)
    block_mass = jnp.sum(p, axis=2)  # [S, nb]
    block_keys, token_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)

    def draw(keys, weights):  # weights [S, n] >= 0 -> index [S] with probability weight / sum
        cdf = jnp.cumsum(weights, axis=1)
        u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys) * cdf[:, -1]
        return jnp.minimum(jnp.sum(cdf <= u[:, None], axis=1), weights.shape[1] - 1)

    block = draw(block_keys, block_mass)  # [S]
    within = draw(token_keys, jnp.take_along_axis(p, block[:, None, None], axis=1)[:, 0])  # [S]
    return (block * _CDF_BLOCK + within).astype(jnp.int32)


_SHAPE = re.compile(r"\[([0-9,]+)\]")
_SORT_OP = re.compile(r"\bsort\(|custom_call_target=\"[^\"]*[Ss]ort")


def hlo_has_full_sort(hlo_text: str, vocab: int) -> bool:
    """True when any sort instruction (or sort custom call) in the HLO text has an operand or
    result with a dimension of size `vocab`. Pass `jit(f).lower(...).compile().as_text()`."""
    for line in hlo_text.splitlines():
        if not _SORT_OP.search(line):
            continue
        for dims in _SHAPE.findall(line):
            if vocab in (int(d) for d in dims.split(",") if d):
                return True
    return False


SCORE_BLOCK = 256  # token rows whose [rows, vocab] logits the scoring backbone holds at once


def score_hidden_rows(params, hidden, targets, block: int = SCORE_BLOCK, softcap=None):
    """hidden [T, H], targets [T] -> TokenScores [T]: logits `block` rows at a time (lax.map), so
    a large prefill bucket never holds [T, V] floats. `softcap`: as `compute_logits`."""
    T = hidden.shape[0]
    block = min(T, block)
    padded = -(-T // block) * block
    hidden = jnp.pad(hidden, ((0, padded - T), (0, 0))).reshape(padded // block, block, -1)
    targets = jnp.pad(targets, (0, padded - T), constant_values=-1).reshape(padded // block, block)
    scores = lax.map(
        lambda xs: score_tokens(compute_logits(params, xs[0], softcap), xs[1], MAX_LOGPROBS), (hidden, targets)
    )
    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:T], scores)
