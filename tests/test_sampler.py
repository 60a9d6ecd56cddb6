"""Sampler tests: every expectation comes from numpy / HF transformers, never from our code."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from runtime.steps.sampler import apply_penalties, hlo_has_full_sort, sample, top_k
from runtime.steps.sampling_metadata import SamplingMetadata, pow2_bucket
from runtime.types import SamplingParams


def build(params, pad_to, steps=None, output_ids=None, prompt_ids=None, seed=0):
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        steps if steps is not None else [0] * n,
        output_ids if output_ids is not None else [[] for _ in range(n)],
        prompt_ids if prompt_ids is not None else [[] for _ in range(n)],
        pad_to,
        rng=np.random.default_rng(seed),
    )


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- builder


def test_builder_pads_greedy_and_buckets_penalty_widths():
    params = [
        SamplingParams(temperature=0.8, seed=2**32 + 5),
        SamplingParams(temperature=1.0),
        SamplingParams(repetition_penalty=1.3, seed=1),
    ]
    meta = build(
        params,
        pad_to=8,
        steps=[3, 0, 7],
        output_ids=[[1, 2], [9] * 40, list(range(17))],
        prompt_ids=[[4] * 100, [5], [6] * 33],
    )
    assert meta.temperature.shape == (8,)
    np.testing.assert_array_equal(meta.temperature[3:], 0.0)  # padded rows are greedy
    np.testing.assert_array_equal(meta.repetition_penalty[3:], 1.0)
    np.testing.assert_array_equal(meta.steps, [3, 0, 7, 0, 0, 0, 0, 0])
    assert meta.seeds.dtype == np.uint32 and meta.seeds[0] == 5 and meta.seeds[2] == 1
    # Only row 2 uses a penalty: widths are sized by its ids (17 -> 32, 33 -> 64), not row 0/1's.
    assert meta.output_ids.shape == (8, 32) and meta.prompt_ids.shape == (8, 64)
    np.testing.assert_array_equal(meta.output_ids[2, :17], np.arange(17))
    assert (meta.output_ids[2, 17:] == -1).all() and (meta.output_ids[[0, 1, 3]] == -1).all()
    assert pow2_bucket(0) == 0 and pow2_bucket(1) == 16 and pow2_bucket(16) == 16 and pow2_bucket(17) == 32


def test_builder_without_penalties_is_zero_width_and_fresh_seeds_differ():
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    a = build(params, pad_to=4, output_ids=[[1, 2, 3], [4]], prompt_ids=[[5], [6]], seed=0)
    b = build(params, pad_to=4, seed=1)
    assert a.output_ids.shape == (4, 0) and a.prompt_ids.shape == (4, 0) and not a.has_penalties
    assert a.seeds[0] != a.seeds[1] and a.seeds[0] != b.seeds[0]
    with pytest.raises(ValueError):
        build(params, pad_to=1)


# ---------------------------------------------------------------- greedy, logprobs, padding


@pytest.mark.parametrize("all_greedy", [False, True], ids=["general", "all-greedy-variant"])
def test_greedy_is_argmax_and_logprobs_match_numpy(all_greedy):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 1000)).astype(np.float32) * 3
    params = [
        SamplingParams(temperature=0.0, top_k=k, top_p=p, seed=s)
        for k, p, s in [(0, 1.0, None), (5, 0.5, 1), (1, 1.0, 2), (50, 0.9, None)]
    ]
    meta = build(params, pad_to=6)
    out = sample(jnp.asarray(logits), meta, max_top_k=64, num_logprobs=4, all_greedy=all_greedy)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(axis=1))
    ref = np_log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(6), logits.argmax(axis=1)], atol=1e-4)
    ref_top = np.argsort(-logits, axis=1)[:, :4]
    np.testing.assert_array_equal(np.asarray(out.top_ids), ref_top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, ref_top, 1), atol=1e-4)


def test_sampled_logprob_is_raw_distribution_and_padded_rows_finite():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 300)).astype(np.float32)
    logits[3:] = 0.0  # padded rows
    logits[0, :10] = -np.inf  # masked vocabulary entries in a real row
    params = [
        SamplingParams(temperature=1.5, seed=1, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=2),
        SamplingParams(temperature=1.0, seed=3),
    ]
    meta = build(params, pad_to=8, output_ids=[[11, 12], [], [1]], prompt_ids=[[13], [], []])
    out = sample(jnp.asarray(logits), meta, max_top_k=32, num_logprobs=3)
    tokens = np.asarray(out.tokens)
    assert np.isfinite(np.asarray(out.logprobs)).all() and np.isfinite(np.asarray(out.top_logprobs)).all()
    assert ((tokens >= 10) | (np.arange(8) != 0)).all()
    np.testing.assert_array_equal(tokens[3:], 0)  # greedy on all-equal logits: the first id
    ref = np_log_softmax(logits)  # unmodified by penalties or temperature
    np.testing.assert_allclose(out.logprobs, ref[np.arange(8), tokens], atol=1e-4)


# ---------------------------------------------------------------- seeded randomness


MIXED_PARAMS = [
    SamplingParams(temperature=1.0, seed=11),  # unfiltered: exact full-vocabulary path
    SamplingParams(temperature=0.9, top_k=20, seed=12),
    SamplingParams(temperature=1.2, top_p=0.7, seed=13),
    SamplingParams(temperature=0.8, min_p=0.05, seed=14),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, seed=15, presence_penalty=1.0),
]


def test_seeded_tokens_independent_of_batch_order_padding_and_composition():
    vocab, steps = 500, [4, 9, 0, 2, 7]
    base = np.random.default_rng(2).normal(size=(len(MIXED_PARAMS), vocab)).astype(np.float32)
    outputs = [[1, 2], [], [3], [], [5, 5, 6]]

    def run(order, pad_to, extra=(), top_k_impl="lax"):
        params = [MIXED_PARAMS[i] for i in order] + [p for p, _ in extra]
        logits = np.zeros((pad_to, vocab), np.float32)
        logits[: len(order)] = base[list(order)]
        for j, (_, row) in enumerate(extra):
            logits[len(order) + j] = row
        meta = build(
            params,
            pad_to,
            steps=[steps[i] for i in order] + [0] * len(extra),
            output_ids=[outputs[i] for i in order] + [[]] * len(extra),
            prompt_ids=[[] for _ in params],
        )
        tokens = sample(jnp.asarray(logits), meta, max_top_k=64, top_k_impl=top_k_impl).tokens
        return {i: np.asarray(tokens)[j] for j, i in enumerate(order)}

    reference = run(range(5), pad_to=5)
    assert run(range(5), pad_to=5) == reference  # identical across runs
    assert run([3, 0, 4, 2, 1], pad_to=8) == reference  # permuted and padded
    assert run(range(5), pad_to=5, top_k_impl="threshold") == reference  # same candidates, same draws
    # Without the unfiltered row the full-vocabulary branch is skipped; the others must not move.
    assert run([4, 2, 1, 3], pad_to=8) == {i: reference[i] for i in [4, 2, 1, 3]}
    other = (SamplingParams(temperature=2.0, seed=99), np.ones(vocab, np.float32))
    assert run([1, 0, 2], pad_to=8, extra=[other]) == {i: reference[i] for i in [1, 0, 2]}
    # The step changes the draw: over many steps a sampled row does not repeat one token.
    meta = build([MIXED_PARAMS[2]] * 8, 8, steps=list(range(8)))
    tokens = np.asarray(sample(jnp.asarray(np.tile(base[2], (8, 1))), meta, max_top_k=64).tokens)
    assert len(set(tokens.tolist())) > 1


# ---------------------------------------------------------------- distributions


def reference_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """HF warper order in float64: temperature, top-k, top-p (HF's ascending-cumsum rule), min-p."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(x, bool)
    if top_k:
        keep[order[top_k:]] = False
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    ascending = np.argsort(probs, kind="stable")
    removed = np.cumsum(probs[ascending]) <= 1 - top_p
    removed[-1] = False
    margin = np.min(np.abs(np.cumsum(probs[ascending]) - (1 - top_p))) if top_p < 1 else 1.0
    assert margin > 1e-4, "test logits sit on a top-p boundary; pick others"
    keep[ascending[removed]] = False
    probs = np.where(keep, probs, 0.0)
    keep &= probs >= min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def chi_square_critical(df, z=4.75):
    """Wilson-Hilferty upper quantile of chi-square(df) at a normal z (4.75: p ~ 1e-6)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


DIST_CASES = [
    dict(temperature=0.7),  # unfiltered, tail beyond max_top_k matters: exact path
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.5, min_p=0.1),
    dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
    dict(temperature=2.0, top_k=6, top_p=0.75),  # top-p renormalised over the top-k set
]


def test_empirical_distributions_match_numpy_reference():
    vocab, samples, max_top_k = 24, 20_000, 12
    logits = np.random.default_rng(3).normal(size=vocab).astype(np.float32) * 1.5
    params = [SamplingParams(seed=1234, **case) for case in DIST_CASES]
    rows = [p for p in params for _ in range(samples)]
    meta = build(rows, len(rows), steps=np.tile(np.arange(samples), len(params)).tolist())
    tokens = sample(jnp.asarray(np.tile(logits, (len(rows), 1))), meta, max_top_k=max_top_k).tokens
    tokens = np.asarray(tokens).reshape(len(params), samples)
    for case, row_tokens in zip(DIST_CASES, tokens):
        expected = reference_probs(logits, **case)
        counts = np.bincount(row_tokens, minlength=vocab)
        support = expected > 0
        assert counts[~support].sum() == 0, f"{case}: sampled filtered-out tokens {np.flatnonzero(counts * ~support)}"
        exp_counts = expected[support] * samples
        chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
        df = int(support.sum()) - 1
        assert df == 0 or chi2 < chi_square_critical(df), f"{case}: chi2 {chi2:.1f} (df {df})"
        tv = 0.5 * np.abs(counts / samples - expected).sum()
        assert tv < 0.03, f"{case}: total variation {tv:.4f}"


def test_unfiltered_rows_without_exact_path_are_truncated_to_candidates():
    vocab, samples = 24, 4000
    logits = np.zeros((samples, vocab), np.float32)  # uniform: 2/3 of the mass lies beyond top 8
    meta = build([SamplingParams(temperature=1.0, seed=5)] * samples, samples, steps=list(range(samples)))
    exact = np.asarray(sample(jnp.asarray(logits), meta, max_top_k=8).tokens)
    fast = np.asarray(sample(jnp.asarray(logits), meta, max_top_k=8, exact_unfiltered=False).tokens)
    assert len(np.unique(exact)) == vocab
    assert len(np.unique(fast)) == 8


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize("all_greedy", [False, True], ids=["general", "all-greedy-variant"])
@pytest.mark.parametrize("full_widths", [False, True])
def test_penalties_match_hf_repetition_and_openai_presence_frequency(all_greedy, full_widths):
    vocab = 40
    rng = np.random.default_rng(4)
    logits = (rng.normal(size=(6, vocab)) * 2).astype(np.float32)
    prompts = [[1, 2, 3, 3], [7], [], [30, 31], [5], [0]]
    outputs = [[3, 4, 4, 4], [7, 8, 9], [10, 10], [], [6], [1]]
    logits[2, 10] = logits[2].max() - 1.0  # the negative presence penalty makes it the argmax
    knobs = [(1.3, 0.5, 0.2), (0.7, 0.0, 1.0), (1.0, -2.0, 0.0), (2.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.5, 0.0, 0.0)]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=r, presence_penalty=pp, frequency_penalty=fp)
        for r, pp, fp in knobs
    ]
    meta = build(params, pad_to=8, output_ids=outputs, prompt_ids=prompts)
    if full_widths:  # the bounded "full" sampler variant: every matrix padded to a fixed width
        meta = meta.with_widths(output=64, prompt=64, banned=8, bias=512)
    padded_logits = np.concatenate([logits, np.zeros((2, vocab), np.float32)])

    expected = np.empty_like(logits)
    for i, (rep, presence, frequency) in enumerate(knobs):
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long).reshape(1, -1)
        row = RepetitionPenaltyLogitsProcessor(rep)(ids, torch.tensor(logits[i : i + 1]))[0].numpy()
        counts = np.bincount(np.asarray(outputs[i], int), minlength=vocab)
        expected[i] = row - frequency * counts - presence * (counts > 0)

    penalized = np.asarray(apply_penalties(jnp.asarray(padded_logits), meta))
    np.testing.assert_allclose(penalized[:6], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(penalized[6:], 0.0)
    out = sample(jnp.asarray(padded_logits), meta, max_top_k=16, all_greedy=all_greedy)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens[:6], expected.argmax(axis=1))
    assert tokens[2] == 10
    raw_logprobs = np_log_softmax(padded_logits)[np.arange(8), tokens]  # penalties do not enter
    np.testing.assert_allclose(out.logprobs, raw_logprobs, atol=1e-5)


# ---------------------------------------------------------------- top-k and compiled HLO


@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_threshold_top_k_matches_numpy_with_ties_and_infinities(k):
    rng = np.random.default_rng(5)
    x = rng.integers(-4, 4, size=(6, 300)).astype(np.float32)  # many ties
    x[0, :50] = -np.inf
    x[1] = 2.5  # one value everywhere
    x[2] = rng.normal(size=300).astype(np.float32) * 1e-30  # tiny, mixed signs
    x[3, ::3] = -0.5
    values, ids = jax.jit(lambda a: top_k(a, k, "threshold"))(jnp.asarray(x))
    ref_ids = np.argsort(-x.astype(np.float64), axis=1, kind="stable")[:, :k]  # ties: lower id first
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, ref_ids, axis=1))
    _lax_values, lax_ids = top_k(jnp.asarray(x), k, "lax")
    np.testing.assert_array_equal(np.asarray(lax_ids), ref_ids)
    with pytest.raises(ValueError):
        top_k(jnp.asarray(x), k, "sorted")


def test_compiled_hlo_has_no_full_vocabulary_sort():
    vocab = 32_000
    logits = jax.ShapeDtypeStruct((4, vocab), jnp.float32)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.02),
    ]
    plain = build(params, pad_to=4)
    penalized = build(
        params + [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)],
        pad_to=4,
        output_ids=[[], [], [], [5, 6]],
        prompt_ids=[[], [], [], [1, 2, 3]],
    )
    for meta, num_logprobs, impl in [(plain, 0, "lax"), (penalized, 5, "lax"), (penalized, 5, "threshold")]:
        hlo = sample.lower(logits, meta, max_top_k=256, num_logprobs=num_logprobs, top_k_impl=impl).compile().as_text()
        assert impl != "lax" or "TopK" in hlo
        assert not hlo_has_full_sort(hlo, vocab), f"full sort with num_logprobs={num_logprobs}, {impl}"
    # The detector itself must see a full sort when there is one.
    sorting = jax.jit(lambda x: jnp.argsort(x, axis=-1)[:, :8]).lower(logits).compile().as_text()
    assert hlo_has_full_sort(sorting, vocab)


def test_banned_ids_are_never_sampled():
    """EOS / stop tokens banned before min_tokens: greedy takes the best allowed token and random
    rows never draw a banned one, whatever the temperature."""
    vocab = 16
    logits = np.tile(np.linspace(3.0, 0.0, vocab, dtype=np.float32), (4, 1))  # token 0 is the argmax
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0, seed=1),
        SamplingParams(temperature=5.0, seed=2, top_k=3),
        SamplingParams(temperature=0.0),
    ]
    banned = [[0], [0, 1, 2], [0, 5], []]
    meta = SamplingMetadata.from_params(params, [0] * 4, [[]] * 4, [[]] * 4, pad_to=4, banned_ids=banned)
    assert meta.banned_ids.shape == (4, 4)
    out = np.asarray(sample(jnp.asarray(logits), meta, max_top_k=8).tokens)
    assert out[0] == 1 and out[3] == 0
    greedy_rows = dataclasses.replace(meta, temperature=np.zeros(4, np.float32))
    greedy = np.asarray(sample(jnp.asarray(logits), greedy_rows, max_top_k=8, all_greedy=True).tokens)
    np.testing.assert_array_equal(greedy, [1, 3, 1, 0])  # the best token each row may take
    for step in range(200):
        m = dataclasses.replace(meta, steps=np.full(4, step, np.int32))
        toks = np.asarray(sample(jnp.asarray(logits), m, max_top_k=8).tokens)
        assert toks[1] not in (0, 1, 2) and toks[2] not in (0, 5) and toks[2] in (1, 2, 3)


def test_full_vocabulary_path_spans_blocks_exactly():
    """The exact unfiltered path draws a 256-token block, then a token in it: over a vocabulary
    of three blocks (the last one partial) the draws follow softmax, and -inf tokens never come."""
    vocab, samples = 600, 20_000
    rng = np.random.default_rng(7)
    live = np.sort(rng.choice(vocab, size=40, replace=False))
    live[-1] = vocab - 1  # the last token of the partial block is live too
    logits = np.full(vocab, -np.inf, np.float32)
    logits[live] = rng.normal(size=live.size).astype(np.float32) * 1.2
    meta = build([SamplingParams(temperature=1.0, seed=99)] * samples, samples, steps=list(range(samples)))
    tokens = np.asarray(sample(jnp.asarray(np.tile(logits, (samples, 1))), meta, max_top_k=8).tokens)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[np.setdiff1d(np.arange(vocab), live)].sum() == 0
    assert {t // 256 for t in tokens.tolist()} == {0, 1, 2}
    expected = np.exp(logits[live] - logits[live].max())
    expected = expected / expected.sum() * samples
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(live.size - 1), f"chi2 {chi2:.1f} (df {live.size - 1})"


@pytest.mark.parametrize("all_greedy", [False, True])
@pytest.mark.parametrize("full_widths", [False, True])
def test_logit_bias_matches_numpy_and_reported_logprobs_stay_raw(all_greedy, full_widths):
    """OpenAI logit_bias: added to the logits before sampling (greedy = numpy argmax of logits + bias),
    padded to a power-of-two width; reported logprobs are the raw distribution's (vLLM)."""
    rng = np.random.default_rng(11)
    vocab = 300
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    biases = [{7: 100.0}, {int(np.argmax(logits[1])): -100.0, 5: 2.5, 6: -0.5}, {}]
    params = [SamplingParams(temperature=0.0, logit_bias=b) for b in biases]
    meta = build(params, pad_to=4)
    assert meta.logit_bias_ids.shape == meta.logit_bias_values.shape == (4, 16)
    if full_widths:  # the bounded "full" sampler variant: every matrix padded to a fixed width
        meta = meta.with_widths(output=32, prompt=32, banned=8, bias=512)
    padded = np.concatenate([logits, np.zeros((1, vocab), np.float32)])
    out = sample(jnp.asarray(padded), meta, max_top_k=32, num_logprobs=2, all_greedy=all_greedy)
    expected = logits.copy()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            expected[row, token] += value
    np.testing.assert_array_equal(np.asarray(out.tokens)[:3], np.argmax(expected, axis=1))
    assert np.asarray(out.tokens)[0] == 7
    raw = np_log_softmax(logits)
    np.testing.assert_allclose(np.asarray(out.logprobs)[:3], raw[np.arange(3), np.argmax(expected, axis=1)], atol=1e-5)
    assert build([SamplingParams()], pad_to=2).logit_bias_ids.shape == (2, 0)  # nobody biased: free


def test_logit_bias_minus_100_is_never_sampled():
    vocab = 16
    logits = np.tile(np.linspace(3.0, 0.0, vocab, dtype=np.float32), (2, 1))
    params = [SamplingParams(temperature=3.0, seed=s, logit_bias={0: -100.0, 1: -100.0}) for s in (1, 2)]
    meta = build(params, pad_to=2)
    for step in range(100):
        toks = np.asarray(
            sample(jnp.asarray(logits), dataclasses.replace(meta, steps=np.full(2, step, np.int32)), max_top_k=8).tokens
        )
        assert not set(toks.tolist()) & {0, 1}


def test_blockwise_prompt_scoring_matches_numpy_log_softmax():
    """The scoring backbone's per-row scoring (`score_hidden_rows`), in blocks that do not divide
    the row count, equals numpy's log_softmax of hidden @ embed.T at each target."""
    from runtime.steps.sampler import score_hidden_rows

    rng = np.random.default_rng(3)
    T, H, V = 13, 8, 50
    params = {"embed": rng.normal(size=(V, H)).astype(np.float32)}
    hidden = rng.normal(size=(T, H)).astype(np.float32)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[[2, 12]] = -1  # rows without a target
    scores = jax.jit(score_hidden_rows, static_argnames="block")(params, hidden, targets, block=4)
    ref = np_log_softmax(hidden.astype(np.float64) @ params["embed"].T.astype(np.float64))
    rows = np.flatnonzero(targets >= 0)
    np.testing.assert_allclose(np.asarray(scores.logprobs)[rows], ref[rows, targets[rows]], atol=1e-5)
    ranks = 1 + (ref[rows] > ref[rows, targets[rows]][:, None]).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(scores.ranks)[rows], ranks)
    np.testing.assert_allclose(np.asarray(scores.top_logprobs)[:, :5], -np.sort(-ref, axis=1)[:, :5], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(scores.top_ids)[:, 0], ref.argmax(axis=1))
