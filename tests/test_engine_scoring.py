"""Prompt logprobs (vLLM's prompt_logprobs; echo + logprobs for lm-eval) and logit_bias through the
real engine, against HF transformers on the same tiny float32 checkpoint.

Prompt logprobs come out of the same compiled steps as generation (the scoring backbone), so
they are checked where those steps are awkward: prefill chunked over several steps, a prompt
whose pages are already in the prefix cache, and requests preempted and recomputed.
"""

import numpy as np
import pytest
import torch
from engine_testing import drain

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

FAMILY = "qwen3_5"  # a GDN hybrid: chunked prefill carries recurrent state between steps
TOP = 5


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint(FAMILY)),
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_pages=40,
            page_size=16,
            max_model_len=256,
            enable_prefix_caching=True,
        )
    )


def hf_log_softmax(hf_model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(FAMILY)(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()  # [L, V]: row i predicts prompt[i + 1]


def assert_prompt_logprobs_match_hf(out, prompt, reference: np.ndarray, top: int = TOP) -> None:
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        entry, row = scored[i], reference[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - row[prompt[i]]) < 1e-4, (i, entry.logprob, row[prompt[i]])
        assert (
            entry.rank == 1 + int(np.sum(row > row[prompt[i]] + 1e-6))
            or abs(np.sort(row)[::-1][entry.rank - 1] - row[prompt[i]]) < 1e-4
        )
        top_ids = [t for t, _ in entry.top]
        assert len(top_ids) == top
        np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(row)[::-1][:top], atol=1e-4)
        assert [row[t] for t in top_ids] == pytest.approx([lp for _, lp in entry.top], abs=1e-4)


def _serve(engine, requests):
    for r in requests:
        engine.add_request(r)
    done = drain(engine)
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"] and s["num_running"] == 0
    return done


def test_chunked_prefill_and_prefix_cache_hit_still_score_every_prompt_token(engine, hf_model):
    prompt = np.random.default_rng(1).integers(3, 1000, size=75).tolist()  # 3 chunks of <= 32
    reference = hf_log_softmax(hf_model, prompt)
    warm = _serve(engine, [EngineRequest("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    assert warm["warm"].prompt_logprobs is None
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    hits_before = engine.stats()["prefix_cache_hit_rate"]
    done = _serve(engine, [EngineRequest("scored", prompt, params)])
    assert engine.stats()["prefix_cache_hit_rate"] <= hits_before  # the cached pages were not used
    assert done["scored"].num_cached_tokens == 0
    assert_prompt_logprobs_match_hf(done["scored"], prompt, reference)
    assert done["scored"].token_ids[0] == int(np.argmax(reference[-1]))


def test_max_tokens_zero_scores_without_generating(engine, hf_model):
    prompt = list(range(30, 70))
    done = _serve(engine, [EngineRequest("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))])
    out = done["score"]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert_prompt_logprobs_match_hf(out, prompt, hf_log_softmax(hf_model, prompt), top=1)


def test_preempted_requests_keep_exact_prompt_logprobs(tiny_checkpoint, hf_model):
    """A pool too small for all four at full length: some are preempted and recomputed."""
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint(FAMILY)),
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_pages=12,
            page_size=16,
            max_model_len=176,
            enable_prefix_caching=False,
        )
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 1000, size=int(n)).tolist() for n in (40, 33, 45, 20)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    done = _serve(engine, [EngineRequest(f"p{i}", p, params) for i, p in enumerate(prompts)])
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force preemptions"
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs_match_hf(done[f"p{i}"], prompt, hf_log_softmax(hf_model, prompt))


def test_logit_bias_changes_greedy_tokens_like_numpy_on_hf_logits(engine, hf_model):
    prompt = list(range(100, 140))
    row = hf_log_softmax(hf_model, prompt)[-1]
    order = np.argsort(row)[::-1]
    bias = {int(order[0]): -100.0, int(order[4]): float(row[order[0]] - row[order[4]]) + 1.0}
    expected = row.copy()
    for token, value in bias.items():
        expected[token] += value
    params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=bias, logprobs=1)
    out = _serve(engine, [EngineRequest("bias", prompt, params)])["bias"]
    assert out.token_ids == [int(np.argmax(expected))] == [int(order[4])]
    assert abs(out.outputs[0].logprobs[0].logprob - row[order[4]]) < 1e-4  # reported logprobs stay raw
    forced = _serve(
        engine,
        [
            EngineRequest(
                "force",
                prompt,
                SamplingParams(
                    max_tokens=4, temperature=0.7, seed=3, ignore_eos=True, logit_bias={int(order[-1]): 100.0}
                ),
            )
        ],
    )["force"]
    assert forced.token_ids == [int(order[-1])] * 4
