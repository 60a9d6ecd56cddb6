"""The official `openai` client, unchanged, against a live server backed by the real JAX engine
(its loop on a thread, and in a child process).

References: the offline `LLM` API on the same checkpoint (greedy text and tokens), HF
transformers (logprobs), and the engine's own accounting (every page and slot free at the end).
"""

import asyncio
import time

import aiohttp
import numpy as np
import openai
import pytest
import torch

from configs.schema import ServerConfig
from models import load_model
from runtime.engine.llm import LLM
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.process_client import EngineProcessClient
from runtime.engine.thread_client import AsyncEngine
from runtime.engine_config import EngineConfig
from runtime.types import SamplingParams
from server.testing import LiveServer
from tests.engine_testing import launch_config

PROMPT = "def fibonacci(n):\n    "
FAMILY = "qwen3_5"  # a GDN hybrid: requests hold KV pages *and* a state slot


def _config(path) -> EngineConfig:
    return EngineConfig(
        model=str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_pages=120, max_model_len=512
    )


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint(FAMILY), dtype="float32")


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, model):
    """The engine loop on a thread of this process (`AsyncEngine`), or in a child process
    (`EngineProcessClient`, the `jaxserve serve` default) loading the same checkpoint."""
    if request.param == "thread":
        engine = AsyncEngine(LLMEngine(_config(model.path), model=model), "tiny-model")
    else:
        engine = EngineProcessClient.start(launch_config(model.path, aot=True), str(model.path), "tiny-model")
    try:
        live = LiveServer(engine, ServerConfig(max_waiting_requests=256))
        try:
            yield live
        finally:
            live.close()
    finally:
        asyncio.run(engine.shutdown())  # the process client stops its child by PID


@pytest.fixture(scope="module")
def offline(model):  # same checkpoint and weights, a separate engine
    return LLM(model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_pages=120, max_model_len=512)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_completion_equals_offline(client, offline):
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    r = client.completions.create(
        model="tiny-model", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids) == 20
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    stream = client.completions.create(
        model="tiny-model",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == 20


def test_chat_equals_offline(client, offline):
    messages = [{"role": "user", "content": "Say something about lists."}]
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = offline.tokenizer.encode(text, add_special_tokens=False)
    ref = offline.generate([prompt_ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    r = client.chat.completions.create(model="tiny-model", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    stream = client.chat.completions.create(
        model="tiny-model", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


def test_n2_seed_reproducible(client):
    kw = dict(model="tiny-model", prompt=PROMPT, max_tokens=12, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert len(a.choices) == 2
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_stop_string(client, offline):
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].text
    stop = ref[len(ref) // 2 : len(ref) // 2 + 3]
    assert stop.strip(), ref
    r = client.completions.create(
        model="tiny-model", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref[: ref.index(stop)]


def test_logprobs_match_hf(client, model, offline, hf_model):
    r = client.completions.create(
        model="tiny-model", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(t) >= 3 for t in lp.top_logprobs)
    prompt_ids = model.tokenizer.encode(PROMPT)
    gen_ids = offline.generate([prompt_ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    hf = hf_model(FAMILY)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + gen_ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1).numpy()
    for i, token_lp in enumerate(lp.token_logprobs):
        expected = ref[len(prompt_ids) - 1 + i]
        assert abs(token_lp - expected[gen_ids[i]]) < 1e-3, (i, token_lp, expected[gen_ids[i]])
        top3 = sorted(lp.top_logprobs[i].values(), reverse=True)[:3]
        np.testing.assert_allclose(top3, np.sort(expected)[::-1][:3], atol=1e-3)


def _all_free(stats) -> bool:
    return (
        stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
        and stats["slots_free"] + stats["slots_cached"] == stats["slots_total"]
    )


def test_disconnect_burst_frees_everything(server):
    async def one(session, i):
        body = {"model": "tiny-model", "prompt": f"{PROMPT}{i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # first chunk arrives, then the client goes away

    async def burst():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session, i) for i in range(100)))

    asyncio.run(burst())
    deadline = time.time() + 60
    while not _all_free(server.engine.stats()) and time.time() < deadline:
        time.sleep(0.2)
    assert _all_free(server.engine.stats()), server.engine.stats()


def test_prompt_token_ids_are_checked_against_the_model_vocabulary(client, model, offline):
    """The bound is the model's embedding (vLLM's rule), not the tokenizer's length: the tiny
    checkpoint's tokenizer is smaller than its vocabulary, and ids between the two are valid input."""
    vocab = model.cfg.vocab_size
    prompt = [vocab - 1, 5, vocab - 2]
    ref = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    r = client.completions.create(
        model="tiny-model", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].text == ref.text
    with pytest.raises(openai.BadRequestError, match=rf"token id {vocab} is out of vocabulary \(size {vocab}\)"):
        client.completions.create(model="tiny-model", prompt=[5, vocab], max_tokens=4)
    r = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1  # the refused request cost nothing: the server goes on


def test_cached_tokens_come_from_prefix_cache_hits(client):
    prompt = "A cached prefix. " + PROMPT * 12  # several full pages, shared by no other test
    first = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    page_size = 16
    assert page_size <= cached < second.usage.prompt_tokens and cached % page_size == 0  # whole pages


def test_stop_reason_is_the_stop_token_id(client, offline):
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    stop_id = ref.token_ids[1]
    r = client.completions.create(
        model="tiny-model",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.model_extra is not None
    assert r.choices[0].model_extra["stop_reason"] == stop_id
    assert r.usage.completion_tokens == 2


def test_start_up_refuses_a_kv_pool_smaller_than_one_sequence(model):
    config = EngineConfig(
        model=str(model.path),
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_pages=9,
        max_model_len=512,
    )
    with pytest.raises(ValueError, match=r"holds 128 tokens \(8 usable pages x 16\).*max_model_len=512.*32 pages"):
        LLMEngine(config, model=model)
