"""Issue 11 over HTTP with the real engine: a failing step costs only its own requests (500s in
OpenAI's error shape), then the next 50 requests succeed and nothing is held; a dead engine
loop turns /health into 503 within a second and the server exits 1 after draining; the
reproducers of values that overflowed the device arrays get their 400 (or, for top_k, vLLM's
clip to the vocabulary); and lm-eval's exact `local-completions` scoring requests return the
prompt's logprobs equal to HF log_softmax within 1e-4.
"""

import asyncio
import time

import aiohttp
import numpy as np
import openai
import pytest
import torch
from engine_testing import FailingStep, live_engine_server

from configs.schema import ServerConfig
from models import load_model
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.thread_client import AsyncEngine
from runtime.engine_config import EngineConfig
from server.runner import serve_async
from server.testing import FakeEngine, LiveServer, build_test_tokenizer

FAMILY = "llama"


def _engine(model) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(model.path),
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_pages=60,
            max_model_len=256,
        ),
        model=model,
    )


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint(FAMILY), dtype="float32")


@pytest.fixture(scope="module")
def server(model):
    with live_engine_server(_engine(model), "tiny-model", max_waiting_requests=256) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def go():
        async with aiohttp.ClientSession() as session:

            async def one(body):
                async with session.post(url + "/v1/completions", json=body) as r:
                    return r.status, await r.json()

            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(go())


def _all_free(stats) -> bool:
    return (
        stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    )


def _wait_all_free(engine) -> None:
    deadline = time.time() + 30
    while not _all_free(engine.stats()) and time.time() < deadline:
        time.sleep(0.05)
    assert _all_free(engine.stats()), engine.stats()


def test_failing_step_fails_its_requests_then_50_succeed(server):
    async_engine = server.engine
    real = async_engine.engine.executables
    async_engine.engine.executables = FailingStep(real, "run_sampler", times=1)
    try:
        body = {"prompt": "Hi there", "max_tokens": 4, "temperature": 0.5, "seed": 1}
        ((status, answer),) = _post_all(server.url, [body])
    finally:
        async_engine.engine.executables = real
    assert async_engine.engine.executables is real
    assert status == 500 and answer["error"]["type"] == "internal_error", answer
    _wait_all_free(async_engine)
    bodies = [{"prompt": f"request {i}", "max_tokens": 2, "temperature": 0} for i in range(50)]
    results = _post_all(server.url, bodies)
    assert [s for s, _ in results] == [200] * 50, [a for s, a in results if s != 200][:2]
    assert all(a["usage"]["completion_tokens"] >= 1 for _, a in results)
    _wait_all_free(async_engine)
    async_engine.engine.scheduler.check_invariants()


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "Hi", "max_tokens": 2, "top_k": 2147483648}, 200, None),  # clipped to the vocabulary (vLLM)
        ({"prompt": "Hi", "min_tokens": 2, "stop_token_ids": [1099511627776]}, 400, "stop_token_ids"),
        ({"prompt": "Hi", "min_tokens": 100}, 400, "min_tokens"),  # default max_tokens 16
        ({"prompt": "Hi", "max_tokens": 2, "logit_bias": {"1099511627776": 5}}, 400, "logit_bias"),
    ],
)
def test_reproducers_get_their_status_and_never_wedge(server, body, status, param):
    ((got, answer),) = _post_all(server.url, [body])
    assert got == status, answer
    if param is not None:
        assert answer["error"]["param"] == param
    ((after, answer),) = _post_all(server.url, [{"prompt": "still serving?", "max_tokens": 2}])
    assert after == 200, answer
    _wait_all_free(server.engine)


def _hf_log_softmax(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(FAMILY)(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_local_completions_requests_match_hf(server, model, hf_model, max_tokens):
    """lm-eval 0.4's `local-completions` loglikelihood request, verbatim (the prompt as one list of
    token ids), with max_tokens 1 and 0."""
    ids = np.random.default_rng(5).integers(3, model.cfg.vocab_size, size=37).tolist()
    body = {
        "model": "tiny-model",
        "prompt": [ids],
        "max_tokens": max_tokens,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
        "seed": 1234,
    }
    ((status, answer),) = _post_all(server.url, [body])
    assert status == 200, answer
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    ref = _hf_log_softmax(hf_model, ids)
    assert len(lp["token_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1 : len(ids)])
    np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    for i in range(1, len(ids)):  # lm-eval's is_greedy: the token's logprob against max(top_logprobs)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(ref[i - 1].max(), abs=1e-4)
    if max_tokens == 1:
        assert abs(lp["token_logprobs"][-1] - ref[-1].max()) < 1e-4  # greedy continuation
    else:
        assert answer["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    _wait_all_free(server.engine)


def test_vllm_prompt_logprobs_field(client, model, hf_model):
    ids = list(range(40, 60))
    r = client.completions.create(
        model="tiny-model", prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = r.choices[0].model_extra["prompt_logprobs"]
    ref = _hf_log_softmax(hf_model, ids)
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        entry = scored[i][str(ids[i])]
        assert abs(entry["logprob"] - ref[i - 1, ids[i]]) < 1e-4
        assert entry["rank"] == 1 + int(np.sum(ref[i - 1] > ref[i - 1, ids[i]] + 1e-9))
        assert len(scored[i]) in (2, 3)  # the top 2 plus the prompt token when it is not among them


def test_dead_engine_loop_makes_health_503_within_a_second(model):
    async_engine = AsyncEngine(_engine(model), "tiny-model")
    live = LiveServer(async_engine)
    try:
        async_engine.engine.executables = FailingStep(
            async_engine.engine.executables, "run_table_backbone", after_real_call=True
        )  # the caches are lost
        ((status, _),) = _post_all(live.url, [{"prompt": "Hi", "max_tokens": 2}])
        assert status == 500
        t0 = time.time()

        async def health():
            async with aiohttp.ClientSession() as session:
                async with session.get(live.url + "/health") as r:
                    return r.status

        while asyncio.run(health()) != 503:
            assert time.time() - t0 < 1.0, "/health still 200 a second after the engine died"
            time.sleep(0.05)
        assert not async_engine.is_healthy()
        ((status, _),) = _post_all(live.url, [{"prompt": "Hi", "max_tokens": 2}])
        assert status >= 500
    finally:
        live.close()
        asyncio.run(async_engine.shutdown())


def test_server_drains_and_exits_1_when_the_engine_dies():
    engine = FakeEngine(build_test_tokenizer())

    async def go():
        stop = asyncio.Event()
        serving = asyncio.create_task(serve_async(engine, ServerConfig(host="127.0.0.1", port=0), stop))
        await asyncio.sleep(0.3)
        engine.healthy = False
        return await asyncio.wait_for(serving, 10)

    assert asyncio.run(go()) == 1
    assert engine.shutdown_called


def test_streamed_prompt_logprobs_equal_the_non_streamed_answer(server):
    """The scored prompt leads each streamed choice (echoed text + its logprobs, and vLLM's
    prompt_logprobs); the concatenation equals the non-streamed answer."""
    body = {
        "prompt": [list(range(50, 70))],
        "max_tokens": 3,
        "logprobs": 2,
        "echo": True,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    ((status, whole),) = _post_all(server.url, [body])
    assert status == 200, whole

    async def stream():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status == 200
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        import json

        return [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]

    chunks = asyncio.run(stream())
    expected = whole["choices"][0]
    assert chunks[0]["prompt_logprobs"] == expected["prompt_logprobs"]
    assert "".join(c["text"] for c in chunks) == expected["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]] == expected["logprobs"][key], key


def test_logit_bias_over_http_forces_a_token(client, model):
    r = client.completions.create(
        model="tiny-model",
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logprobs=0,
        logit_bias={"17": 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].logprobs.tokens == [model.tokenizer.decode([17])] * 3
