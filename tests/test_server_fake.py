"""The OpenAI-compatible server against FakeEngine, driven by the official `openai` client.

Expected outputs are computed here by hand from the fake's documented rule (token after t is
(t * 7 + 3 + seed) % vocab) and decoded with the tokenizer itself; the chat prompt is the
template's rendering written out by hand.
"""

import asyncio

import openai
import pytest

from server.testing import FakeEngine, LiveServer, build_test_tokenizer

API_KEY = "test-key"


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer):
    from configs.schema import ServerConfig

    engine = FakeEngine(tokenizer, model_name="fake-model", max_model_len=256, num_slots=8)
    with LiveServer(engine, ServerConfig(api_key=API_KEY)) as live:
        yield live


def run(coro):
    return asyncio.run(coro)


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def hand_tokens(prompt_ids, count, seed, vocab):
    tokens, token = [], prompt_ids[-1]
    for _ in range(count):
        token = (token * 7 + 3 + (seed or 0)) % vocab
        tokens.append(token)
    return tokens


def hand_text(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=True)


def chat_prompt_ids(tokenizer, user_text):
    return tokenizer.encode(f"<|user|>{user_text}<|end|><|assistant|>", add_special_tokens=False)


def test_completion(server, tokenizer):
    async def go():
        async with client(server) as c:
            return await c.completions.create(model="fake-model", prompt="Return the value", max_tokens=7)

    result = run(go())
    prompt_ids = tokenizer.encode("Return the value")
    tokens = hand_tokens(prompt_ids, 7, None, len(tokenizer))
    choice = result.choices[0]
    assert choice.text == hand_text(tokenizer, tokens)
    assert choice.finish_reason == "length"
    assert result.object == "text_completion" and result.model == "fake-model"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        len(prompt_ids),
        7,
        len(prompt_ids) + 7,
    )


def test_completion_stream_with_usage(server, tokenizer):
    async def go():
        async with client(server) as c:
            stream = await c.completions.create(
                model="fake-model",
                prompt="Return the value",
                max_tokens=9,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = run(go())
    prompt_ids = tokenizer.encode("Return the value")
    expected = hand_text(tokenizer, hand_tokens(prompt_ids, 9, None, len(tokenizer)))
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == expected
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_chat(server, tokenizer):
    async def go():
        async with client(server) as c:
            return await c.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6
            )

    result = run(go())
    prompt_ids = chat_prompt_ids(tokenizer, "Say hi")
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content == hand_text(tokenizer, hand_tokens(prompt_ids, 6, None, len(tokenizer)))
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == 6


def test_chat_stream_content_parts_and_default_max_tokens(server, tokenizer):
    """No max_tokens: chat runs to the context limit. Content given as text parts."""

    async def go():
        async with client(server) as c:
            stream = await c.chat.completions.create(
                model="fake-model",
                stream=True,
                stream_options={"include_usage": True},
                messages=[
                    {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}
                ],
            )
            return [chunk async for chunk in stream]

    chunks = run(go())
    prompt_ids = chat_prompt_ids(tokenizer, "Say \nhi")  # text parts joined by newlines (vLLM)
    count = 256 - len(prompt_ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert text == hand_text(tokenizer, hand_tokens(prompt_ids, count, None, len(tokenizer)))
    assert chunks[-1].usage.completion_tokens == count
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]


def test_n2_seed_and_request_id(server, tokenizer):
    async def go():
        async with client(server) as c:
            return await c.completions.with_raw_response.create(
                model="fake-model",
                prompt="seeded",
                max_tokens=5,
                n=2,
                seed=11,
                extra_headers={"X-Request-ID": "req-n2"},
            )

    raw = run(go())
    result = raw.parse()
    assert raw.headers["x-request-id"] == "req-n2"  # echoed, but never the engine's key
    job_id = result.id.removeprefix("cmpl-")
    assert job_id != "req-n2" and len(job_id) == 32
    prompt_ids = tokenizer.encode("seeded")
    for i, choice in enumerate(sorted(result.choices, key=lambda c: c.index)):
        assert choice.index == i
        assert choice.text == hand_text(tokenizer, hand_tokens(prompt_ids, 5, 11 + i, len(tokenizer)))
    seen = {r.request_id: r.params.seed for r in server.engine.requests if r.request_id.startswith(job_id)}
    assert seen == {f"{job_id}-0": 11, f"{job_id}-1": 12}
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == 10


def test_chat_stream_n2(server, tokenizer):
    async def go():
        async with client(server) as c:
            stream = await c.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "two"}],
                max_tokens=4,
                n=2,
                seed=3,
                stream=True,
            )
            return [chunk async for chunk in stream]

    chunks = run(go())
    prompt_ids = chat_prompt_ids(tokenizer, "two")
    for i in range(2):
        text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i)
        assert text == hand_text(tokenizer, hand_tokens(prompt_ids, 4, 3 + i, len(tokenizer)))


def test_token_id_prompts_and_echo(server, tokenizer):
    prompts = [[5, 300, 77], [123]]

    async def go():
        async with client(server) as c:
            return await c.completions.create(model="fake-model", prompt=prompts, max_tokens=3, echo=True)

    result = run(go())
    assert len(result.choices) == 2
    for choice, prompt in zip(sorted(result.choices, key=lambda c: c.index), prompts):
        generated = hand_text(tokenizer, hand_tokens(prompt, 3, None, len(tokenizer)))
        assert choice.text == tokenizer.decode(prompt) + generated
    assert result.usage.prompt_tokens == 4 and result.usage.completion_tokens == 6


def _printable_stop(text):
    for start in range(2, len(text) - 2):
        window = text[start : start + 2]
        if window.isprintable() and "\ufffd" not in window and window.strip():
            return window
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(server, tokenizer, stream):
    prompt_ids = tokenizer.encode("stop here")
    full = hand_text(tokenizer, hand_tokens(prompt_ids, 40, None, len(tokenizer)))
    stop = _printable_stop(full)

    async def go():
        async with client(server) as c:
            result = await c.completions.create(
                model="fake-model", prompt="stop here", max_tokens=40, stop=[stop, "never-appears"], stream=stream
            )
            if not stream:
                return result.choices[0].text, result.choices[0].finish_reason
            chunks = [chunk async for chunk in result]
            text = "".join(c.text for chunk in chunks for c in chunk.choices)
            return text, next(c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason)

    text, finish = run(go())
    assert text == full[: full.index(stop)]
    assert finish == "stop"


def test_completion_logprobs_shape(server, tokenizer):
    async def go():
        async with client(server) as c:
            return await c.completions.create(model="fake-model", prompt="log", max_tokens=4, logprobs=2)

    choice = run(go()).choices[0]
    tokens = hand_tokens(tokenizer.encode("log"), 4, None, len(tokenizer))
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in tokens]
    assert lp.token_logprobs == [-0.5] * 4
    assert len(lp.top_logprobs) == 4
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == -0.5
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_chat_logprobs_shape(server, tokenizer):
    async def go():
        async with client(server) as c:
            return await c.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "lp"}],
                max_tokens=3,
                logprobs=True,
                top_logprobs=2,
            )

    choice = run(go()).choices[0]
    tokens = hand_tokens(chat_prompt_ids(tokenizer, "lp"), 3, None, len(tokenizer))
    content = choice.logprobs.content
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in tokens]
    for item, token in zip(content, tokens):
        assert item.logprob == -0.5 and item.bytes == list(item.token.encode())
        assert [alt.logprob for alt in item.top_logprobs] == [-0.5, -1.5]
        assert item.top_logprobs[1].token == tokenizer.decode([(token + 1) % len(tokenizer)])


def test_chat_logprobs_stream(server, tokenizer):
    async def go():
        async with client(server) as c:
            stream = await c.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "lp"}],
                max_tokens=5,
                logprobs=True,
                stream=True,
            )
            return [chunk async for chunk in stream]

    chunks = run(go())
    items = [item for chunk in chunks for c in chunk.choices if c.logprobs for item in c.logprobs.content]
    tokens = hand_tokens(chat_prompt_ids(tokenizer, "lp"), 5, None, len(tokenizer))
    assert [item.token for item in items] == [tokenizer.decode([t]) for t in tokens]
    assert all(item.top_logprobs == [] for item in items)


def test_models_and_auth(server):
    async def go():
        async with client(server) as c:
            models = await c.models.list()
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        return models

    models = run(go())
    assert [m.id for m in models.data] == ["fake-model"]


def test_unknown_model_is_404(server):
    async def go():
        async with client(server) as c:
            with pytest.raises(openai.NotFoundError) as info:
                await c.completions.create(model="other", prompt="x", max_tokens=1)
            return info.value

    error = run(go())
    assert error.body["code"] == "model_not_found" and error.body["param"] == "model"


def test_stream_sends_a_chunk_for_every_token_even_without_text(server, tokenizer):
    """vLLM's rule, which `vllm bench serve`'s TTFT / ITL rely on: a token that adds no visible
    text (here special token 1, skipped when decoding) still gets its chunk, with empty text."""
    vocab = len(tokenizer)
    prompt = [114]  # the first generated token: 7 * 114 + 3 = 801 = 1 (mod 400), a special token
    tokens = hand_tokens(prompt, 5, None, vocab)
    assert vocab == 400 and tokens[0] == 1 and hand_text(tokenizer, tokens[:1]) == ""
    chat_ids = chat_prompt_ids(tokenizer, "x")  # ends with <|assistant|> (id 3): 7 * 3 + 3 + 377 = 401
    chat_tokens = hand_tokens(chat_ids, 5, 377, vocab)
    assert chat_tokens[0] == 1

    async def go():
        async with client(server) as c:
            stream = await c.completions.create(model="fake-model", prompt=prompt, max_tokens=5, stream=True)
            completion = [chunk async for chunk in stream]
            stream = await c.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=5, seed=377, stream=True
            )
            return completion, [chunk async for chunk in stream]

    completion, chat = run(go())
    texts = [choice.text for chunk in completion for choice in chunk.choices]
    assert len(texts) == 5 and texts[0] == ""
    assert "".join(texts) == hand_text(tokenizer, tokens)
    deltas = [choice.delta for chunk in chat for choice in chunk.choices]
    assert deltas[0].role == "assistant" and len(deltas) == 1 + 5  # the role chunk, then one per token
    assert deltas[1].content == ""
    assert "".join(d.content or "" for d in deltas) == hand_text(tokenizer, chat_tokens)
