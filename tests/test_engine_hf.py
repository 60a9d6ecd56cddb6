"""Batch invariance against HF: many prompts served together equal HF `generate` for each alone.

The engine runs with a token budget small enough to force chunked prefill, a page pool small
enough to force preemptions, and prefix caching on over prompts that share prefixes. The
scheduler's page/slot accounting is checked after every step, and at the end every page and
slot is free or held only by the evictable prefix cache.
"""

import jax
import numpy as np
import pytest
from engine_testing import drain
from hf_reference import assert_greedy_match, hf_greedy

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

NUM_PROMPTS = 48
MAX_TOKENS = 12


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, vocab, size=n).tolist() for n in (40, 75)]
    prompts = []
    for i in range(NUM_PROMPTS):
        n = int(rng.integers(1, 301))
        if i % 3 and n > 80:  # two thirds of the longer prompts share a prefix
            p = prefixes[i % 2]
            prompts.append(p + rng.integers(3, vocab, size=n - len(p)).tolist())
        else:
            prompts.append(rng.integers(3, vocab, size=n).tolist())
    return prompts


def run_engine(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, params))
    return {rid: out.token_ids for rid, out in drain(engine).items()}


def record_partial_prefill_chunks(engine: LLMEngine) -> list[str]:
    """Record the ids of scheduled prefill chunks that stop short of the prompt's end."""
    partial, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        partial.extend(s.request_id for s in out.sequences if not s.sample)
        return out

    engine.scheduler.schedule = recording_schedule
    return partial


def assert_all_free(engine: LLMEngine) -> None:
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"], s
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert s.get("table_rows_used", 0) == 0, s  # every request-table row is free again


@pytest.mark.parametrize("family,step", [("llama", "auto"), ("qwen3_5", "auto"), ("qwen3_5", "scan+sampler")])
def test_batch_invariance_vs_hf(family, step, tiny_checkpoint, hf_model):
    """`auto` on CPU: layers unrolled, token buckets from 4, greedy steps through the fused greedy
    backbone (forced on); `scan+sampler`: the accelerator defaults (layer scan, separate sampler)."""
    path = tiny_checkpoint(family)
    # the fused greedy backbone is forced on in `auto` (the CPU plan leaves it off) so it stays checked
    variant = {"fuse_greedy": True} if step == "auto" else {"layer_loop": "scan", "fuse_greedy": False}
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(path),
            dtype="float32",
            page_size=16,
            num_pages=70,
            max_num_seqs=16,
            max_num_batched_tokens=128,
            enable_prefix_caching=True,
            max_model_len=512,
            **variant,
        )
    )
    if step == "auto" and jax.default_backend() == "cpu":  # the CPU plan (accelerators: scan)
        assert engine.layer_loop == "unroll" and engine.model.unrolled and engine.executables.fuse_greedy
        assert engine.token_buckets[0] == 4
        assert engine.executables.greedy_buckets == tuple(T for T in engine.token_buckets if T <= 16)
    elif step != "auto":
        assert engine.layer_loop == "scan" and not engine.model.unrolled and not engine.executables.fuse_greedy
    vocab = engine.model.cfg.vocab_size
    prompts = _prompts(vocab)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    partial_chunks = record_partial_prefill_chunks(engine)
    done = run_engine(engine, prompts, params)

    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the page pool was meant to force preemptions"
    assert stats["prefix_cache_hit_rate"] > 0, "shared prefixes were meant to hit the prefix cache"
    assert partial_chunks, "prefill was meant to be chunked"
    assert_all_free(engine)

    hf = hf_model(family)
    for i, p in enumerate(prompts):
        expected, scores = hf_greedy(hf, p, MAX_TOKENS)
        assert_greedy_match(done[f"r{i}"], expected, scores, f"{family} prompt {i} (len {len(p)})")
