"""Speculative decoding (issue 35, ngram): exact under greedy, the target distribution under sampling.

References are independent of the code under test: the same engine configuration with
`speculative_config` off, HF transformers' greedy `generate` on the same safetensors, and a
brute-force Python n-gram search. One pair of engines (speculation on / off) serves the module:
a small page pool (preemption), a small token budget (chunked prefill) and prefix caching on
(a second round of the same prompts hits the cache).
"""

import math

import numpy as np
import pytest
from engine_testing import drain, spec_engine
from hf_reference import assert_greedy_match, hf_greedy
from test_engine_hf import assert_all_free

from configs.schema import ConfigError, config_from_dict
from configs.speculative import SpeculativeConfig, parse_speculative_config
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.speculative import verify as verify_module
from runtime.speculative.ngram import propose_ngram
from runtime.types import EngineRequest, SamplingParams, StructuredOutput

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
# Copy-heavy prompts (drafts get accepted) and one without repeats at first (drafts come later, or fail).
PROMPTS = [
    "a b c d a b c d a b c d a b",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) + 1\n\ndef f(x):\n",
    "hello world hello world hello",
    "the quick brown fox jumps over the lazy dog; the quick brown",
    "zq",
]
NUM_TOKENS = 20


def _engine(family_path, spec, **overrides):
    return spec_engine(family_path, spec, **overrides)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return _engine(path, SPEC), _engine(path, None)


def _serve(engine, requests):
    for request in requests:
        engine.add_request(request)
    done = drain(engine)
    assert_all_free(engine)
    return {rid: out.outputs[0] for rid, out in done.items()}


def _greedy_requests(tokenizer, tag):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [EngineRequest(f"{tag}{i}", tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
    many = [EngineRequest(f"{tag}x{i}", tokenizer.encode(PROMPTS[i % 4] * 2), params) for i in range(6)]
    return reqs + many


def assert_drafting_compiles_nothing(engine) -> None:
    """A sealed (`aot_compile_all`) speculating engine serves the mixed workload of
    tests/test_no_compile_after_startup.py plus greedy and sampled drafting requests without one XLA
    compilation (JAX's own compile log), drafts, and frees every page and slot."""
    import logging

    import jax
    from test_no_compile_after_startup import CompileCounter, mixed_requests

    assert engine.speculator.verify.sealed
    counter, logger = CompileCounter(), logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    try:
        drafting = [
            EngineRequest(f"c{i}-{t}", engine.tokenizer.encode(p), SamplingParams(max_tokens=12, temperature=t, seed=i))
            for i, p in enumerate(PROMPTS)
            for t in (0.0, 1.0)
        ]
        for request in mixed_requests(engine.model.cfg.vocab_size) + drafting:
            engine.add_request(request)
        drain(engine)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
    assert counter.compiled == [], f"compiled after start-up: {counter.compiled}"
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert_all_free(engine)


# ---- configuration -----------------------------------------------------------------------------
def test_config_parsing_and_refusals():
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None
    assert parse_speculative_config('{"method": "ngram"}') == SpeculativeConfig()
    assert EngineConfig(model="m", speculative_config=SPEC).speculative_config.num_speculative_tokens == 3
    cases = {
        "draft": ({"method": "draft_model"}, "method 'draft_model' needs the draft checkpoint's path"),
        "draft_tp": (
            {"method": "draft_model", "model": "d", "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size: not supported yet",
        ),
        "model_field": ({"method": "ngram", "model": "d"}, "model: only for method 'draft_model'"),
        "unknown": ({"method": "eagle"}, "unknown method 'eagle'"),
        "k": ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: must be in [1, 16]"),
        "order": ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds prompt_lookup_max"),
        "field": ({"method": "ngram", "lookahead": 2}, "unknown field(s) ['lookahead']"),
        "type": ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
        "batch": ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size: must be in"),
    }
    for value, message in cases.values():
        with pytest.raises(ConfigError, match=None) as err:
            config_from_dict({"speculative_config": value})
        assert message in str(err.value) and "speculative_config" in str(err.value)
        with pytest.raises(ValueError) as err:
            EngineConfig(model="m", speculative_config=value)
        assert message in str(err.value)
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2}).method == "mtp"  # built
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_speculative_config("{method: ngram")


def test_the_cli_flag_and_yaml_key_reach_the_engine_config(tmp_path):
    from configs.schema import load_config
    from runtime.engine.loading import engine_config_from_launch
    from server.cli import _load, _parser

    launch = _load(
        _parser().parse_args(["config", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}'])
    )
    assert engine_config_from_launch(launch, "m").speculative_config == SpeculativeConfig(prompt_lookup_max=3)
    assert engine_config_from_launch(_load(_parser().parse_args(["config"])), "m").speculative_config is None
    path = tmp_path / "spec.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    assert load_config(path).speculative_config["num_speculative_tokens"] == 2


# ---- drafting ----------------------------------------------------------------------------------
def _brute_force_ngram(tokens, k, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence before the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(300):
        tokens = rng.integers(0, 4 if trial % 2 else 12, size=int(rng.integers(1, 40))).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        assert propose_ngram(np.array(tokens), k, lo, hi) == _brute_force_ngram(tokens, k, lo, hi), (tokens, k, lo, hi)


# ---- exactness ---------------------------------------------------------------------------------
def test_greedy_equals_no_speculation_and_hf(engines, hf_model):
    spec, off = engines
    tokenizer = spec.tokenizer
    before = spec.stats()
    results = {}
    for name, engine in (("spec", spec), ("off", off)):
        results[name] = _serve(engine, _greedy_requests(tokenizer, "g"))  # chunked prefill, preemption
        results[name].update(_serve(engine, _greedy_requests(tokenizer, "h")))  # the same prompts: prefix hits
    stats = spec.stats()
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, stats  # drafts both accepted and rejected
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert set(results["spec"]) == set(results["off"])
    for rid, got in results["spec"].items():
        ref = results["off"][rid]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), rid
        assert len(got.token_ids) == NUM_TOKENS
    hf = hf_model("llama")
    for i, prompt in enumerate(PROMPTS[:3]):
        expected, scores = hf_greedy(hf, tokenizer.encode(prompt), NUM_TOKENS)
        assert_greedy_match(results["spec"][f"g{i}"].token_ids, expected, scores, prompt)


def test_stops_inside_accepted_drafts_end_where_no_speculation_does(engines):
    """Stop tokens, stop strings and max_tokens falling inside a run of accepted drafts."""
    spec, off = engines
    tokenizer = spec.tokenizer
    prompt = tokenizer.encode(PROMPTS[1] * 2)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    reference = _serve(off, [EngineRequest("ref", prompt, greedy)])["ref"]
    tokens, text = reference.token_ids, reference.text
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 2, 5, 7)]
    params += [SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop_token_ids=[t]) for t in tokens[2:9:3]]
    params += [SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop=[text[n : n + 3]]) for n in (4, 9, 15)]
    requests = [EngineRequest(f"s{i}", prompt, p) for i, p in enumerate(params)]
    got, ref = _serve(spec, requests), _serve(off, requests)
    for rid in ref:
        a, b = got[rid], ref[rid]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        ), rid


def _accepted(engine, before):
    return engine.stats()["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]


def test_logprobs_compose_with_drafts(engines):
    """Requests asking for logprobs draft; each accepted token's logprob and top alternatives are
    the ones the engine without speculation reports for it (raw logits of its own verify row)."""
    spec, off = engines
    params = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=5, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True),  # shares the verify steps
    ]
    prompts = [spec.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[1])]
    requests = [EngineRequest(f"l{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
    before = spec.stats()
    got, ref = _serve(spec, requests), _serve(off, requests)
    assert _accepted(spec, before) > 0, spec.stats()
    for rid in ("l0", "l1"):
        assert got[rid].token_ids == ref[rid].token_ids, rid
        assert len(got[rid].logprobs) == NUM_TOKENS
        for a, b in zip(got[rid].logprobs, ref[rid].logprobs):
            assert a.token_id == b.token_id
            np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-4, atol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top], rid
            np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], rtol=1e-4, atol=1e-4)
    assert got["l2"].token_ids == ref["l2"].token_ids


PENALTIES = {
    "repetition": dict(repetition_penalty=1.2),
    "frequency": dict(frequency_penalty=0.3),
    "presence": dict(presence_penalty=0.4),
    "all": dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
}


def test_penalties_compose_with_drafts(engines):
    """Greedy requests with each penalty draft; every verify row counts the output so far plus the
    drafts before it, so the output equals the engine without speculation's."""
    spec, off = engines
    prompts = [spec.tokenizer.encode(p) for p in (PROMPTS[0] * 2, PROMPTS[1], PROMPTS[2] * 2)]
    requests = [
        EngineRequest(
            f"q{name}{i}", prompt, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kw)
        )
        for name, kw in PENALTIES.items()
        for i, prompt in enumerate(prompts)
    ]
    before = spec.stats()
    got = _serve(spec, requests)
    drafted = spec.stats()["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = _accepted(spec, before)
    ref = _serve(off, requests)
    assert 0 < accepted < drafted, spec.stats()
    for rid in ref:
        assert (got[rid].token_ids, got[rid].text) == (ref[rid].token_ids, ref[rid].text), rid


# ---- sampling ----------------------------------------------------------------------------------
def _sampled(engine, prompt, n, seed0, tag, top_k=3):
    params = [
        SamplingParams(max_tokens=6, temperature=1.0, top_k=top_k, seed=seed0 + i, ignore_eos=True) for i in range(n)
    ]
    out = _serve(engine, [EngineRequest(f"{tag}{i}", prompt, p) for i, p in enumerate(params)])
    return np.array([out[f"{tag}{i}"].token_ids for i in range(n)])


def test_seeded_sampling_equals_no_speculation(engines):
    """The verify row's random key is the output index's, as in a plain step: same seed, same tokens."""
    spec, off = engines
    prompt = spec.tokenizer.encode(PROMPTS[2])
    np.testing.assert_array_equal(_sampled(spec, prompt, 24, 7, "e"), _sampled(off, prompt, 24, 7, "e"))


def _chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square test of the token counts at each output position (independent
    samples), positions pooled: -> p-value (Wilson-Hilferty's normal approximation of the
    chi-square tail, ample at these thresholds)."""
    stat, dof = 0.0, 0
    for pos in range(a.shape[1]):
        cats = np.union1d(a[:, pos], b[:, pos])
        ca = np.array([(a[:, pos] == c).sum() for c in cats], float)
        cb = np.array([(b[:, pos] == c).sum() for c in cats], float)
        keep = (ca + cb) >= 5  # rare categories pooled into one
        ca = np.append(ca[keep], ca[~keep].sum())
        cb = np.append(cb[keep], cb[~keep].sum())
        ca, cb = ca[(ca + cb) > 0], cb[(ca + cb) > 0]
        total = ca + cb
        ea, eb = total * len(a) / (len(a) + len(b)), total * len(b) / (len(a) + len(b))
        stat += float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
        dof += len(total) - 1
    dof = max(dof, 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _copy_rate_p(a: np.ndarray, b: np.ndarray, prompt: list[int]) -> float:
    """Two-sample test (two-sided, normal approximation) of how often an output token equals the
    n-gram continuation of its context (brute force): the statistic speculation could bias."""

    def copies(rows):
        hits = []
        for row in rows.tolist():
            for j in range(1, len(row)):
                draft = _brute_force_ngram(prompt + row[:j], 1, SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"])
                hits.append(bool(draft) and draft[0] == row[j])
        return np.array(hits, float)

    x, y = copies(a), copies(b)
    pooled = (x.sum() + y.sum()) / (len(x) + len(y))
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / len(x) + 1 / len(y)))
    return math.erfc(abs(x.mean() - y.mean()) / se / math.sqrt(2))


@pytest.mark.slow
def test_temperature_one_matches_the_target_distribution(engines, monkeypatch):
    """Independent seeds, temperature 1 over a top-3 vocabulary: the token counts at every output
    position agree with no speculation; with acceptance made wrong (every draft accepted) the same
    test rejects."""
    spec, off = engines
    prompt = spec.tokenizer.encode(PROMPTS[2])
    n = 240
    before = spec.stats()
    reference = _sampled(off, prompt, n, 10_000, "r")
    speculated = _sampled(spec, prompt, n, 20_000, "s")
    stats = spec.stats()
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, stats
    assert min(_chi_square_p(speculated, reference), _copy_rate_p(speculated, reference, prompt)) > 1e-3

    monkeypatch.setattr(verify_module, "accepted_counts", lambda tokens, verify: verify.num_draft)
    old = spec.speculator.verify
    spec.speculator.verify = verify_module.VerifyExecutables(spec.executables, spec.caches, spec.token_buckets, 256)
    try:
        wrong = _sampled(spec, prompt, n, 30_000, "w")
    finally:
        spec.speculator.verify = old
    assert min(_chi_square_p(wrong, reference), _copy_rate_p(wrong, reference, prompt)) < 1e-3


def test_prometheus_counters():
    from prometheus_client import generate_latest

    from server.metrics import ServerMetrics

    stats = {
        "spec_decode_num_drafts": 2,
        "spec_decode_num_draft_tokens": 7,
        "spec_decode_num_accepted_tokens": 3,
        "spec_decode_num_accepted_tokens_per_pos": [2, 1, 0],
    }
    text = generate_latest(ServerMetrics(lambda: stats).registry).decode()
    assert "jaxserve_spec_decode_num_draft_tokens_total 7.0" in text
    assert "jaxserve_spec_decode_num_accepted_tokens_total 3.0" in text
    assert 'jaxserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text
    assert "spec_decode" not in generate_latest(ServerMetrics(lambda: {}).registry).decode()


@pytest.mark.slow
def test_no_compile_after_startup_with_speculation(tiny_checkpoint):
    """Sealed start-up set (verify executables included): a mixed workload plus copy-heavy
    greedy and sampled requests (two under a grammar: masked verify rows) compile nothing in the serving loop (JAX's own compile log).
    max_num_seqs 16: verify steps run in both sequence buckets (8 and 16) of token bucket 64."""
    import logging

    import jax
    from test_no_compile_after_startup import CompileCounter, mixed_requests

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_checkpoint("llama")),
            dtype="float32",
            page_size=16,
            num_pages=64,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            token_buckets=(8, 64),
            max_model_len=256,
            aot_compile=True,
            aot_compile_all=True,
            speculative_config=SPEC,
        )
    )
    assert engine.speculator.verify.sealed and engine.async_scheduling  # kept for steps that cannot draft
    exes, buckets_run = engine.speculator.verify, set()
    run = exes.run
    exes.run = lambda params, caches, inputs, verify, *rest: (
        buckets_run.add((exes._token_count(inputs), verify.num_draft.shape[0]))
        or run(params, caches, inputs, verify, *rest)
    )
    counter = CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    try:
        copy_heavy = [
            EngineRequest(f"c{i}-{t}", engine.tokenizer.encode(p), SamplingParams(max_tokens=12, temperature=t, seed=i))
            for i, p in enumerate(PROMPTS)
            for t in (0.0, 1.0)
        ]
        regex = StructuredOutput("regex", r"( ?[a-d])+")  # the prompt's n-grams are allowed: masked verify rows
        copy_heavy += [
            EngineRequest(f"r{t}", engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=12, temperature=t,
                          structured_output=regex))
            for t in (0.0, 1.0)
        ]  # fmt: skip
        for request in mixed_requests(engine.model.cfg.vocab_size) + copy_heavy:
            engine.add_request(request)
        drain(engine)
        for request in copy_heavy:  # alone: every step verifies
            engine.add_request(EngineRequest(request.request_id + "'", request.prompt_token_ids, request.params))
        drain(engine)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
    assert counter.compiled == [], f"compiled after start-up: {counter.compiled}"
    assert {(64, 8), (64, 16)} <= buckets_run, buckets_run
    assert {key[:2] for key in exes.executables} == {(8, 8), (64, 8), (64, 16)}
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(engine)


def test_disable_by_batch_size_stops_drafting_in_large_batches(engines):
    import dataclasses

    spec, off = engines
    config = spec.speculator.config
    prompt = spec.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"b{i}", prompt, params) for i in range(3)]
    spec.speculator.config = dataclasses.replace(config, disable_by_batch_size=2)
    try:
        before = spec.stats()["spec_decode_num_draft_tokens"]
        got = _serve(spec, requests)  # three running: no drafts
        assert spec.stats()["spec_decode_num_draft_tokens"] == before
        _serve(spec, [EngineRequest("b-alone", prompt, params)])  # one running: drafts
        assert spec.stats()["spec_decode_num_draft_tokens"] > before
    finally:
        spec.speculator.config = config
    ref = _serve(off, requests)
    assert all(got[rid].token_ids == ref[rid].token_ids for rid in ref)


def test_disable_by_batch_size_auto_is_the_plans_measured_crossover():
    from runtime.steps.execution_plan import SPEC_DISABLE_BY_BATCH_SIZE_CPU, _spec_disable_by_batch_size

    auto = parse_speculative_config({"method": "ngram"})
    assert auto.disable_by_batch_size == "auto"
    assert _spec_disable_by_batch_size(auto, "cpu") == SPEC_DISABLE_BY_BATCH_SIZE_CPU == 16
    assert _spec_disable_by_batch_size(auto, "gpu") is None  # not measured there: always draft
    never = parse_speculative_config({"method": "ngram", "disable_by_batch_size": None})
    assert _spec_disable_by_batch_size(never, "cpu") is None
    assert _spec_disable_by_batch_size(SpeculativeConfig(disable_by_batch_size=3), "tpu") == 3
    assert _spec_disable_by_batch_size(None, "cpu") is None
    with pytest.raises(ValueError, match="disable_by_batch_size: must be an integer"):
        parse_speculative_config({"method": "ngram", "disable_by_batch_size": "often"})


def test_threshold_crossed_mid_run_equals_no_speculation(engines, monkeypatch):
    """Four greedy requests of different lengths: while more than two decode no step drafts; as they
    finish the batch falls under the threshold and drafting resumes. Outputs equal no speculation."""
    import dataclasses

    spec, off = engines
    speculator = spec.speculator
    assert speculator.config.disable_by_batch_size == 16  # "auto" resolved by the CPU plan
    seen = []  # per schedule: (decoding requests, drafted tokens)
    propose = speculator.propose

    def recording(running):
        propose(running)
        decoding = sum(req.num_tokens - req.num_computed_tokens == 1 for req in running)
        seen.append((decoding, sum(len(req.draft_token_ids) for req in running)))

    monkeypatch.setattr(speculator, "propose", recording)
    monkeypatch.setattr(speculator, "config", dataclasses.replace(speculator.config, disable_by_batch_size=2))
    prompts = [spec.tokenizer.encode(p) for p in PROMPTS[:4]]
    requests = [
        EngineRequest(f"m{i}", prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for i, (prompt, m) in enumerate(zip(prompts, (3, 6, 12, NUM_TOKENS)))
    ]
    before = spec.stats()
    got, ref = _serve(spec, requests), _serve(off, requests)
    stats = spec.stats()
    assert any(d > 2 for d, _ in seen) and all(n == 0 for d, n in seen if d > 2), seen  # crowded: no drafts
    assert any(n > 0 for d, n in seen if d <= 2), seen  # under the threshold: drafts
    assert stats["spec_decode_num_disabled_steps"] > before["spec_decode_num_disabled_steps"]
    assert stats["spec_decode_num_draft_tokens"] > before["spec_decode_num_draft_tokens"]
    for rid in ref:
        assert (got[rid].token_ids, got[rid].text) == (ref[rid].token_ids, ref[rid].text), rid


def test_metrics_endpoint_reports_the_spec_decode_counters(engines):
    """A live server on the speculating engine: /metrics (scraped over HTTP, parsed by
    prometheus_client) reports vLLM's counters and acceptance per position equal to `stats()`,
    after a copy-heavy request whose drafts were accepted. Last in the module: the engine's loop
    runs on the server's thread."""
    import asyncio

    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    from runtime.engine.thread_client import AsyncEngine
    from server.testing import LiveServer

    spec, _ = engines
    engine = AsyncEngine(spec, "tiny-model")
    live = LiveServer(engine)

    async def go():
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny-model", "prompt": PROMPTS[0] * 2, "max_tokens": NUM_TOKENS, "temperature": 0}
            async with session.post(live.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            async with session.get(live.url + "/metrics") as r:
                return await r.text()

    try:
        text = asyncio.run(go())
        stats = spec.stats()
    finally:
        live.close()
        asyncio.run(engine.shutdown())
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, s.labels.get("position"))] = s.value
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_disabled_steps"):
        assert samples[(f"jaxserve_spec_decode_{name}_total", None)] == stats[f"spec_decode_{name}"], name
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == SPEC["num_speculative_tokens"]
    for position, value in enumerate(per_pos):
        assert samples[("jaxserve_spec_decode_num_accepted_tokens_per_pos_total", str(position))] == value
