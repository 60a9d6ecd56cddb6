"""Raw-HTTP edge cases of the server with FakeEngine: OpenAI error JSON with the right status
for bad input, disconnects that free engine capacity, 429/503, metrics, OpenAPI, drain."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from configs.schema import ServerConfig
from server.runner import drain_and_stop
from server.testing import FakeEngine, LiveServer, build_test_tokenizer

MAX_BODY = 12 * 1024 * 1024
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=256, num_slots=8, token_delay_s=0.005)
    with LiveServer(engine, ServerConfig(max_body_bytes=MAX_BODY)) as live:
        yield live


def run(coro):
    return asyncio.run(coro)


async def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.read(), r.headers


def assert_openai_error(status, raw, expected_status, param=None):
    assert status == expected_status, raw[:300]
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
        assert param.split(".")[0] in body["error"]["message"], body
    return body["error"]


BAD_COMPLETIONS = [
    (b'{"prompt": ', None),
    (b"[1, 2]", None),
    (b'{"prompt": "\xff\xfe"}', None),
    (b'{"prompt": "x", "temperature": NaN}', None),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**20}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": [1] * 300}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
    # issue 11's reproducers: values that overflowed the device arrays or were 500s
    ({"prompt": "Hi", "min_tokens": 2, "stop_token_ids": [1099511627776]}, "stop_token_ids"),
    ({"prompt": "Hi", "min_tokens": 100}, "min_tokens"),  # default max_tokens 16
    ({"prompt": "x", "logit_bias": {"1099511627776": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids.0"),
]

BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content",
    ),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "logprobs": 3}, "logprobs"),
    ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({**CHAT, "max_completion_tokens": 1000}, "max_completion_tokens"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),  # a function tool without its function
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_bad_completion_is_400(server, body, param):
    status, raw, _ = run(post(server.url + "/v1/completions", body))
    error = assert_openai_error(status, raw, 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", BAD_CHATS, ids=range(len(BAD_CHATS)))
def test_bad_chat_is_400(server, body, param):
    status, raw, _ = run(post(server.url + "/v1/chat/completions", body))
    assert_openai_error(status, raw, 400, param)


def test_bad_request_id_header(server):
    status, raw, _ = run(post(server.url + "/v1/completions", {"prompt": "x"}, {"X-Request-ID": "a b"}))
    assert_openai_error(status, raw, 400, "X-Request-ID")


def test_routes_methods_and_bodies(server):
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/v1/nothing") as r:
                not_found = (r.status, await r.read())
            async with session.get(server.url + "/v1/completions") as r:
                wrong_method = (r.status, await r.read())
            async with session.post(server.url + "/v1/completions", data=b"{" + b" " * (MAX_BODY + 10) + b"}") as r:
                too_large = (r.status, await r.read())

            async def chunks():
                for _ in range(13):
                    yield b" " * (1024 * 1024)

            async with session.post(
                server.url + "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}
            ) as r:
                too_large_chunked = (r.status, await r.read())
        return not_found, wrong_method, too_large, too_large_chunked

    not_found, wrong_method, too_large, too_large_chunked = run(go())
    assert_openai_error(*not_found, 404)
    assert_openai_error(*wrong_method, 405)
    assert_openai_error(*too_large, 413)
    assert_openai_error(*too_large_chunked, 413)


def test_ten_megabyte_bodies_are_client_errors(server):
    ids = json.dumps({"prompt": [1] * (10 * 1024 * 1024 // 3)}).encode()
    garbage = b'{"prompt": "' + b"\x80" * (10 * 1024 * 1024) + b'"}'
    for body in (ids, garbage):
        assert len(body) >= 10 * 1024 * 1024
        status, raw, _ = run(post(server.url + "/v1/completions", body))
        assert_openai_error(status, raw, 400)


def test_tokenize_detokenize(server, tokenizer):
    text = "Tokenize this, please."
    status, raw, _ = run(post(server.url + "/tokenize", {"prompt": text}))
    assert status == 200
    body = json.loads(raw)
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    status, raw, _ = run(post(server.url + "/detokenize", {"tokens": body["tokens"]}))
    assert status == 200 and json.loads(raw)["prompt"] == text
    status, raw, _ = run(post(server.url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}))
    assert json.loads(raw)["tokens"] == tokenizer.encode("<|user|>hi<|end|><|assistant|>", add_special_tokens=False)
    assert_openai_error(*run(post(server.url + "/detokenize", {"tokens": [10**6]}))[:2], 400, "tokens")
    assert_openai_error(*run(post(server.url + "/tokenize", {"prompt": 5}))[:2], 400, "prompt")


def test_metrics_openapi_health_version(server):
    run(post(server.url + "/v1/completions", {"prompt": "count me", "max_tokens": 3}))

    async def go():
        async with aiohttp.ClientSession() as session:
            pages = {}
            for path in ("/metrics", "/openapi.json", "/health", "/version"):
                async with session.get(server.url + path) as r:
                    pages[path] = (r.status, await r.text())
            return pages

    pages = run(go())
    assert all(status == 200 for status, _ in pages.values())
    families = {f.name: f for f in text_string_to_metric_families(pages["/metrics"][1])}
    for name in (
        "jaxserve_num_requests_running",
        "jaxserve_num_requests_waiting",
        "jaxserve_kv_cache_usage_ratio",
        "jaxserve_state_slots_free",
        "jaxserve_prefix_cache_hit_rate",
        "jaxserve_time_to_first_token_seconds",
        "jaxserve_inter_token_latency_seconds",
        "jaxserve_e2e_request_latency_seconds",
        "jaxserve_prompt_tokens",
        "jaxserve_generation_tokens",
    ):
        assert name in families, name
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    assert samples["jaxserve_generation_tokens_total"] >= 3
    assert samples["jaxserve_time_to_first_token_seconds_count"] >= 1
    assert samples["jaxserve_state_slots_total"] == 8
    spec = json.loads(pages["/openapi.json"][1])
    assert spec["openapi"].startswith("3.")
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
    } <= set(spec["paths"])
    ref = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert "messages" in schema["properties"] and "messages" in schema["required"]
    assert json.loads(pages["/version"][1])["version"]


def test_disconnect_burst_frees_every_slot(server):
    engine = server.engine

    async def one(session, index):
        body = {**CHAT, "max_tokens": 200, "stream": True}
        response = await session.post(
            server.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": f"burst-{index}"}
        )
        assert response.status == 200
        data_lines = 0
        while data_lines < 2:  # the role chunk, then a first token: the engine is generating
            data_lines += (await response.content.readline()).startswith(b"data:")
        response.close()  # drop the connection mid-stream

    already = len(engine.requests)

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(one(session, i) for i in range(100)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if engine.slots_free == engine.num_slots and engine.num_waiting == 0:
                break
            await asyncio.sleep(0.05)

    run(go())
    burst = {request.request_id for request in engine.requests[already:]}
    assert len(burst) == 100  # unique engine ids: X-Request-ID is echoed, never used as the key
    assert engine.slots_free == engine.num_slots and engine.num_waiting == 0
    assert burst <= engine.aborted  # every one was aborted by the server, not run to the end
    assert not burst & engine.finished


def test_non_streaming_disconnect_aborts(server):
    engine = server.engine
    already = len(engine.requests)

    async def go():
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(
                session.post(
                    server.url + "/v1/completions",
                    json={"prompt": "slow", "max_tokens": 200},
                    headers={"X-Request-ID": "gone"},
                )
            )
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 10
        while (
            not (engine.requests[already:] and engine.requests[already].request_id in engine.aborted)
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)

    run(go())
    (gone,) = [request.request_id for request in engine.requests[already:]]
    assert gone in engine.aborted and gone not in engine.finished


def test_full_queue_is_429_and_auth_is_401(tokenizer):
    engine = FakeEngine(tokenizer, num_slots=1, token_delay_s=0.02)
    config = ServerConfig(max_waiting_requests=2, api_key="sekrit")
    auth = {"Authorization": "Bearer sekrit"}
    with LiveServer(engine, config) as live:
        status, raw, _ = run(post(live.url + "/v1/completions", {"prompt": "x"}))
        assert_openai_error(status, raw, 401)
        status, raw, _ = run(post(live.url + "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer nope"}))
        assert_openai_error(status, raw, 401)

        async def go():
            async with aiohttp.ClientSession() as session:
                streams = [
                    await session.post(
                        live.url + "/v1/chat/completions",
                        headers=auth,
                        json={**CHAT, "max_tokens": 100, "stream": True},
                    )
                    for _ in range(3)
                ]
                while engine.num_waiting < 2:
                    await asyncio.sleep(0.01)
                async with session.post(live.url + "/v1/completions", json={"prompt": "x"}, headers=auth) as r:
                    result = (r.status, await r.read())
                for stream in streams:
                    stream.close()
                return result

        status, raw = run(go())
        assert_openai_error(status, raw, 429)


def test_drain_finishes_in_flight_and_refuses_new(tokenizer):
    engine = FakeEngine(tokenizer, token_delay_s=0.02)
    live = LiveServer(engine, ServerConfig(drain_timeout_s=10))
    try:

        async def go():
            async with aiohttp.ClientSession() as session:
                in_flight = await session.post(
                    live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True}
                )
                await in_flight.content.readline()
                drain = asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(drain_and_stop(live.runner, engine, 10.0), live.loop)
                )
                await asyncio.sleep(0.05)
                async with session.post(live.url + "/v1/completions", json={"prompt": "x"}) as r:
                    refused = (r.status, await r.read())
                async with session.get(live.url + "/health") as r:
                    health = r.status
                rest = await in_flight.read()
                return refused, health, rest, await drain

        refused, health, rest, drained = run(go())
    finally:
        live.loop.call_soon_threadsafe(live.loop.stop)
    assert_openai_error(*refused, 503)
    assert health == 503
    assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason": "length"' in rest
    assert drained and engine.shutdown_called


def test_cli_serve_sigterm_drains_and_exits_zero():
    """`jaxserve serve --fake-engine` end to end: ready line, a request, SIGTERM, exit code 0."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--fake-engine",
        "--set",
        "server.port=0",
        "--set",
        "model.served_model_name=sig-model",
        "--set",
        "server.drain_timeout_s=5",
    ]
    proc = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "jaxserve ready at" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "server exited before it was ready"
        assert "(model sig-model)" in line
        url = line.split("jaxserve ready at ")[1].split()[0]
        status, _raw, _ = run(post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2}))
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "jaxserve stopped" in output


def test_cli_config_command_reports_field_errors():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ok = subprocess.run(
        [sys.executable, "-m", "server.cli", "config", "--set", "cache.page_size=32"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["cache"]["page_size"] == 32
    bad = subprocess.run(
        [sys.executable, "-m", "server.cli", "config", "--set", "cache.page_size=24"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "cache.page_size: must be a power of two" in bad.stderr
