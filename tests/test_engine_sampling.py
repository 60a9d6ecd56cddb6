"""Seeded sampling through the engine: the same request gives the same tokens whatever else runs
beside it, in whatever order; stop conditions end requests where the reference says."""

import numpy as np
import pytest
from engine_testing import drain
from hf_reference import hf_greedy

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint("qwen3_5")),
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_pages=80,
            max_model_len=256,
        )
    )


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    return drain(engine)


def test_seeded_sampling_independent_of_batch(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, size=int(n)).tolist() for n in rng.integers(1, 90, size=6)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i, ignore_eos=True)
        for i in range(6)
    ]
    together = _run(engine, [EngineRequest(f"a{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    alone = _run(engine, [EngineRequest("b3", prompts[3], params[3])])
    reversed_order = _run(engine, [EngineRequest(f"c{i}", prompts[i], params[i]) for i in reversed(range(6))])
    for i in range(6):
        assert together[f"a{i}"].token_ids == reversed_order[f"c{i}"].token_ids
    assert alone["b3"].token_ids == together["a3"].token_ids
    unseeded = _run(engine, [EngineRequest(f"d{i}", prompts[0], params[0].replace(seed=None)) for i in range(3)])
    assert len({tuple(o.token_ids) for o in unseeded.values()}) > 1, "unseeded requests should differ"


def test_max_tokens_and_stop_token(engine):
    prompt = list(range(5, 25))
    greedy = _run(engine, [EngineRequest("g", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])
    tokens = greedy["g"].token_ids
    assert len(tokens) == 8 and greedy["g"].finish_reason == "length"
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    out = _run(
        engine,
        [
            EngineRequest(
                "s", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))
            )
        ],
    )["s"]
    assert (
        out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    )


def test_bad_requests_rejected_cleanly(engine):
    with pytest.raises(ValueError, match="token id 1000000 is out of vocabulary"):
        engine.add_request(EngineRequest("bad1", [5, 10**6], SamplingParams()))
    with pytest.raises(ValueError, match="maximum context length of 256"):
        engine.add_request(EngineRequest("bad2", list(range(3, 300)), SamplingParams()))
    s = engine.stats()
    assert s["num_waiting"] == 0 and s["num_running"] == 0
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"]
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"]


def test_min_tokens_bans_stop_tokens_until_reached(engine, hf_model):
    """Before min_tokens outputs, a stop token is never sampled: the first token is HF's argmax
    over the prompt's logits with that token removed; after min_tokens it stops the request."""
    import torch

    prompt = list(range(40, 70))
    greedy = _run(
        engine, [EngineRequest("m0", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    )["m0"].token_ids
    banned = greedy[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=(banned,), min_tokens=2)
    out = _run(engine, [EngineRequest("m1", prompt, params)])["m1"]
    with torch.no_grad():
        logits = hf_model("qwen3_5")(torch.tensor([prompt])).logits[0, -1].float().numpy()
    logits[banned] = -np.inf
    assert out.token_ids[0] == int(np.argmax(logits)) != banned
    assert banned not in out.token_ids[:2]
    # After min_tokens the stop token is allowed again and ends the request; HF's own greedy
    # continuation of the first two tokens says whether (and where) it comes.
    hf_rest, _ = hf_greedy(hf_model("qwen3_5"), prompt + out.token_ids[:2], 4)
    expected = out.token_ids[:2] + (hf_rest[: hf_rest.index(banned) + 1] if banned in hf_rest else hf_rest)
    assert out.token_ids == expected
    assert out.finish_reason == ("stop" if banned in hf_rest else "length")
