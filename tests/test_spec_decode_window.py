"""Speculative decoding with window-aware paging (issues 34 and 35): tiny gpt-oss and Gemma 3
(sliding window 7) with the window layers' K/V in their own page pool.

The verify rows' K/V go to both pools; the window slides (its pages go back to the pool) only
past the committed position, the tokens accepted so far, never past a draft that may be
rejected. References: HF transformers' greedy continuation on the same checkpoint and the same
engine configuration without speculation. Drafts come from the reference continuation with one
spoiled (`OracleDrafts`: accepted counts cycle through 0 .. k), over prompts several windows and
pages long, under chunked prefill, preemption (a short full pool) and prefix hits.
"""

import pytest
from engine_testing import drain, spec_engine
from hf_reference import assert_greedy_match, hf_greedy, random_prompt
from test_spec_decode import SPEC
from test_spec_decode_gdn import OracleDrafts

from runtime.speculative import speculator
from runtime.types import EngineRequest, SamplingParams

NUM_TOKENS = 14
SMALL = dict(num_pages=21, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(8, 16), max_model_len=80)


def _serve(engine, prompts: dict) -> dict:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    return {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}


def _nothing_held(engine):
    engine.scheduler.check_invariants()
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["window_pages_used"] == 0, stats


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_ngram_with_window_paging_equals_no_speculation_and_hf(tiny_checkpoint, hf_model, monkeypatch, family):
    path = tiny_checkpoint(family)
    spec = spec_engine(path, SPEC, load_tokenizer=False, **SMALL)
    off = spec_engine(path, None, load_tokenizer=False, **SMALL)
    window = spec.scheduler.cache.window
    assert window is not None and window.window == 7  # window paging on, with speculation
    vocab = spec.model.cfg.vocab_size
    shared = random_prompt(vocab, 21, seed=300)
    prompts = {f"r{i}": shared + random_prompt(vocab, n, seed=310 + i) for i, n in enumerate((2, 27, 13, 36))}
    prompts["copy"] = random_prompt(vocab, 6, seed=320) * 4  # prompt lookup's own drafts, some accepted
    want = _serve(off, prompts)
    _nothing_held(off)
    got = _serve(spec, {"copy": prompts["copy"]})  # prompt lookup (no oracle)
    oracle = OracleDrafts(vocab)
    for rid, ids in prompts.items():
        oracle.add(ids, want[rid])
    monkeypatch.setattr(speculator, "propose_ngram", oracle)
    got.update(_serve(spec, {rid: ids for rid, ids in prompts.items() if rid != "copy"}))
    again = {f"again-{rid}": prompts[rid] for rid in ("r1", "r3")}  # prefix hits of the window's pages
    hits = spec.stats()["prefix_cache_hit_tokens"]
    got.update(_serve(spec, again))
    stats = spec.stats()
    assert stats["prefix_cache_hit_tokens"] > hits, stats
    assert stats["num_preemptions"] > 0, stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_num_accepted_tokens_per_pos"][-1] > 0, stats
    _nothing_held(spec)
    for rid in {**prompts, **again}:
        assert got[rid] == want[rid.removeprefix("again-")], rid
    hf = hf_model(family)
    for rid in ("r0", "r3", "copy"):
        expected, scores = hf_greedy(hf, prompts[rid], NUM_TOKENS)
        assert_greedy_match(got[rid], expected, scores, f"{family} {rid}")
