"""Asynchronous scheduling: stops found one step late end requests exactly where the synchronous
engine and HF say, and leak nothing.

One engine serves the same batch twice, with `async_scheduling` on and off. Every request is the
same greedy prompt (HF `generate` is the reference) ending at a different position: a stop string
spanning two or three tokens (also cut mid-token) completing at each output position, `max_tokens`
at each position, a stop token id at each position, and a stop token that is also the last token
`max_tokens` allows (the length finish decided on a placeholder must become "stop"). Stops are
found while the next step is already in flight (checked: steps are scheduled with placeholders).
"""

import pytest
from engine_testing import drain
from hf_reference import hf_greedy
from test_engine_hf import assert_all_free

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.scheduled import PLACEHOLDER_TOKEN
from runtime.types import EngineRequest, SamplingParams

NUM_TOKENS = 10
PROMPT = "def fibonacci(n):\n    return"


def _reference(tokenizer, hf, prompt_ids):
    tokens, _ = hf_greedy(hf, prompt_ids, NUM_TOKENS)
    texts = [tokenizer.decode(tokens[:k]) for k in range(NUM_TOKENS + 1)]
    return tokens, texts


def _stop_string_cases(tokens, texts):
    """(stop string, expected tokens, expected text) for stops completing at each position."""
    cases = []
    for end in range(1, NUM_TOKENS):
        for span, trim in ((2, 0), (3, 1)):
            start = end + 1 - span
            if start < 0:
                continue
            stop = texts[end + 1][len(texts[start]) + trim : len(texts[end + 1]) - trim or None]
            if not stop.strip() or "\ufffd" in texts[end + 1]:
                continue
            k = next(k for k in range(NUM_TOKENS + 1) if stop in texts[k])  # the token completing it
            cases.append((stop, tokens[:k], texts[k][: texts[k].index(stop)]))
    return cases


def _requests(tokens, texts, prompt_ids):
    """-> [(EngineRequest, expected token ids, expected text or None, finish_reason, stop_reason)]"""
    cases = []
    for _i, (stop, ids, text) in enumerate(_stop_string_cases(tokens, texts)):
        cases.append(
            (
                SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop]),
                ids,
                text,
                "stop",
                stop,
            )
        )
    for m in range(1, NUM_TOKENS + 1):
        cases.append(
            (SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), tokens[:m], texts[m], "length", None)
        )
    for j, token in enumerate(tokens):
        first = tokens.index(token)
        cases.append(
            (
                SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[token]),
                tokens[: first + 1],
                None,
                "stop",
                token,
            )
        )
        if first == j:  # a stop token that is also the last token max_tokens allows
            cases.append(
                (
                    SamplingParams(max_tokens=j + 1, temperature=0.0, ignore_eos=True, stop_token_ids=[token]),
                    tokens[: j + 1],
                    None,
                    "stop",
                    token,
                )
            )
    return [(EngineRequest(f"r{i}", prompt_ids, params), *expected) for i, (params, *expected) in enumerate(cases)]


def _serve(engine, requests):
    placeholders = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        placeholders.extend(s.request_id for s in out.sequences if PLACEHOLDER_TOKEN in s.token_ids)
        return out

    engine.scheduler.schedule = recording_schedule
    try:
        for request, *_ in requests:
            engine.add_request(request)
        done = drain(engine)
    finally:
        del engine.scheduler.schedule
    assert_all_free(engine)
    return done, placeholders


@pytest.mark.parametrize("family", ["llama"])
def test_stops_with_a_step_in_flight_equal_sync_and_hf(family, tiny_checkpoint, hf_model):
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint(family)),
            dtype="float32",
            page_size=4,
            num_pages=96,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=128,
            token_buckets=(8, 16, 32, 64),
        )
    )
    assert engine.async_scheduling  # the default
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    tokens, texts = _reference(tokenizer, hf_model(family), prompt_ids)
    requests = _requests(tokens, texts, prompt_ids)
    num_stop_strings = sum(1 for r in requests if r[3] == "stop" and r[2] is not None)
    assert num_stop_strings >= NUM_TOKENS, (tokens, texts)

    results = {}
    for mode in (True, False):
        engine.async_scheduling = mode
        results[mode], placeholders = _serve(engine, requests)
        assert bool(placeholders) is mode  # async: steps were planned before the tokens were known
    for request, ids, text, reason, stop_reason in requests:
        got, sync = results[True][request.request_id].outputs[0], results[False][request.request_id].outputs[0]
        what = f"{request.request_id} {request.params}"
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            sync.token_ids,
            sync.text,
            sync.finish_reason,
            sync.stop_reason,
        ), what
        assert got.token_ids == ids, what
        assert (got.finish_reason, got.stop_reason) == (reason, stop_reason), what
        if text is not None:
            assert got.text == text, what


def test_the_async_scheduling_switch_reaches_the_engine_config():
    from runtime.engine.loading import engine_config_from_launch
    from server.cli import _load, _parser

    on, off = (_load(_parser().parse_args(["config", *flags])) for flags in ([], ["--no-async-scheduling"]))
    assert on.scheduler.async_scheduling and not off.scheduler.async_scheduling
    assert engine_config_from_launch(off, "m").async_scheduling is False
    assert engine_config_from_launch(on, "m").async_scheduling is True
    assert EngineConfig(model="m").async_scheduling
