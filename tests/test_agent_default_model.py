"""Issue 31 on the default model (SmolLM2-135M-Instruct, the GGUF `jaxserve serve` runs with no
model named): a three-turn tool loop with the official `openai` client, streaming and not.

SmolLM2's chat template is plain ChatML: it knows neither tools nor tool calls nor the `tool`
role. The server writes the tool definitions into the system turn, the assistant's calls into
its content as Hermes `<tool_call>` blocks and the results into a user turn of
`<tool_response>` blocks (`server/chat_messages.py`), so every turn renders and the model sees
the whole loop. Calls are forced by the grammar (a named tool each turn), so the shapes are
deterministic; the assertions read the prompt the server rendered (a recording engine client).
"""

import json
import os
from pathlib import Path

import jsonschema
import openai
import pytest
from engine_testing import live_engine_server

from models import load_model
from models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from tests.structured_cases import TOOLS

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server():
    cache_dir = os.environ.get("JAXSERVE_CACHE_DIR") or REPO_ROOT / ".cache" / "jaxserve"
    gguf = ensure_default_model(Path(cache_dir))  # DefaultModelUnavailable fails the test
    # dequantized at load: on a CPU the Q4_1 blocks would be converted in every step
    model = load_model(gguf, dtype="float32", keep_gguf_quantized=False)
    config = EngineConfig(
        aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
        model=str(gguf),
        dtype="float32",
        keep_gguf_quantized=False,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        token_buckets=(8, 256),
        num_pages=160,
        max_model_len=1024,
        fuse_greedy=False,
        seed=0,
    )
    with live_engine_server(
        LLMEngine(config, model=model), DEFAULT_MODEL_NAME, max_waiting_requests=16, record=True
    ) as live:
        yield live


def _message(client, messages, tool_choice, stream: bool, max_tokens: int = 60) -> tuple[dict, str]:
    """One turn; returns the assistant message as the SDK gives it (content null next to
    calls) and the finish reason."""
    request = dict(
        model=DEFAULT_MODEL_NAME,
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=max_tokens,
    )
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        return choice.message.model_dump(include={"role", "content", "tool_calls"}), choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"role": "assistant", "content": content or None, "tool_calls": list(calls.values())}, finish


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_tool_loop_on_the_default_model(server, stream):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is the weather in Paris? Then add 2 and 3."}]
    prompt_lengths = []
    for tool in ("get_weather", "add"):
        message, finish = _message(client, messages, {"type": "function", "function": {"name": tool}}, stream)
        assert finish == "tool_calls" and message["content"] is None
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == tool and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[tool])
        prompt_lengths.append(len(server.engine.requests[-1].prompt_token_ids))
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": f"{tool} says 42"}]
    answer, finish = _message(client, messages, "none", stream, max_tokens=12)
    assert finish in ("stop", "length") and answer["content"] and not answer["tool_calls"]
    prompt_lengths.append(len(server.engine.requests[-1].prompt_token_ids))
    assert prompt_lengths[0] < prompt_lengths[1] < prompt_lengths[2]
    rendered = server.engine.tokenizer.decode(server.engine.requests[-1].prompt_token_ids)
    assert rendered.startswith("<|im_start|>system\n# Tools\n")
    for message in messages:
        for call in message.get("tool_calls") or []:
            arguments = json.loads(call["function"]["arguments"])
            written = json.dumps({"name": call["function"]["name"], "arguments": arguments})
            assert f"<|im_start|>assistant\n<tool_call>\n{written}\n</tool_call><|im_end|>" in rendered
    for tool in ("get_weather", "add"):
        assert f"<|im_start|>user\n<tool_response>\n{tool} says 42\n</tool_response><|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
