"""Speculative decoding composed with P/D disaggregation and grammars (issue 35).

P/D: the decode instance speculates (the prefill instance computes prompts only and refuses
`speculative_config`); requests carried by the in-process connector of tests/test_kv_transfer.py
decode with drafts, and the output equals a colocated engine's without speculation (the
reference: the decode side's configuration, `speculative_config` off). Drafts come from the
reference continuation with one draft spoiled (`OracleDrafts`), so accepted counts cycle through
0 .. k whatever the tiny random model says.

Grammars: each verify row is masked by the grammar's state after the drafts before it (the
llguidance matcher advanced tentatively and left as it was); a draft the grammar rejects ends
the accepted prefix. JSON-schema and regex constrained greedy requests (a random model follows a
grammar only through the mask), mixed with unconstrained ones, equal the engine without
speculation token for token, with the same finish reasons (a grammar completed inside a run of
accepted drafts stops there).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from engine_testing import drain, small_engine_config
from structured_cases import json_schemas, regexes
from test_kv_transfer import plugin  # noqa: F401 (the in-process connector's fixture)
from test_spec_decode import PROMPTS, SPEC
from test_spec_decode_gdn import OracleDrafts

from runtime.engine.llm_engine import LLMEngine
from runtime.kv_transfer import KVTransferConfig
from runtime.speculative import speculator
from runtime.structured_output.manager import StructuredOutputManager
from runtime.types import EngineRequest, SamplingParams, StructuredOutput

NUM_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _all_free(engine):
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"], s


def _serve(engine, requests) -> dict:
    for r in requests:
        engine.add_request(r)
    return {rid: out for rid, out in drain(engine).items()}


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_pd_decode_side_speculates_and_equals_colocated(plugin, tiny_checkpoint, family, monkeypatch):  # noqa: F811
    path = tiny_checkpoint(family)
    small = dict(page_size=8, max_num_batched_tokens=32, token_buckets=(8, 16, 32), max_model_len=128)
    with pytest.raises(ValueError, match="speculative_config: the prefill role computes prompts only"):
        LLMEngine(small_engine_config(path, speculative_config=SPEC, kv_transfer=KVTransferConfig(role="prefill")))
    prefill = LLMEngine(
        small_engine_config(path, **small, kv_transfer=KVTransferConfig(role="prefill", connector=plugin))
    )
    decode = LLMEngine(
        small_engine_config(
            path, **small, speculative_config=SPEC, kv_transfer=KVTransferConfig(role="decode", connector=plugin)
        )
    )
    colocated = LLMEngine(small_engine_config(path, **small))
    tok = decode.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(PROMPTS[1] * 2)]
    reqs = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    want = {rid: out.outputs[0].token_ids for rid, out in _serve(colocated, reqs).items()}
    oracle = OracleDrafts(decode.model.cfg.vocab_size)
    for r in reqs:
        oracle.add(r.prompt_token_ids, want[r.request_id])
    monkeypatch.setattr(speculator, "propose_ngram", oracle)
    legs = [EngineRequest(r.request_id, r.prompt_token_ids, GREEDY, kv_transfer_params={"do_remote_decode": True})
            for r in reqs]  # fmt: skip
    offered = {rid: out.kv_transfer_params for rid, out in _serve(prefill, legs).items()}
    assert all(offered.values()), offered
    pulled = [EngineRequest(r.request_id, r.prompt_token_ids, GREEDY, kv_transfer_params=offered[r.request_id])
              for r in reqs]  # fmt: skip
    got = {rid: out.outputs[0].token_ids for rid, out in _serve(decode, pulled).items()}
    stats = decode.stats()
    assert stats["kv_transfer_fallbacks"] == 0, stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_num_accepted_tokens_per_pos"][-1] > 0, stats
    assert got == want
    for engine in (prefill, decode):
        _all_free(engine)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    """(engine with speculation, without) on the tiny Llama."""
    path = tiny_checkpoint("llama")
    small = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64), max_model_len=256)
    return LLMEngine(small_engine_config(path, **small, speculative_config=SPEC)), LLMEngine(
        small_engine_config(path, **small)
    )


def _drafted(spec, before) -> tuple[int, int, int]:
    """(drafts, accepted, runs of all k accepted) since `before`."""
    s = spec.stats()
    return (
        s["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"],
        s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"],
        s["spec_decode_num_accepted_tokens_per_pos"][-1] - before["spec_decode_num_accepted_tokens_per_pos"][-1],
    )


def test_grammar_masks_drafted_rows_and_equals_no_speculation(pair, monkeypatch):
    spec, off = pair
    before = spec.stats()
    tok = spec.tokenizer
    grammars = [StructuredOutput("json", json.dumps(s)) for s in json_schemas(40)[::8]]
    grammars += [StructuredOutput("regex", r) for r in regexes(12)[::3]]
    reqs = [
        EngineRequest(f"s{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_tokens=48, temperature=0.0,
                      structured_output=g))
        for i, g in enumerate(grammars)
    ]  # fmt: skip
    reqs += [EngineRequest(f"p{i}", tok.encode(p), GREEDY) for i, p in enumerate(PROMPTS[:3])]
    want = _serve(off, reqs)
    assert sum(out.outputs[0].finish_reason == "stop" for out in want.values()) >= len(grammars) // 2
    oracle = OracleDrafts(spec.model.cfg.vocab_size)
    for r in reqs:
        oracle.add(r.prompt_token_ids, want[r.request_id].outputs[0].token_ids)
    monkeypatch.setattr(speculator, "propose_ngram", oracle)
    cut = []  # drafts the grammar rejected (they end the accepted prefix)
    allowed = StructuredOutputManager.allowed_drafts

    def spy(self, request_id, drafts):
        n = allowed(self, request_id, drafts)
        cut.append(len(drafts) - n)
        return n

    monkeypatch.setattr(StructuredOutputManager, "allowed_drafts", spy)
    got = _serve(spec, reqs)
    drafted, accepted, all_k = _drafted(spec, before)
    assert 0 < accepted < drafted and all_k > 0, (drafted, accepted, all_k)
    assert any(cut) and not all(cut), cut
    assert set(got) == set(want)
    for rid, out in got.items():
        a, b = out.outputs[0], want[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), rid
    assert len(spec.structured_output) == 0
    _all_free(spec)


def test_logit_bias_and_min_tokens_bans_apply_to_drafted_rows(pair, monkeypatch):
    """Drafts from the unconstrained continuation carry the token a logit bias of -100 forbids,
    or a stop token `min_tokens` bans at that output index: each verify row must apply them (a
    row's ban by its own output index), so the output equals the engine without speculation."""
    spec, off = pair
    tok = spec.tokenizer
    prompts = [tok.encode(p) for p in (PROMPTS[0] * 2, PROMPTS[1], PROMPTS[2] * 2, PROMPTS[3])]
    free = _serve(off, [EngineRequest(f"f{i}", p, GREEDY) for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        cont = free[f"f{i}"].outputs[0].token_ids
        biased = dataclasses.replace(GREEDY, logit_bias={cont[4]: -100.0})
        banned = dataclasses.replace(GREEDY, min_tokens=12, stop_token_ids=[cont[3]], ignore_eos=False)
        reqs += [EngineRequest(f"b{i}", p, biased), EngineRequest(f"m{i}", p, banned)]
    want = _serve(off, reqs)
    for i in range(len(prompts)):  # the constraints change the outputs
        assert want[f"b{i}"].outputs[0].token_ids != free[f"f{i}"].outputs[0].token_ids
    oracle = OracleDrafts(spec.model.cfg.vocab_size)
    for r in reqs:  # the unconstrained continuation first (its drafts break the constraint), then the reference
        oracle.add(r.prompt_token_ids, free["f" + r.request_id[1:]].outputs[0].token_ids)
        oracle.add(r.prompt_token_ids, want[r.request_id].outputs[0].token_ids)
    monkeypatch.setattr(speculator, "propose_ngram", oracle)
    before = spec.stats()
    got = _serve(spec, reqs)
    drafted, accepted, _ = _drafted(spec, before)
    assert 0 < accepted < drafted, (drafted, accepted)
    for rid, out in got.items():
        a, b = out.outputs[0], want[rid].outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason), rid
    _all_free(spec)


def _allows(mask, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def test_draft_masks_equal_the_masks_after_each_prefix(pair):
    """`allowed_drafts` / `fill_drafts` against an independent walk: a second matcher advanced
    token by token with the plain one-row `fill` after each. A draft the grammar rejects ends the
    allowed prefix; the masks of rows first .. first + n are the walk's; other rows allow all;
    the matcher is left where it was. A `start_after` grammar: drafts up to the one starting it,
    the row after it masked by the fresh grammar."""
    from runtime.structured_output import build_compiler

    spec, _ = pair
    cfg = spec.model.cfg
    compiler = build_compiler(spec.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
    grammar = StructuredOutput("regex", r"(cat|dog|bird)-[0-9]{3,6}")
    walk = StructuredOutputManager(compiler, max_rows=4)
    walk.add("w", grammar)
    tokens, masks = [], []
    for j in range(5):  # a valid path: the allowed tokens picked round-robin, never an end token
        mask = walk.fill(["w"], 1)[0].copy()
        masks.append(mask)
        allowed = [t for t in range(cfg.vocab_size) if _allows(mask, t) and t not in cfg.eos_token_ids]
        tokens.append(allowed[(7 * j) % len(allowed)])
        assert not walk.advance("w", tokens[-1])
    masks.append(walk.fill(["w"], 1)[0].copy())
    bad = next(t for t in range(cfg.vocab_size) if not _allows(masks[3], t))
    m = StructuredOutputManager(compiler, max_rows=4)
    m.add("t", grammar)
    assert m.allowed_drafts("t", tokens) == 5
    assert m.allowed_drafts("t", tokens[:3] + [bad, tokens[4]]) == 3
    bitmask = m.fill_drafts([("t", 2, tokens[:3]), ("nobody", 0, [1, 2])], num_rows=8)
    for j in range(4):
        np.testing.assert_array_equal(bitmask[2 + j], masks[j])
    assert (bitmask[[0, 1, 6, 7]] == -1).all()
    full = m.fill_drafts([("t", 0, tokens)], num_rows=6)
    np.testing.assert_array_equal(full, np.stack(masks))
    np.testing.assert_array_equal(m.fill(["t"], 1)[0], masks[0])  # left where it was
    start = (tokens[0], tokens[1])  # any two ids stand in for the end of a reasoning block
    m.add("s", StructuredOutput("regex", grammar.spec, start_after=start))
    drafts = [tokens[2], *start, tokens[0], tokens[1]]
    assert m.allowed_drafts("s", drafts) == 3
    bitmask = m.fill_drafts([("s", 1, drafts[:3])], num_rows=6)
    assert (bitmask[[0, 1, 2, 3, 5]] == -1).all()
    np.testing.assert_array_equal(bitmask[4], masks[0])
    assert m.fill_drafts([("s", 1, drafts[:2])], num_rows=6) is None
