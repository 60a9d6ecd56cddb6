"""Structured output and tool calls through the real engine, with a tiny *random* checkpoint.

A random model follows a grammar only if the mask is right, so it is the perfect subject:
at temperature 1 it spreads its choices over whatever the mask allows. References are
independent of our code: `jsonschema` validates JSON outputs, Python's `re` the regex outputs,
the official `openai` client (with a pydantic model for `chat.completions.parse`) talks to
the server, and llguidance's own numpy bitmask application checks the jitted unpacking.
Requests are sent concurrently, so each batch runs as one engine workload.
"""

import asyncio
import json
import re
from typing import Literal

import jsonschema
import numpy as np
import openai
import pytest
from engine_testing import live_engine_server
from pydantic import BaseModel, Field

from models import load_model
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from tests.structured_cases import ADD_TOOL, TOOLS, WEATHER_TOOL, choice_lists, json_schemas, regexes

FAMILY = "llama"
MODEL = "tiny-model"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model = load_model(tiny_checkpoint(FAMILY), dtype="float32")
    config = EngineConfig(
        model=str(model.path),
        dtype="float32",
        max_num_seqs=32,
        max_num_batched_tokens=256,
        token_buckets=(32, 256),
        max_model_len=1024,
        fuse_greedy=False,
        seed=0,
    )
    return LLMEngine(config, model=model)


@pytest.fixture(scope="module")
def server(engine):
    with live_engine_server(engine, MODEL, max_waiting_requests=1024) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _gather(server, make_calls):
    """Run `make_calls(async_client)` -> coroutines concurrently; returns their results."""

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*make_calls(client))

    return asyncio.run(main())


def _chat(client, seed: int, max_tokens: int = 300, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"case {seed}"}],
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        **kwargs,
    )


def test_bitmask_unpacking_matches_llguidance_reference():
    from llguidance.numpy import apply_token_bitmask_inplace

    from runtime.steps.sampler import apply_token_bitmask

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 1031)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(5, 33), dtype=np.int64).astype(np.int32)
    bitmask[3] = -1  # a row without grammar
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, bitmask)
    got = np.asarray(apply_token_bitmask(logits, bitmask))
    np.testing.assert_array_equal(got, expected)
    assert np.isneginf(got[0, 1024:]).sum() == np.count_nonzero(
        ~np.unpackbits(bitmask[0, 32:].view(np.uint8), bitorder="little")[:7].astype(bool)
    )


def test_200_json_schemas_strict_validate(server, engine):
    schemas = json_schemas(200)
    compiled_before = set(engine.executables.compile_seconds)
    responses = _gather(
        server,
        lambda c: [
            _chat(
                c,
                i,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"case_{i}", "schema": schema, "strict": True},
                },
            )
            for i, schema in enumerate(schemas)
        ],
    )
    failures = []
    for i, (schema, response) in enumerate(zip(schemas, responses)):
        choice = response.choices[0]
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.message.content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as err:
            failures.append((i, str(err)[:200], choice.message.content, json.dumps(schema)))
    assert not failures, "\n".join(map(repr, failures))
    assert set(engine.executables.compile_seconds) == compiled_before  # grammars joined: no new executable


def test_50_regexes_and_20_choice_lists(server):
    patterns, lists = regexes(50), choice_lists(20)

    def calls(client):
        out = [
            client.completions.create(
                model=MODEL,
                prompt=f"regex {i}",
                temperature=1.0,
                seed=i,
                max_tokens=60,
                extra_body={"structured_outputs": {"regex": pattern}},
            )
            for i, pattern in enumerate(patterns)
        ]
        out += [
            _chat(client, i, max_tokens=40, extra_body={"structured_outputs": {"choice": choices}})
            for i, choices in enumerate(lists)
        ]
        return out

    responses = _gather(server, calls)
    for pattern, response in zip(patterns, responses[:50]):
        assert response.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, response.choices[0].text), (pattern, response.choices[0].text)
    for choices, response in zip(lists, responses[50:]):
        assert response.choices[0].finish_reason == "stop"
        assert response.choices[0].message.content in choices


class Verdict(BaseModel):
    verdict: Literal["yes", "no", "unsure"]
    score: int = Field(ge=0, le=10)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


def test_parse_with_pydantic_model_and_streaming(client):
    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "judge"}],
        response_format=Verdict,
        temperature=1.0,
        seed=3,
        max_tokens=80,
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in _chat(client, 5, stream=True, response_format={"type": "json_object"})
        if chunk.choices
    )
    assert isinstance(json.loads(text), dict)


def test_length_cut_is_a_valid_prefix(client):
    schema = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"enum": ["abc", "de"]}, "minItems": 40, "maxItems": 40}},
        "required": ["xs"],
        "additionalProperties": False,
    }
    choice = _chat(
        client,
        1,
        max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}},
    ).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith('{"xs":["')


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_100_of_100(server, tool_choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    responses = _gather(
        server,
        lambda c: [
            _chat(c, i, max_tokens=80, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
            for i in range(100)
        ],
    )
    names = set()
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        names.add(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert names == {"get_weather"}
    else:
        assert names <= set(schemas)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)
def test_bad_grammars_are_400_with_openai_error(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=body
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"


def test_engine_is_clean_after_grammar_requests(server, engine, client):
    _chat(client, 0, max_tokens=20, tools=[ADD_TOOL], tool_choice="required")
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert len(engine.structured_output) == 0  # every matcher released
