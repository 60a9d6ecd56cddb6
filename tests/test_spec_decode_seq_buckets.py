"""The verify step per sequence bucket (issue 35): a step's per-sequence work (the MTP's k draft
steps, acceptance, penalty rows, the GDN replay) runs over the smallest sequence bucket holding its
sequences, not max_num_seqs. Reference: the same captured step run in the max_num_seqs bucket (the
path the other spec-decode tests check against torch and HF), every output and cache equal."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_testing import drain, spec_engine
from test_engine_hf import assert_all_free
from test_spec_decode import PROMPTS

from runtime.speculative.verify import VerifyRows
from runtime.types import EngineRequest, SamplingParams

SPEC = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def captured(tiny_checkpoint):
    """(engine, the first drafting verify step's run arguments, its caches before the step): one
    sampled request with logprobs and a penalty on Qwen3.5 (GDN hybrid, MTP), max_num_seqs 16."""
    engine = spec_engine(tiny_checkpoint("qwen3_5"), SPEC, max_num_seqs=16, num_pages=64)
    exes, calls = engine.speculator.verify, []
    run = exes.run

    def record(params, caches, inputs, verify, *rest):
        if not calls and np.asarray(verify.num_draft).any():
            copy = lambda tree: jax.tree.map(jnp.copy, tree)
            calls.append((params, copy(caches), copy(inputs), verify, *rest))
        return run(params, caches, inputs, verify, *rest)

    exes.run = record
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2, presence_penalty=0.5)
    engine.add_request(EngineRequest("a", engine.tokenizer.encode(PROMPTS[0]), params))
    try:
        drain(engine)
    finally:
        del exes.run
    assert_all_free(engine)
    assert calls, "no verify step drafted"
    return engine, calls[0]


def test_seq_buckets_for_each_token_bucket(captured):
    engine, _ = captured
    exes = engine.speculator.verify
    assert exes.seq_buckets == (8, 16) == engine.seq_buckets
    assert [exes.seq_buckets_for(T) for T in (8, 16, 32)] == [(8,), (8, 16), (8, 16)]
    assert [exes.seq_rows(n) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    wide = copy.copy(exes)  # larger token buckets: a decode-only step in 64 (> 32 tokens, <= k + 1 each) has >= 9
    wide.token_buckets = (8, 16, 32, 64, 128)
    assert [wide.seq_buckets_for(T) for T in (32, 64, 128)] == [(8, 16), (16,), (16,)]
    assert (wide.seq_rows(1, 32), wide.seq_rows(1, 64), wide.seq_rows(9, 32)) == (8, 16, 16)


def _pad(a, n: int, fill):
    a = np.asarray(a)
    return np.concatenate([a, np.full((n - a.shape[0], *a.shape[1:]), fill, a.dtype)])


def test_one_sequence_runs_the_smallest_bucket_and_equals_the_full_one(captured):
    engine, (params, caches, inputs, verify, all_greedy, penalty, num_logprobs, bitmask) = captured
    exes = engine.speculator.verify
    assert verify.num_draft.shape == (8,) and penalty is not None and penalty[0].shape[0] == 8
    assert any(key[1] == 8 for key in exes.executables)  # the engine's step ran the S = 8 executable
    full = dataclasses_replace_num_draft(verify, 16)
    full_penalty = tuple(_pad(a, 16, -1 if a.dtype == np.int32 and a.ndim == 2 else 0) for a in penalty)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    small = exes.run(params, copy(caches), inputs, verify, all_greedy, penalty, num_logprobs, bitmask)
    big = exes.run(params, copy(caches), inputs, full, all_greedy, full_penalty, num_logprobs, bitmask)
    assert {key[1] for key in exes.executables} == {8, 16}
    c8, table8, rows8, acc8, first8, drafted8, _ = small
    c16, table16, rows16, acc16, first16, drafted16, _ = big
    n = 1
    np.testing.assert_array_equal(np.asarray(rows8.tokens), np.asarray(rows16.tokens))
    np.testing.assert_allclose(np.asarray(rows8.logprobs), np.asarray(rows16.logprobs), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rows8.top_ids), np.asarray(rows16.top_ids))
    np.testing.assert_array_equal(np.asarray(acc8)[:n], np.asarray(acc16)[:n])
    assert not np.asarray(acc16)[8:].any()
    assert first8.tokens.shape == first16.tokens.shape == (16,)  # padded to max_num_seqs: the next prev_tokens
    np.testing.assert_array_equal(np.asarray(first8.tokens), np.asarray(first16.tokens))
    np.testing.assert_array_equal(np.asarray(drafted8)[:n], np.asarray(drafted16)[:n])
    assert int(np.asarray(verify.num_draft)[0]) == SPEC["num_speculative_tokens"]
    for a, b in zip(jax.tree.leaves(table8), jax.tree.leaves(table16)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    leaves8, leaves16 = jax.tree.leaves(c8), jax.tree.leaves(c16)
    assert len(leaves8) == len(leaves16)
    for a, b in zip(leaves8, leaves16):  # KV, GDN states (the replay), the MTP's K/V and carry
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def dataclasses_replace_num_draft(verify: VerifyRows, S: int) -> VerifyRows:
    """The same verify rows in sequence bucket S (the extra sequence rows draft nothing)."""
    return VerifyRows(
        verify.rows, verify.seqs, verify.offsets, verify.steps, verify.drafts, _pad(verify.num_draft, S, 0)
    )
