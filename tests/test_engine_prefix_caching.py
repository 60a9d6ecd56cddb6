"""Hybrid prefix caching in the engine on tiny GDN hybrids: hits restore exact states.

Three waves of requests on one engine with the default `auto` checkpoint policy:
  1. r0 = P (45 tokens) generates 10 tokens;
  2. r1 = P + r0's output + a new user turn: resumes from r0's rolling request-end checkpoint
     (48 of the 54 tokens r0 computed); r2 = P[:30] + other tokens: its cached KV reaches 24
     but no state does (r0's chunk-end and prompt-end checkpoints were superseded by its
     request-end one), so it computes from 0 and saves a divergence checkpoint at 24;
  3. r3 = P[:30] + yet other tokens resumes at that divergence point (24); r4 = P again hits
     24 too and must generate exactly r0's tokens.
Every output is compared with HF transformers' greedy generation of the whole prompt (the
independent reference), the hit depths are checked, and afterwards every page and state slot
is free or cached (no leaks), with checkpoints within their budget.
"""

import numpy as np
import pytest
from engine_testing import drain
from hf_reference import assert_greedy_match, hf_greedy

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

MAX_TOKENS = 10


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hybrid_prefix_hits_at_request_ends_and_divergence_points_match_hf(family, tiny_checkpoint, hf_model):
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint(family)),
            dtype="float32",
            page_size=8,
            num_pages=80,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=256,
            enable_prefix_caching=True,
            load_tokenizer=False,
        )
    )
    assert engine.cache_config.checkpoint_policy == "auto" and engine.cache_config.num_checkpoint_slots > 0
    rng = np.random.default_rng(17)
    vocab = engine.model.cfg.vocab_size
    draw = lambda n: rng.integers(3, vocab, size=n).tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = draw(45)
    prompts, done = {}, {}

    def wave(**new):
        prompts.update(new)
        for rid, p in new.items():
            engine.add_request(EngineRequest(rid, p, params))
        done.update(drain(engine))

    wave(r0=prompt)
    wave(r1=prompt + done["r0"].outputs[0].token_ids + draw(7), r2=prompt[:30] + draw(12))
    wave(r3=prompt[:30] + draw(9), r4=prompt)

    cached = {rid: out.num_cached_tokens for rid, out in done.items()}
    assert cached == {"r0": 0, "r1": 48, "r2": 0, "r3": 24, "r4": 24}
    assert done["r4"].outputs[0].token_ids == done["r0"].outputs[0].token_ids  # hit == miss, exactly
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    assert stats["slots_free"] + stats["slots_cached"] == stats["slots_total"]
    assert 0 < stats["slots_cached"] <= engine.cache_config.num_checkpoint_slots
    hf = hf_model(family)
    for rid, p in prompts.items():
        expected, scores = hf_greedy(hf, p, MAX_TOKENS)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"{family} {rid}")


def _state_bytes_per_slot(cfg) -> int:
    """fp32 conv state [K-1, conv_dim] + recurrent state [Hv, dk, dv] per GDN layer, from the config."""
    conv_dim = (
        2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return 4 * cfg.num_linear_layers * ((cfg.linear_conv_kernel_dim - 1) * conv_dim + recurrent)


def test_checkpoint_slots_sized_by_the_memory_budget_still_serve_hits(tiny_checkpoint, hf_model):
    """`cache.hybrid_checkpoint_budget` of the cache memory buys the checkpoint slots (here 3, fewer
    than the 2 per sequence a larger budget gives); a chat continuation still resumes from its
    predecessor's request-end checkpoint and matches HF."""
    from models.config import parse_config
    from models.safetensors_io import read_json

    path = tiny_checkpoint("qwen3_5")
    slot = _state_bytes_per_slot(parse_config(read_json(path / "config.json")))
    budget = 13 * slot  # 0.25 x 13 slots of memory: 3 checkpoint slots
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,
            model=str(path),
            dtype="float32",
            page_size=8,
            num_pages=80,
            kv_cache_memory_bytes=budget,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=256,
            hybrid_checkpoint_budget=0.25,
            load_tokenizer=False,
        )
    )
    assert engine.cache_config.num_checkpoint_slots == 3 < 2 * 4
    assert engine.cache_config.num_state_slots == 1 + 4 + 3
    rng = np.random.default_rng(5)
    draw = lambda n: rng.integers(3, engine.model.cfg.vocab_size, size=n).tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = draw(45)
    engine.add_request(EngineRequest("r0", prompt, params))
    first = drain(engine)["r0"].outputs[0].token_ids
    follow_up = prompt + first + draw(7)
    engine.add_request(EngineRequest("r1", follow_up, params))
    done = drain(engine)["r1"]
    assert done.num_cached_tokens == 48  # r0's request-end checkpoint (54 tokens computed, page 8)
    assert 0 < engine.stats()["slots_cached"] <= 3
    expected, scores = hf_greedy(hf_model("qwen3_5"), follow_up, MAX_TOKENS)
    assert_greedy_match(done.outputs[0].token_ids, expected, scores, "qwen3_5 r1, budgeted checkpoints")
