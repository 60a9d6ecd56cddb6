"""Issue 31 over the HTTP layer with the scripted fake engine (no JAX): agent-loop messages
render through every template style, tool calls are bounded and a cut call never leaks, the
tool-call parsers and their flags.

References: transformers' own `apply_chat_template` on conversations written by hand the way
HF documents them (content "" next to tool calls, arguments as objects for templates that
need objects), the official `openai` client (it validates the response shapes and is what
agents send), and llguidance matchers fed the texts a model would write.
"""

import json
import random

import openai
import pytest

from configs.schema import ServerConfig
from server.chat_output import ChatOutputParser
from server.testing import FakeEngine, LiveServer, build_test_tokenizer
from server.tool_parser import HermesToolParser, Llama3JsonToolParser
from tests.chat_templates import LLAMA3_STYLE, QWEN_STYLE
from tests.structured_cases import ADD_TOOL, TOOLS, WEATHER_TOOL

USER = {"role": "user", "content": "weather in Paris, and 2 + 3?"}
WEATHER_ARGS = '{"city":"Paris","unit":"celsius"}'  # compact, as a grammar-forced call writes it
CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
    {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}},
]
RESULTS = [
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "5"},
]
HERMES_CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n</tool_call>'
)
LLAMA_CALLS = (
    '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture(scope="module")
def fake(tokenizer):
    return FakeEngine(tokenizer, max_model_len=4096)


@pytest.fixture(scope="module")
def servers(fake):
    """One server per template style (and one with the Llama 3 JSON parser), sharing the engine."""
    configs = {
        "default": ServerConfig(max_tool_calls=2),
        "qwen": ServerConfig(chat_template=QWEN_STYLE),
        "llama3": ServerConfig(chat_template=LLAMA3_STYLE, tool_call_parser="llama3_json"),
        "no_auto": ServerConfig(enable_auto_tool_choice=False),
    }
    live = {}
    try:
        for name, config in configs.items():
            live[name] = LiveServer(fake, config)
        yield live
    finally:
        for server in live.values():
            server.close()


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _rendered(fake, tokenizer) -> str:
    return tokenizer.decode(fake.requests[-1].prompt_token_ids)


def _collect_stream(stream) -> dict:
    message = {"content": "", "calls": [], "finish": None}
    for chunk in stream:
        for choice in chunk.choices:
            message["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id:
                    message["calls"].append([call.function.name, ""])
                message["calls"][call.index][1] += call.function.arguments or ""
            message["finish"] = choice.finish_reason or message["finish"]
    return message


def _history(content_form: str) -> list[dict]:
    assistant = {"role": "assistant", "tool_calls": CALLS}
    if content_form != "absent":
        assistant["content"] = {"null": None, "empty": ""}[content_form]
    return [USER, assistant, *RESULTS]


# ---------------------------------------------------------------- issue 31.1: the second turn


@pytest.mark.parametrize("content_form", ["null", "absent", "empty"])
def test_second_turn_renders_calls_and_results_with_an_hf_template(servers, fake, tokenizer, content_form):
    """Regression (issue 31.1): was `400 ... 'dict object' has no attribute 'content'`."""
    _client(servers["qwen"]).chat.completions.create(
        messages=_history(content_form), tools=TOOLS, max_tokens=2, model="fake-model"
    )
    # HF's documented form: content "" next to the calls; this template prints string arguments as given
    reference = [USER, {"role": "assistant", "content": "", "tool_calls": CALLS}, *RESULTS]
    expected = tokenizer.apply_chat_template(
        reference, tools=TOOLS, chat_template=QWEN_STYLE, add_generation_prompt=True, tokenize=False
    )
    assert fake.requests[-1].prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    rendered = _rendered(fake, tokenizer)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n5\n</tool_response>" in rendered


def test_second_turn_parses_arguments_for_a_template_that_needs_objects(servers, fake, tokenizer):
    _client(servers["llama3"]).chat.completions.create(
        messages=_history("null"), tools=TOOLS, max_tokens=2, model="fake-model"
    )
    objects = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in CALLS]
    reference = [USER, {"role": "assistant", "content": "", "tool_calls": objects}, *RESULTS]
    expected = tokenizer.apply_chat_template(
        reference, tools=TOOLS, chat_template=LLAMA3_STYLE, add_generation_prompt=True, tokenize=False
    )
    assert _rendered(fake, tokenizer) == expected
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}' in expected
    assert "ipython<|end_header_id|>\n\n5" in expected


@pytest.mark.parametrize("content_form", ["null", "absent", "empty"])
def test_second_turn_with_a_template_that_knows_no_tools(servers, fake, tokenizer, content_form):
    """The default template (ChatML-like, no tool support): calls, results and the tool
    definitions are written into the turns in the server's format, so none is dropped."""
    _client(servers["default"]).chat.completions.create(
        messages=_history(content_form), tools=TOOLS, max_tokens=2, model="fake-model"
    )
    rendered = _rendered(fake, tokenizer)
    calls = "\n".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": '
        f"{json.dumps(json.loads(c['function']['arguments']))}}}\n</tool_call>"
        for c in CALLS
    )
    results = "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    assert rendered.startswith("<|system|># Tools\n")
    assert json.dumps({"type": "function", "function": WEATHER_TOOL["function"]}) in rendered
    assert rendered.endswith(
        f"<|user|>{USER['content']}<|end|><|assistant|>{calls}<|end|><|user|>{results}<|end|><|assistant|>"
    )


def test_content_parts_and_malformed_tool_calls(servers, fake, tokenizer):
    client = _client(servers["qwen"])
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    client.chat.completions.create(messages=[{"role": "user", "content": parts}], max_tokens=2, model="fake-model")
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>" in _rendered(fake, tokenizer)  # vLLM joins with "\n"
    bad = [USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": "add"}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=bad, max_tokens=2, model="fake-model")
    assert err.value.body["param"] == "messages[1].tool_calls[0]"


def test_tokenize_normalizes_messages_too(servers):
    import urllib.request

    body = json.dumps({"messages": _history("null")}).encode()
    request = urllib.request.Request(servers["qwen"].url + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["count"] > 0


# ------------------------------------------------------ issue 31.3: bounds, cut calls, streaming


def _cut_inside_second_call(tokenizer) -> tuple[str, int]:
    """A forced answer cut by max_tokens inside its second call: (script, max_tokens)."""
    script = HERMES_CALLS
    first_end = script.index("</tool_call>") + len("</tool_call>")
    cut_at = script.index('"city"')  # inside the second call
    tokens = tokenizer.encode(script, add_special_tokens=False)
    count = next(n for n in range(len(tokens)) if len(tokenizer.decode(tokens[:n])) >= cut_at)
    assert len(tokenizer.decode(tokens[:count])) > first_end
    return script, count


@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_by_max_tokens_is_dropped_and_never_content(servers, fake, tokenizer, stream):
    """Regression (issue 31.3): was finish "length" with two calls (one with empty arguments)
    and a partial `<tool_call>` in content."""
    script, max_tokens = _cut_inside_second_call(tokenizer)
    fake.scripted_texts.append(script)
    response = _client(servers["qwen"]).chat.completions.create(
        messages=[USER], tools=TOOLS, tool_choice="required", max_tokens=max_tokens, stream=stream, model="fake-model"
    )
    if stream:
        message = _collect_stream(response)
    else:
        choice = response.choices[0]
        message = {
            "content": choice.message.content or "",
            "finish": choice.finish_reason,
            "calls": [[c.function.name, c.function.arguments] for c in choice.message.tool_calls],
        }
    assert message == {"content": "", "finish": "length", "calls": [["add", '{"a": 1, "b": 2}']]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "server, parallel, expected", [("default", True, 2), ("default", False, 1), ("qwen", True, 3), ("qwen", False, 1)]
)
def test_auto_tool_calls_are_bounded(servers, fake, server, parallel, expected, stream):
    """`parallel_tool_calls: false` -> one call; otherwise at most server.max_tool_calls (2 on
    the default server, 8 on the other): the calls past the bound are dropped, not content."""
    fake.scripted_texts.append(HERMES_CALLS)
    response = _client(servers[server]).chat.completions.create(
        messages=[USER], tools=TOOLS, parallel_tool_calls=parallel, stream=stream, model="fake-model"
    )
    if stream:
        message = _collect_stream(response)
        names, content, finish = [c[0] for c in message["calls"]], message["content"], message["finish"]
    else:
        choice = response.choices[0]
        names = [c.function.name for c in choice.message.tool_calls]
        content, finish = choice.message.content, choice.finish_reason
    assert names == ["add", "get_weather", "add"][:expected]
    assert not content and finish == "tool_calls"


@pytest.mark.parametrize(
    "parser_class, text", [(HermesToolParser, "Let me see. " + HERMES_CALLS), (Llama3JsonToolParser, LLAMA_CALLS)]
)
@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_equal_the_message_even_when_cut(parser_class, text, seed):
    rng = random.Random(seed)
    final_text = text[: rng.randrange(len(text) // 2, len(text) + 1)]  # often cut inside a call
    cuts = sorted(rng.sample(range(1, len(final_text)), 12)) + [len(final_text)]
    streaming = ChatOutputParser(None, parser_class(), max_calls=8)
    deltas = [d for end in cuts for d in streaming.deltas(final_text[:end], final=end == len(final_text))]
    message = ChatOutputParser(None, parser_class(), max_calls=8).message(final_text)
    assert "".join(d.get("content", "") for d in deltas) == (message["content"] or "")
    streamed = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
    assert streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert "<tool_call>" not in (message["content"] or "") and all(json.loads(arguments) for _, arguments in streamed)


# ----------------------------------------------------------------- tool-call parsers and flags


def test_llama3_json_parser_round_trip(servers, fake, tokenizer):
    client = _client(servers["llama3"])
    fake.scripted_texts.append(LLAMA_CALLS)
    message = client.chat.completions.create(messages=[USER], tools=TOOLS, model="fake-model").choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
    ]
    assert message.content is None
    fake.scripted_texts.append(LLAMA_CALLS)
    streamed = _collect_stream(
        client.chat.completions.create(messages=[USER], tools=TOOLS, stream=True, model="fake-model")
    )
    assert streamed["calls"] == [[c.function.name, c.function.arguments] for c in message.tool_calls]
    history = [USER, message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in message.tool_calls]
    client.chat.completions.create(
        messages=history, tools=TOOLS, tool_choice="required", max_tokens=2, model="fake-model"
    )
    assert '{"name": "add", "parameters": {"a": 1, "b": 2}}{"name": "get_weather"' in _rendered(fake, tokenizer)
    assert '"parameters"' in fake.requests[-1].params.structured_output.spec  # forced in its own format


def test_llama3_json_text_that_is_not_a_call_is_content(servers, fake):
    fake.scripted_texts.append('{"answer": 42} is my reply')
    message = (
        _client(servers["llama3"])
        .chat.completions.create(messages=[USER], tools=TOOLS, model="fake-model")
        .choices[0]
        .message
    )
    assert message.content == '{"answer": 42} is my reply' and not message.tool_calls


def test_without_auto_tool_choice_tools_are_only_rendered(servers, fake, tokenizer):
    client = _client(servers["no_auto"])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=[USER], tools=TOOLS, tool_choice="auto", model="fake-model")
    assert err.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in err.value.body["message"]
    fake.scripted_texts.append(HERMES_CALLS)
    choice = client.chat.completions.create(messages=[USER], tools=TOOLS, model="fake-model").choices[0]
    assert choice.message.content == HERMES_CALLS and not choice.message.tool_calls
    assert "# Tools" in _rendered(fake, tokenizer)  # the model was still told about them
    fake.scripted_texts.append(HERMES_CALLS.split("\n<tool_call>")[0])
    forced = client.chat.completions.create(
        messages=[USER], tools=[ADD_TOOL], tool_choice="required", model="fake-model"
    ).choices[0]
    assert forced.finish_reason == "tool_calls" and len(forced.message.tool_calls) == 1


def test_tool_flags_map_onto_the_config():
    from configs.schema import ConfigError, load_config
    from server.cli import _load, _parser

    config = _load(
        _parser().parse_args(
            ["config", "--tool-call-parser", "llama3_json", "--no-enable-auto-tool-choice", "--max-tool-calls", "3"]
        )
    ).server
    assert (config.tool_call_parser, config.enable_auto_tool_choice, config.max_tool_calls) == ("llama3_json", False, 3)
    default = _load(_parser().parse_args(["config", "--enable-auto-tool-choice"])).server
    assert (default.tool_call_parser, default.enable_auto_tool_choice, default.max_tool_calls) == ("hermes", True, 8)
    with pytest.raises(ConfigError):
        load_config(None, {"server.tool_call_parser": "mistral"})
    with pytest.raises(ConfigError):
        load_config(None, {"server.max_tool_calls": 0})


# --------------------------------------------------------- the grammars, fed by hand (llguidance)


def _accepts(compiler, grammar, tokenizer, text: str) -> bool:
    matcher = compiler.compile(grammar).new_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        matcher.is_terminated() or matcher.matcher.is_accepting()
    )


@pytest.mark.parametrize(
    "parser_class, separator, make",
    [
        (
            HermesToolParser,
            "\n",
            lambda a: f'<tool_call>\n{{"name":"add","arguments":{{"a":{a},"b":1}}}}\n</tool_call>',
        ),
        (Llama3JsonToolParser, "; ", lambda a: f'{{"name":"add","parameters":{{"a":{a},"b":1}}}}'),
    ],
)
def test_forced_grammar_bounds_the_number_of_calls(tokenizer, parser_class, separator, make):
    from runtime.structured_output import build_compiler
    from server.structured import ToolPlan, forced_tool_call_grammar

    compiler = build_compiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    for max_calls in (1, 3):
        grammar = forced_tool_call_grammar(
            ToolPlan("forced", [ADD_TOOL["function"]], ("add",), max_calls), parser_class()
        )
        for count in range(1, 5):
            text = separator.join(make(i) for i in range(count))
            assert _accepts(compiler, grammar, tokenizer, text) == (count <= max_calls), (max_calls, count)
            assert parser_class().parse(text, True)[1][0].name == "add"


def test_optional_reasoning_block_grammar(tokenizer):
    """The grammar of a model that may think: a leading <think> block, or none; never prose."""
    from runtime.structured_output import build_compiler
    from runtime.types import StructuredOutput

    compiler = build_compiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    grammar = StructuredOutput("json", '{"type": "object"}', optional_block=("<think>", "</think>"))
    assert _accepts(compiler, grammar, tokenizer, '{"a":1}')
    assert _accepts(compiler, grammar, tokenizer, '<think>\nplain {"x": <b> text\n</think>\n\n{"a":1}')
    assert not _accepts(compiler, grammar, tokenizer, 'Sure! {"a":1}')
    assert not _accepts(compiler, grammar, tokenizer, "<think>hm</think>Sure")
