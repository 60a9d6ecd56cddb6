"""The engine loop in its own process (`runtime/engine/process_client.py`).

The whole OpenAI-client suite of test_server_engine.py also runs against this client (its
`server` fixture is parametrized); here: the typed messages and the deltas they carry, start-up failure, the child's death, and a parent that never starts a JAX backend.
"""

import asyncio
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from runtime.engine.llm import LLM
from runtime.engine.messages import (
    AbortRequest,
    AddRequest,
    CompileGrammar,
    EngineDied,
    GrammarCompiled,
    Refusal,
    StepOutputs,
    Stop,
)
from runtime.engine.process_client import EngineProcessClient
from runtime.types import (
    CompletionOutput,
    EngineBusy,
    EngineRequest,
    RequestDelta,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
    TokenLogprob,
    accumulate,
)
from server.testing import LiveServer
from tests.engine_testing import launch_config


# ---- the messages: typed dataclasses, the engine's deltas as they are ----------------------------
def test_messages_cross_the_pipe_unchanged_and_deltas_add_up():
    lp = [TokenLogprob(7 + i, -0.5 * i, [(7 + i, -0.5 * i), (3, -2.0)]) for i in range(4)]
    prompt_lp = [None, TokenLogprob(2, -1.25, [(2, -1.25)], rank=1)]
    deltas = [
        RequestDelta("a", [7], "he", lp[:1], num_cached_tokens=16, prompt_logprobs=prompt_lp),
        RequestDelta("a", [8, 9], "llo", lp[1:3], num_cached_tokens=16),
        RequestDelta("a", [], "", [], num_cached_tokens=16),  # nothing new
        RequestDelta("a", [10], "!", lp[3:], "stop", ".", num_cached_tokens=16),
    ]
    request = EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=8), validated=True)
    messages = [
        AddRequest(request),
        AbortRequest("a"),
        CompileGrammar(3, StructuredOutput("regex", "a+")),
        Stop(),
        StepOutputs(deltas, [Refusal("b", "invalid", "prompt: must not be empty")], {"num_running": 1}),
        GrammarCompiled(3, None),
        EngineDied("the engine loop died"),
    ]
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message
    out = None
    for delta in deltas:
        out = accumulate(out, delta, request.prompt_token_ids)
    completion = CompletionOutput(0, [7, 8, 9, 10], "hello!", lp, "stop", ".")
    assert out == RequestOutput(
        "a", [1, 2, 3], [completion], finished=True, num_cached_tokens=16, prompt_logprobs=prompt_lp
    )
    # refusals come back as the exceptions the server maps: 400, 503, 500
    assert type(Refusal.of("b", SamplingParamsError("prompt", "must not be empty")).error()) is ValueError
    assert type(Refusal.of("b", EngineBusy("full")).error()) is EngineBusy
    assert type(Refusal.of("b", KeyError("x")).error()) is RuntimeError


# ---- a live child process ------------------------------------------------------------------------
def _post(url: str, body: dict) -> tuple[int, str]:
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"model": "tiny-model", **body}) as r:
                return r.status, await r.text()

    return asyncio.run(go())


def test_start_up_failure_is_reported_and_the_child_is_gone(tiny_checkpoint):
    config = launch_config(tiny_checkpoint("llama"), num_pages=9)
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"the engine failed to start: ValueError: .*holds 128 tokens"):
        EngineProcessClient.start(config, str(tiny_checkpoint("llama")), "tiny-model")
    assert time.time() - t0 < 120
    # every child multiprocessing started is gone
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name == "jaxserve-engine"]


def test_a_killed_engine_process_fails_its_requests_and_health(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    client = EngineProcessClient.start(launch_config(path), str(path), "tiny-model")
    live = LiveServer(client)
    try:
        status, body = _post(live.url, {"prompt": "Hi", "max_tokens": 3})
        assert status == 200, body

        async def stream_until_killed():
            async with aiohttp.ClientSession() as session:
                body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 400, "stream": True, "ignore_eos": True}
                async with session.post(live.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.content.readline()  # the stream is running
                    os.kill(client.pid, signal.SIGKILL)
                    return (await asyncio.wait_for(r.content.read(), 30)).decode()

        rest = asyncio.run(stream_until_killed())
        assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-500:]
        assert not client.is_healthy()

        async def health():
            async with aiohttp.ClientSession() as session:
                async with session.get(live.url + "/health") as r:
                    return r.status

        assert asyncio.run(health()) == 503
        status, body = _post(live.url, {"prompt": "Hi", "max_tokens": 2})
        assert status >= 500 and "error" in json.loads(body), body
    finally:
        live.close()
        asyncio.run(client.shutdown())
    assert client._process.exitcode == -signal.SIGKILL


_PARENT_SCRIPT = """
import asyncio, json, sys
import jax._src.xla_bridge as xla_bridge
from configs.schema import LaunchConfig
from runtime.engine.process_client import EngineProcessClient
from runtime.types import EngineRequest, SamplingParams

config = LaunchConfig.model_validate(json.loads(sys.argv[1]))
client = EngineProcessClient.start(config, config.model.path, "tiny-model")

async def main():
    try:
        request = EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        outputs = [out async for out in client.generate(request)]
        return [t for out in outputs for t in out.new_token_ids], client.stats()
    finally:
        await client.shutdown()

tokens, stats = asyncio.run(main())
print(json.dumps({"tokens": tokens, "backend": xla_bridge.backends_are_initialized(), "stats": stats}))
"""


def test_the_parent_starts_no_jax_backend_and_gets_the_engines_tokens(tiny_checkpoint):
    """On a GPU or TPU host the server process must hold no device memory: only the child does."""
    path = tiny_checkpoint("llama")
    config = launch_config(path)
    proc = subprocess.run(
        [sys.executable, "-c", _PARENT_SCRIPT, config.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] is False
    offline = LLM(
        str(path),
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_pages=120,
        max_model_len=512,
        aot_compile=False,
    )
    ref = offline.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert result["tokens"] == ref.token_ids
    assert result["stats"]["pages_free"] + result["stats"]["pages_cached"] == result["stats"]["pages_total"]


def test_grammars_compile_off_the_loop_and_outputs_follow_them(tiny_checkpoint):
    """The child compiles each grammar on the compiler's pool and admits the request when it is
    ready; the outputs are checked by independent validators (jsonschema, `re`)."""
    import jsonschema
    import openai

    from tests.structured_cases import json_schemas, regexes

    path = tiny_checkpoint("llama")
    client = EngineProcessClient.start(launch_config(path), str(path), "tiny-model")
    live = LiveServer(client)
    schemas, patterns = json_schemas(12), regexes(8)
    try:

        async def main():
            async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
                calls = [
                    c.chat.completions.create(
                        model="tiny-model",
                        messages=[{"role": "user", "content": f"case {i}"}],
                        temperature=1.0,
                        seed=i,
                        max_tokens=200,
                        response_format={"type": "json_schema", "json_schema": {"name": f"c{i}", "schema": schema}},
                    )
                    for i, schema in enumerate(schemas)
                ]
                calls += [
                    c.completions.create(
                        model="tiny-model",
                        prompt=f"regex {i}",
                        temperature=1.0,
                        seed=i,
                        max_tokens=60,
                        extra_body={"structured_outputs": {"regex": pattern}},
                    )
                    for i, pattern in enumerate(patterns)
                ]
                return await asyncio.gather(*calls)

        responses = asyncio.run(main())

        async def invalid_grammar():  # straight to the client: the server would have refused it first
            from runtime.types import StructuredOutput

            params = SamplingParams(max_tokens=4, structured_output=StructuredOutput("json", "{not json"))
            return [out async for out in client.generate(EngineRequest("bad-grammar", [5, 6], params))]

        with pytest.raises(ValueError):  # the engine's refusal crosses the pipe as a ValueError (a 400)
            live.call(invalid_grammar())
        for schema, response in zip(schemas, responses):
            assert response.choices[0].finish_reason == "stop", response
            jsonschema.validate(json.loads(response.choices[0].message.content), schema)
        for pattern, response in zip(patterns, responses[len(schemas) :]):
            assert re.fullmatch(pattern, response.choices[0].text), (pattern, response.choices[0].text)
        deadline = time.time() + 10
        while client.stats()["num_running"] and time.time() < deadline:
            time.sleep(0.1)
        stats = client.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    finally:
        live.close()
        asyncio.run(client.shutdown())
