"""Issue 31 through the real engine with tiny *random* checkpoints: agent loops end to end with
real clients, and the grammar rules that only a real engine can show.

A random model writes garbage text, so the loops force their calls with the grammar
(`tool_choice: "required"` or a named function): the shapes are then deterministic, and the
tests assert on them, on parsing and on round trips, and that each later turn is accepted and
rendered (the prompt the server rendered, read from a recording engine client, grows and holds
the earlier calls and tool results). References: the official `openai` client, `langchain-openai`
and `openai-agents` (each validates what it receives), `jsonschema` for every call's arguments.

* A tiny Llama (ChatML template without tools or `<think>`; a model that never thinks), the
  server with `--reasoning-parser qwen3` and `max_tool_calls: 2`: the grammar applies from the
  first token (issue 31.2) and bounds the calls (31.3).
* A tiny GDN hybrid (Qwen3.5 layout) whose tokenizer has `<think>` / `</think>` tokens, served
  with a Qwen-style template (`tests/chat_templates.py`) and the reasoning parser: the agent
  loops, and a model that thinks (a `logit_bias` on `</think>` makes the random model close its
  reasoning at once, so the grammar's start can be seen).
"""

import asyncio
import dataclasses
import json
import re
import shutil
from typing import Annotated, ClassVar, Literal

import jsonschema
import openai
import pytest
from engine_testing import live_engine_server
from pydantic import Field

from models import load_model
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from tests.chat_templates import QWEN_STYLE, QWEN_THINKING_STYLE
from tests.structured_cases import ADD_TOOL, TOOLS, WEATHER_TOOL

MODEL = "tiny-model"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt(live, index: int = -1) -> str:
    return live.engine.tokenizer.decode(live.engine.requests[index].prompt_token_ids)


def _check_call(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


def _gather(live, make_calls):
    async def main():
        async with openai.AsyncOpenAI(
            base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*make_calls(client))

    return asyncio.run(main())


# ------------------------------------------------------------------ a model that never thinks


@pytest.fixture(scope="module")
def llama_server(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama"), dtype="float32")
    config = EngineConfig(
        aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
        model=str(model.path),
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=256,
        token_buckets=(16, 256),
        max_model_len=1024,
        fuse_greedy=False,
        seed=0,
    )
    with live_engine_server(
        LLMEngine(config, model=model),
        MODEL,
        max_waiting_requests=256,
        record=True,
        reasoning_parser="qwen3",
        max_tool_calls=2,
    ) as live:
        yield live


def _chat(client, seed: int, **kwargs):
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"case {seed}"}], temperature=1.0, seed=seed, **kwargs
    )


def test_reasoning_parser_keeps_the_grammar_of_a_model_that_does_not_think(llama_server):
    """Regression (issue 31.2): with --reasoning-parser qwen3, json_object returned prose, a
    regex was ignored and tool_choice "required" returned no calls, all with a 200."""
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS["get_weather"]}}
    responses = _gather(
        llama_server,
        lambda c: [
            *[_chat(c, i, response_format={"type": "json_object"}, max_tokens=24) for i in range(4)],
            *[_chat(c, i, response_format=schema) for i in range(4)],
            *[
                _chat(c, i, max_tokens=20, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
                for i in range(4)
            ],
            *[_chat(c, i, tools=TOOLS, tool_choice="required", parallel_tool_calls=False) for i in range(4)],
        ],
    )
    for response in responses[:4]:  # an unbounded object: a random model may run to max_tokens
        message = response.choices[0].message
        assert message.content.startswith("{") and message.model_extra["reasoning_content"] is None
    for response in responses[4:8]:
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["get_weather"])
    for response in responses[8:12]:
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", response.choices[0].message.content)
    for response in responses[12:]:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])
    grammar = llama_server.engine.requests[-1].params.structured_output
    assert grammar.start_after == () and grammar.optional_block == ()


def test_forced_calls_are_bounded_by_the_grammar(llama_server):
    """Regression (issue 31.3): parallel calls were unbounded. Here 1..2 calls (max_tool_calls 2),
    exactly one without parallel_tool_calls; streaming and non-streaming read alike."""
    responses = _gather(
        llama_server,
        lambda c: [
            *[_chat(c, i, tools=[ADD_TOOL], tool_choice="required", max_tokens=200) for i in range(12)],
            *[
                _chat(c, i, tools=[ADD_TOOL], tool_choice="required", max_tokens=200, parallel_tool_calls=False)
                for i in range(4)
            ],
        ],
    )
    counts = [len(r.choices[0].message.tool_calls) for r in responses]
    assert all(r.choices[0].finish_reason == "tool_calls" for r in responses)
    assert set(counts[:12]) <= {1, 2} and 2 in counts[:12], counts  # the random model does use the room
    assert counts[12:] == [1] * 4
    for response in responses:
        assert response.choices[0].message.content is None
        for call in response.choices[0].message.tool_calls:
            _check_call(call)
    seed = counts.index(2)
    whole = _chat(_client(llama_server), seed, tools=[ADD_TOOL], tool_choice="required", max_tokens=200)
    streamed = {}
    for chunk in _chat(
        _client(llama_server), seed, tools=[ADD_TOOL], tool_choice="required", max_tokens=200, stream=True
    ):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert list(streamed.values()) == [
        [c.function.name, c.function.arguments] for c in whole.choices[0].message.tool_calls
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_by_max_tokens_is_dropped(llama_server, stream):
    """Regression (issue 31.3): a forced call cut by max_tokens leaked `<tool_call>` markup into
    content next to a call with empty arguments."""
    response = _chat(
        _client(llama_server), 3, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=12, stream=stream
    )
    if stream:
        chunks = list(response)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = response.choices[0]
        content, calls, finish = choice.message.content or "", choice.message.tool_calls, [choice.finish_reason]
    assert finish == ["length"] and content == "" and calls == []


def test_bfcl_style_script_every_emitted_call_validates(llama_server):
    from benchmarks.bfcl_style import CATEGORIES, build_cases, run

    report = asyncio.run(run(llama_server.url, MODEL, build_cases(per_category=3), max_tokens=120, temperature=1.0))
    assert set(report["categories"]) == set(CATEGORIES)
    overall = report["overall"]
    assert overall["requests"] == 12 and overall["calls"] > 0
    assert overall["valid_call_rate"] == 1.0, overall["failures"]


# ------------------------------------------------------------- a hybrid with a Qwen-style template


@pytest.fixture(scope="module")
def hybrid_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen3.5-layout hybrid, its tokenizer given `<think>` / `</think>` tokens (ids
    1000, 1001: unused rows of its 1031-row embedding), as Qwen's tokenizers have them."""
    from transformers import AutoTokenizer

    source = tiny_checkpoint("qwen3_5")
    target = tmp_path_factory.mktemp("hybrid-thinking")
    for path in source.iterdir():
        if path.is_file() and not path.name.startswith("tokenizer"):
            (target / path.name).symlink_to(path)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(str(target))
    yield target
    shutil.rmtree(target, ignore_errors=True)


@pytest.fixture(scope="module")
def hybrid_server(hybrid_checkpoint):
    model = load_model(hybrid_checkpoint, dtype="float32")
    config = EngineConfig(
        aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
        model=str(model.path),
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=128,
        num_pages=200,
        max_model_len=1024,
        seed=0,
    )
    with live_engine_server(
        LLMEngine(config, model=model),
        MODEL,
        max_waiting_requests=64,
        record=True,
        chat_template=QWEN_STYLE,
        reasoning_parser="qwen3",
        trust_request_chat_template=True,
    ) as live:
        yield live


def _turn_request(messages, tool_choice, **kwargs) -> dict:
    return dict(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        seed=1,
        max_tokens=kwargs.pop("max_tokens", 80),
        extra_body=NO_THINKING,
        **kwargs,
    )


def _streamed_message(stream) -> tuple[dict, str]:
    """The assistant message a streaming client rebuilds from the deltas, and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["id"] = call.id or entry["id"]
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"role": "assistant", "content": content or None, "tool_calls": list(calls.values())}, finish


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_three_turn_tool_loop_on_the_hybrid(hybrid_server, stream):
    """Turn 1 forces get_weather, turn 2 (its result sent back as the SDK returns the assistant
    message: content null + tool_calls) forces add, turn 3 answers in text."""
    client = _client(hybrid_server)
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Weather in Oslo, then add 2 and 3."},
    ]
    prompt_tokens = []
    for tool in ("get_weather", "add"):
        request = _turn_request(messages, {"type": "function", "function": {"name": tool}})
        if stream:
            message, finish = _streamed_message(
                client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
            )
        else:
            choice = client.chat.completions.create(**request).choices[0]
            message, finish = choice.message.model_dump(include={"role", "content", "tool_calls"}), choice.finish_reason
        assert finish == "tool_calls" and message["content"] is None
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == tool
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[tool])
        prompt_tokens.append(len(hybrid_server.engine.requests[-1].prompt_token_ids))
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": f"result of {tool}: 42"}]
    final = client.chat.completions.create(**_turn_request(messages, "none", max_tokens=8))
    assert final.choices[0].finish_reason == "length" and not final.choices[0].message.tool_calls
    prompt_tokens.append(final.usage.prompt_tokens)
    assert prompt_tokens == sorted(prompt_tokens) and len(set(prompt_tokens)) == 3
    rendered = _prompt(hybrid_server)
    for message in messages:
        for call in message.get("tool_calls") or []:  # the calls come back as they were written
            assert (
                f'<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": '
                f"{call['function']['arguments']}}}\n</tool_call>" in rendered
            )
    assert "<tool_response>\nresult of get_weather: 42\n</tool_response><|im_end|>" in rendered
    assert "<tool_response>\nresult of add: 42\n</tool_response><|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_langchain_bind_tools_and_tool_message_round_trip(hybrid_server):
    import langchain_openai
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Oslo", "Paris"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        return f"{city}: 21 {unit}"

    @tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two integers."""
        return a + b

    llm = langchain_openai.ChatOpenAI(
        base_url=hybrid_server.url + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=80,
        max_retries=0,
        extra_body=NO_THINKING,
    )
    bound = llm.bind_tools([get_weather, add], tool_choice="add")
    history = [HumanMessage("What is 2 + 3?")]
    reply = bound.invoke(history)
    (call,) = reply.tool_calls  # langchain parsed the arguments JSON into a dict
    assert (
        call["name"] == "add"
        and set(call["args"]) == {"a", "b"}
        and all(isinstance(v, int) for v in call["args"].values())
    )
    streamed = None
    for chunk in bound.stream(history):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    history += [reply, ToolMessage(content=str(add.invoke(call["args"])), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather, add], tool_choice="none").invoke(history, max_tokens=6)
    assert isinstance(answer.content, str) and not answer.tool_calls
    rendered = _prompt(hybrid_server)
    assert f"<tool_response>\n{add.invoke(call['args'])}\n</tool_response>" in rendered
    assert '"name": "add", "arguments": ' in rendered


def test_openai_agents_runner_two_tools_three_turns(hybrid_server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    calls = []

    # bounded values: a random model fills an unbounded string or number until max_tokens
    @function_tool
    def get_weather(city: Literal["Oslo", "Paris", "Lima"]) -> str:
        """Current weather in a city."""
        calls.append(("get_weather", city))
        return f"sunny in {city}"

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two integers."""
        calls.append(("add", a, b))
        return a + b

    class ScriptedChoice(OpenAIChatCompletionsModel):
        """The chat-completions model, its tool_choice set per turn (a random model's answers
        must be forced to make a deterministic loop): get_weather, then add, then text."""

        plan: ClassVar[list[str]] = ["get_weather", "add", "none"]

        async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):
            choice = self.plan.pop(0)
            settings = dataclasses.replace(model_settings, tool_choice=choice)
            return await super().get_response(system_instructions, input, settings, *args, **kwargs)

    async def run():
        async with openai.AsyncOpenAI(
            base_url=hybrid_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            model = ScriptedChoice(model=MODEL, openai_client=client)
            agent = Agent(
                name="helper",
                instructions="Use the tools.",
                tools=[get_weather, add],
                model=model,
                model_settings=ModelSettings(
                    temperature=0, max_tokens=60, parallel_tool_calls=False, extra_body=NO_THINKING
                ),
                reset_tool_choice=False,
            )
            return await Runner.run(
                agent, "Weather in Oslo, and 2 + 3?", max_turns=3, run_config=RunConfig(tracing_disabled=True)
            )

    first = len(hybrid_server.engine.requests)
    result = asyncio.run(run())
    assert [c[0] for c in calls] == ["get_weather", "add"]
    assert isinstance(result.final_output, str)
    requests = hybrid_server.engine.requests[first:]
    assert len(requests) == 3
    assert len(requests[0].prompt_token_ids) < len(requests[1].prompt_token_ids) < len(requests[2].prompt_token_ids)
    rendered = hybrid_server.engine.tokenizer.decode(requests[2].prompt_token_ids)
    assert f"<tool_response>\nsunny in {calls[0][1]}\n</tool_response>" in rendered
    assert f"<tool_response>\n{calls[1][1] + calls[1][2]}\n</tool_response>" in rendered


# -------------------------------------------------------------------------- a model that thinks


def _token(live, text: str) -> int:
    return live.engine.tokenizer.convert_tokens_to_ids(text)


def test_thinking_model_grammar_starts_after_its_reasoning(hybrid_server):
    """The template opens <think> in the prompt: the grammar waits for </think> (a bias makes
    the random model write it first), then forces the call. Had it applied from the first
    token, </think> would have been masked and everything would be reasoning, with no call."""
    client = _client(hybrid_server)
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2 + 3?"}],
        tools=[ADD_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        logit_bias={str(_token(hybrid_server, "</think>")): 100},
        logprobs=True,
        extra_body={"chat_template": QWEN_THINKING_STYLE},
    )
    choice = response.choices[0]
    assert choice.logprobs.content[0].token == "</think>"
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] is None  # empty: closed at once
    _check_call(choice.message.tool_calls[0])
    assert hybrid_server.engine.requests[-1].params.structured_output.start_after == (
        _token(hybrid_server, "</think>"),
    )


def test_model_that_may_think_gets_an_optional_reasoning_block(hybrid_server):
    """The prompt does not open <think> but the model knows it: the grammar allows one leading
    <think> block, then the call (biases make the random model open and close the block at
    once, or never open it)."""
    bias = {str(_token(hybrid_server, "<think>")): 50, str(_token(hybrid_server, "</think>")): 100}
    client = _client(hybrid_server)
    thinking = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2 + 3?"}],
        tools=[ADD_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        logit_bias=bias,
        logprobs=True,
    ).choices[0]
    assert [t.token for t in thinking.logprobs.content[:2]] == ["<think>", "</think>"]
    assert thinking.finish_reason == "tool_calls" and thinking.message.content is None
    _check_call(thinking.message.tool_calls[0])
    generated = hybrid_server.engine.requests[-1]
    assert generated.params.structured_output.optional_block == ("<think>", "</think>")
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2 + 3?"}],
        tools=[ADD_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        logprobs=True,
        logit_bias={str(_token(hybrid_server, "<think>")): -100},
    ).choices[0]
    assert plain.logprobs.content[0].token == "<"  # the block is optional: straight to the call
    assert plain.finish_reason == "tool_calls"
    _check_call(plain.message.tool_calls[0])
