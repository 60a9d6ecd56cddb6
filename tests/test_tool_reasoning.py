"""Tool-call and reasoning parsing over the HTTP layer with the scripted fake engine (no JAX).

The fake engine replays a scripted text token by token, so the parsers see the same text
arriving in many small pieces (streaming) and whole (non-streaming); the official `openai`
client reassembles the streamed deltas. Also: the tool-result round trip renders through
the chat template exactly as transformers' `apply_chat_template` does, and a grammar with
`start_after` (reasoning first) switches on only after the end-of-reasoning tokens.
"""

import json
import random

import numpy as np
import openai
import pytest
from import_testing import imports_jax

from configs.schema import ServerConfig
from server.chat_output import ChatOutputParser
from server.reasoning import Qwen3ReasoningParser
from server.testing import FakeEngine, LiveServer, build_test_tokenizer
from server.tool_parser import HermesToolParser
from tests.structured_cases import ADD_TOOL, TOOLS

TOOL_TEMPLATE = (
    "{%- if tools %}<|system|># Tools\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for tc in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}\n</tool_call>'
    "{% endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response id=\"{{ m.tool_call_id }}\">{{ m.content }}</tool_response><|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
SCRIPT = (
    '<think>The user wants weather; {"not": "a call"}</think>\n\nLet me check.'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": [3, {"c": "}"}]}}\n</tool_call>'
)
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_test_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.fixture
def fake(tokenizer):
    return FakeEngine(tokenizer, max_model_len=2048)


def _client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def _collect_stream(stream) -> dict:
    message = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = message["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id and name come once, in its first delta"
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            message["finish"] = choice.finish_reason or message["finish"]
    return message


def test_auto_tool_calls_and_reasoning_parse_identically_streaming_or_not(fake):
    with LiveServer(fake, ServerConfig(reasoning_parser="qwen3")) as live:
        client = _client(live)
        fake.scripted_texts.append(SCRIPT)
        whole = client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS).choices[0]
        fake.scripted_texts.append(SCRIPT)
        streamed = _collect_stream(
            client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, stream=True)
        )
    message = whole.message
    assert whole.finish_reason == streamed["finish"] == "tool_calls"
    assert (
        message.model_extra["reasoning_content"] == streamed["reasoning"] == 'The user wants weather; {"not": "a call"}'
    )
    assert message.content == streamed["content"] == "Let me check."
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert calls == [(c["name"], c["arguments"]) for c in streamed["calls"].values()]
    assert [(name, json.loads(args)) for name, args in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("add", {"a": 2, "b": [3, {"c": "}"}]}),
    ]
    assert all(c.id.startswith("call_") for c in message.tool_calls)


def test_no_tools_or_tool_choice_none_leaves_the_text_alone(fake):
    with LiveServer(fake) as live:
        client = _client(live)
        fake.scripted_texts.append(SCRIPT)
        choice = client.chat.completions.create(
            model="fake-model", messages=USER, tools=TOOLS, tool_choice="none"
        ).choices[0]
    assert choice.message.content == SCRIPT and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_tool_result_round_trip_renders_through_the_chat_template(fake, tokenizer):
    with LiveServer(fake) as live:
        client = _client(live)
        fake.scripted_texts.append(SCRIPT.split("</think>")[1])
        first = client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS).choices[0].message
        history = USER + [first.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})]
        history += [
            {"role": "tool", "tool_call_id": call.id, "content": f"result of {call.function.name}"}
            for call in first.tool_calls
        ]
        client.chat.completions.create(model="fake-model", messages=history, tools=TOOLS, max_tokens=2)
    sent = fake.requests[-1].prompt_token_ids
    text = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert sent == tokenizer.encode(text, add_special_tokens=False)
    rendered = tokenizer.decode(sent)
    assert f'<tool_response id="{first.tool_calls[1].id}">result of add</tool_response>' in rendered
    assert '"name": "add", "arguments": {"a": 2, "b": [3, {"c": "}"}]}' in rendered


@pytest.mark.parametrize("seed", range(20))
def test_parser_deltas_add_up_to_the_message_for_any_chunking(seed):
    rng = random.Random(seed)
    text = SCRIPT if seed % 2 else SCRIPT.replace("<think>", "")  # open_at_start: the prompt opened it
    parser = ChatOutputParser(Qwen3ReasoningParser(open_at_start=seed % 2 == 0), HermesToolParser())
    cuts = sorted(rng.sample(range(1, len(text)), 25))
    deltas = []
    for end in cuts + [len(text)]:
        deltas += parser.deltas(text[:end], final=end == len(text))
    reference = ChatOutputParser(Qwen3ReasoningParser(open_at_start=seed % 2 == 0), HermesToolParser()).message(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reference["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == reference["content"]
    streamed = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            entry = streamed.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"]["arguments"]
    assert [tuple(v) for v in streamed.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in reference["tool_calls"]
    ]


def test_thinking_disabled_and_plain_text_are_content():
    parser = Qwen3ReasoningParser(open_at_start=False)
    assert parser.split("Hello <think> there", final=True) == ("", "Hello <think> there")
    assert parser.split("<thi", final=False) == ("", "")  # may still open a block
    assert parser.split("<think>abc</thi", final=False) == ("abc", "")
    assert Qwen3ReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.prompt_opens_reasoning("assistant\n<think>\n\n</think>\n\n")


def test_grammar_switches_on_after_the_reasoning_end_tokens(tokenizer):
    from runtime.structured_output import StructuredOutputManager, build_compiler
    from runtime.types import StructuredOutput

    compiler = build_compiler(tokenizer, len(tokenizer) + 7, (tokenizer.eos_token_id,))
    manager = StructuredOutputManager(compiler, max_rows=8)
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    manager.add("r", StructuredOutput("choice", json.dumps(["yes", "no"]), start_after=end))
    assert manager.fill(["r"], 8) is None  # reasoning: unconstrained
    for token in tokenizer.encode("hmm </think>", add_special_tokens=False):
        assert not manager.advance("r", token)
    mask = manager.fill(["r", None], 8)
    allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
    assert all("yes".startswith(t) or "no".startswith(t) for t in map(tokenizer.decode, allowed)) and len(allowed)
    assert (mask[1:] == -1).all()
    done = [manager.advance("r", t) for t in tokenizer.encode("yes", add_special_tokens=False)]
    assert done[-1]


def test_forced_tool_choice_with_fake_engine_is_validated(fake):
    with LiveServer(fake) as live:
        client = _client(live)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="fake-model", messages=USER, tool_choice="required")
        assert err.value.body["param"] == "tool_choice"
        fake.scripted_texts.append('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
        choice = client.chat.completions.create(
            model="fake-model", messages=USER, tools=[ADD_TOOL], tool_choice="required"
        ).choices[0]
    assert fake.requests[-1].params.structured_output.kind == "lark"
    assert choice.finish_reason == "tool_calls" and json.loads(choice.message.tool_calls[0].function.arguments) == {
        "a": 1,
        "b": 2,
    }


def test_reasoning_parser_from_cli_flag_and_yaml(tmp_path):
    from configs.schema import ConfigError, load_config
    from server.cli import _load, _parser

    assert _load(_parser().parse_args(["config", "--reasoning-parser", "qwen3"])).server.reasoning_parser == "qwen3"
    assert load_config("configs/gpu-h200-qwen3_5-9b.yaml").server.reasoning_parser == "qwen3"
    assert load_config("configs/cpu-demo.yaml").server.reasoning_parser is None
    with pytest.raises(ConfigError):
        load_config(None, {"server.reasoning_parser": "deepseek"})


def test_mask_allows_eos_when_the_grammar_accepts_and_never_ids_past_the_tokenizer(tokenizer):
    from runtime.structured_output import StructuredOutputManager, build_compiler
    from runtime.types import StructuredOutput

    vocab = len(tokenizer) + 45  # the model's embedding has unused rows past the tokenizer
    manager = StructuredOutputManager(build_compiler(tokenizer, vocab, (tokenizer.eos_token_id,)), max_rows=8)
    manager.add("r", StructuredOutput("regex", "[0-9]{1,3}"))

    def allowed() -> np.ndarray:
        bits = np.unpackbits(manager.fill(["r"], 8)[0].view(np.uint8), bitorder="little")
        assert bits.shape[0] >= vocab and not bits[len(tokenizer) :].any()
        return np.flatnonzero(bits)

    assert tokenizer.eos_token_id not in allowed()  # nothing matched yet: the end is not allowed
    assert not manager.advance("r", tokenizer.convert_tokens_to_ids("7"))
    after = allowed()
    assert tokenizer.eos_token_id in after and all(
        tokenizer.decode([t]).isdigit() for t in after if t != tokenizer.eos_token_id
    )


def test_structured_output_benchmark_sections_without_a_model(tokenizer):
    from benchmarks.structured_output import SCHEMA, compile_times, mask_fill
    from runtime.structured_output import build_compiler
    from runtime.types import StructuredOutput

    compiler = build_compiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    mask = mask_fill(compiler, StructuredOutput("json", json.dumps(SCHEMA)), rows=4, steps=5)
    assert mask["rows"] == 4 and mask["fill_ms_median"] > 0
    compiled = compile_times(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), count=2)
    assert compiled["schemas"] == 2 and compiled["cached_ms_median"] < compiled["cold_ms_median"]


def test_server_and_grammar_modules_do_not_import_jax():
    assert not imports_jax("server.app", "server.structured", "server.chat_output", "runtime.structured_output")


class _SlowBackend:
    """A grammar back-end stub: compiling takes `delay` seconds; 'bad' grammars are invalid."""

    name, vocab_size = "slow", 64

    def __init__(self, delay: float):
        self.delay, self.calls = delay, 0

    def compile(self, grammar):
        import time

        from runtime.structured_output import GrammarError

        self.calls += 1
        time.sleep(self.delay)
        if grammar.spec == "bad":
            raise GrammarError("invalid regex grammar: bad")
        return object()


def test_compiler_caches_results_and_errors_and_bounds_compile_time():
    import asyncio

    from runtime.structured_output import GrammarCompiler, GrammarError
    from runtime.types import StructuredOutput
    from server.protocol import RequestError
    from server.structured import compile_or_400

    fast = GrammarCompiler(_SlowBackend(0.0), timeout_s=5)
    good, bad = StructuredOutput("regex", "a+"), StructuredOutput("regex", "bad")
    assert fast.compile(good) is fast.compile(good)
    for _ in range(2):
        with pytest.raises(GrammarError):
            fast.compile(bad)
    assert fast.backend.calls == 2 and fast.hits == 2  # each grammar compiled once, errors cached too

    slow = GrammarCompiler(_SlowBackend(1.0), timeout_s=0.05)
    with pytest.raises(GrammarError, match="did not compile within"):
        slow.compile(good)
    with pytest.raises(RequestError) as err:
        asyncio.run(compile_or_400(slow, StructuredOutput("regex", "b+"), "structured_outputs.regex"))
    assert err.value.status == 400 and err.value.param == "structured_outputs.regex"
    slow.shutdown()


THINKING_TEMPLATE = TOOL_TEMPLATE.replace(
    "<|assistant|>{%- endif %}", "<|assistant|><think>\n{%- endif %}"
)  # opens the block (Qwen3.5)
MAY_THINK_TEMPLATE = TOOL_TEMPLATE.replace(  # renders past reasoning; the model writes <think> itself
    "{%- else %}<|{{ m.role }}|>",
    "{%- else %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}",
)


@pytest.mark.parametrize(
    "template, kwargs, rule",
    [
        (THINKING_TEMPLATE, {}, "after"),  # the prompt opens <think>: the grammar starts after </think>
        (THINKING_TEMPLATE, {"chat_template_kwargs": {"enable_thinking": False}}, "first"),
        (MAY_THINK_TEMPLATE, {}, "optional"),  # the model may open <think> itself
        (TOOL_TEMPLATE, {}, "first"),  # a model that never thinks: the grammar is never switched off
    ],
)
def test_with_reasoning_the_grammar_starts_after_thinking_or_at_once(tokenizer, template, kwargs, rule):
    fake = FakeEngine(tokenizer, max_model_len=2048)
    with LiveServer(fake, ServerConfig(reasoning_parser="qwen3", chat_template=template)) as live:
        client = _client(live)
        client.chat.completions.create(
            model="fake-model", messages=USER, max_tokens=2, response_format={"type": "json_object"}, extra_body=kwargs
        )
    grammar = fake.requests[-1].params.structured_output
    assert grammar.kind == "json"
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert grammar.start_after == (end if rule == "after" else ())
    assert grammar.optional_block == (("<think>", "</think>") if rule == "optional" else ())
