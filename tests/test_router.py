"""`jaxserve router`: routing decisions, affinity, retries, cuts, health, admin, byte-for-byte relay.

Fast tests run the router in-process in front of fake aiohttp replicas whose behaviour each test
scripts (fail with a 5xx, drop the connection before or after the first byte, hold a request).
The fakes' `/tokenize` returns a prompt's UTF-8 bytes as its tokens, so block counts are computed
by hand. The official `openai` client talks to the router in front of two real jaxserve servers
(FakeEngine). The slow test runs two real tiny-hybrid `jaxserve serve` replicas on loopback.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from aiohttp import web
from import_testing import imports_jax

from server.router import Router
from server.router_config import RouterConfig, RouterConfigError, build_config
from server.router_policy import BlockIndex, CacheAware, Candidate, RoundRobin, block_hashes

SCENARIO_TIMEOUT_S = 30.0
KEY = "router-admin-key-0123"


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, SCENARIO_TIMEOUT_S))


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, runner.addresses[0][1]


# ---- the policy, by hand -----------------------------------------------------------------------
def test_block_hashes_chain_prefixes_and_drop_the_partial_block():
    a = block_hashes(list(range(10)), 4)  # blocks [0..3], [4..7]; 8, 9 are a partial block
    b = block_hashes([*range(8), 99, 98, 97, 96], 4)
    c = block_hashes([0, 1, 2, 3, 4, 5, 6, 99], 4)
    assert len(a) == 2 and len(b) == 3 and len(c) == 2
    assert a == b[:2]  # same first 8 tokens
    assert c[0] == a[0] and c[1] != a[1]
    assert block_hashes([5, 6, 7, 8], 4) != block_hashes([0, 1, 2, 3, 5, 6, 7, 8], 4)[1:]  # chained, not per block
    assert block_hashes([1, 2, 3], 4) == []


def test_index_matches_leading_blocks_evicts_lru_and_forgets():
    index = BlockIndex(capacity=4)
    conversation = block_hashes(list(range(12)), 4)  # 3 blocks
    index.insert(0, conversation)
    assert index.match(0, conversation) == 3
    assert index.match(0, block_hashes([*range(8), 7, 7, 7, 7], 4)) == 2
    assert index.match(1, conversation) == 0
    other = block_hashes(list(range(100, 112)), 4)
    index.insert(0, other)  # 6 hashes > capacity 4: the older prompt's last blocks go first
    assert index.size(0) == 4
    assert index.match(0, other) == 3 and index.match(0, conversation) == 1
    index.forget(0)
    assert index.size(0) == 0 and index.match(0, other) == 0


@pytest.mark.parametrize(
    "matches, loads, expected, by_affinity",
    [
        ((3, 1), (0, 0), 0, True),  # the longest match
        ((2, 4), (0, 0), 1, True),
        ((1, 3), (5, 0), 1, True),
        ((1, 0), (0, 0), 1, False),  # 1 of 4 blocks < 0.3: least loaded; tie -> the smaller index
        ((4, 0), (10, 0), 1, False),  # 10 above the least (> 8) and 10 > 0 x 1.5: imbalanced
        ((4, 0), (9, 8), 0, True),  # 1 above
        ((4, 0), (20, 10), 1, False),  # 10 above and 20 > 15
        ((4, 0), (20, 14), 0, True),  # 6 above: under the absolute margin
        ((4, 0), (30, 21), 0, True),  # 9 above but 30 < 31.5: under the relative margin
    ],
)
def test_cache_aware_decision_table(matches, loads, expected, by_affinity):
    index = BlockIndex(1000)
    prompt = block_hashes(list(range(16)), 4)  # 4 blocks
    for backend_id, matched in enumerate(matches):
        index.insert(backend_id, prompt[:matched])
    policy = CacheAware(index, cache_threshold=0.3, balance_abs=8, balance_rel=1.5)
    decision = policy.choose([Candidate(i, load) for i, load in enumerate(loads)], prompt)
    assert (decision.backend_id, decision.by_affinity) == (expected, by_affinity)


def test_round_robin_cycles_and_skips_a_missing_replica():
    policy = RoundRobin()
    picks = [policy.choose([Candidate(i, 0) for i in (0, 1, 2)], []).backend_id for _ in range(4)]
    assert picks == [0, 1, 2, 0]
    assert policy.choose([Candidate(0, 0), Candidate(2, 0)], []).backend_id == 2


def test_command_line_refusals():
    with pytest.raises(RouterConfigError, match="http"):
        build_config(["--backend", "ftp://127.0.0.1:1"])
    with pytest.raises(RouterConfigError, match="path"):
        build_config(["--backend", "http://127.0.0.1:1/v1"])
    with pytest.raises(RouterConfigError, match="twice"):
        build_config(["--backend", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:1/"])
    with pytest.raises(SystemExit):
        build_config(["--backend", "http://127.0.0.1:1", "--policy", "random"])
    config = build_config(["--backend", "http://127.0.0.1:1/", "http://b:2", "--backend", "http://c:3"])
    assert config.backends == ("http://127.0.0.1:1", "http://b:2", "http://c:3") and config.policy == "cache_aware"
    config = build_config(["--backend", "http://127.0.0.1:1/", "--policy", "round_robin"])
    assert config.backends == ("http://127.0.0.1:1",) and config.balance_abs == 64 and config.cache_threshold == 0.3


def test_cli_dispatch_router_and_its_pd_mode(capsys):
    from server.cli import main

    assert main(["router", "--backend", "ftp://x:1"]) == 2
    assert "jaxserve router:" in capsys.readouterr().err
    # --prefill/--decode is the P/D mode: the proxy's own start-up check answers
    pd = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--host", "0.0.0.0"]
    assert main(["router", *pd]) == 2 and "jaxserve proxy: refusing" in capsys.readouterr().err
    assert main(["proxy", *pd]) == 2 and "jaxserve proxy: refusing" in capsys.readouterr().err


def test_router_imports_no_jax():
    assert not imports_jax(
        "server.router",
        "server.router_config",
        "server.router_policy",
        "server.router_backends",
        "server.router_tokens",
        "server.router_pd",
    )


# ---- fake replicas -------------------------------------------------------------------------------
class FakeReplica:
    """`answer(request, raw_body)` replaces the default JSON completion; `health_status` is /health's."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []
        self.health_status = 200
        self.answer = None
        self.tokenize = self._tokenize
        self.runner = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self):
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({}, status=self.health_status))
        app.router.add_post("/tokenize", lambda request: self.tokenize(request))
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m"}]}))
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._completion)
        self.runner, self.port = await _serve(app, self.port)
        return self

    async def stop(self):
        await self.runner.cleanup()

    async def _tokenize(self, request):
        body = await request.json()
        text = body["prompt"] if "prompt" in body else "".join(m["content"] for m in body["messages"])
        return web.json_response({"tokens": list(text.encode())})

    async def _completion(self, request):
        raw = await request.read()
        self.bodies.append(raw)
        self.headers.append(dict(request.headers))
        if self.answer is not None:
            return await self.answer(request, raw)
        return web.json_response({"choices": [{"text": f"from {self.port}"}]})


class Deployment:
    def __init__(self, replicas: int = 2, **config):
        self.replicas = [FakeReplica() for _ in range(replicas)]
        self.config = config

    async def __aenter__(self):
        for replica in self.replicas:
            await replica.start()
        defaults = {"health_interval_s": 0.1, "health_timeout_s": 0.5, "health_failures": 2, "block_size": 4}
        config = RouterConfig(backends=tuple(r.url for r in self.replicas), **{**defaults, **self.config})
        self.router = Router(config)
        self.runner, port = await _serve(self.router.app())
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.runner.cleanup()
        for replica in self.replicas:
            await replica.stop()

    async def post(self, path="/v1/completions", headers=None, **body):
        async with self.session.post(self.url + path, json={"model": "m", **body}, headers=headers) as resp:
            return resp.status, await resp.read()

    def served(self) -> list[int]:
        return [len(r.bodies) for r in self.replicas]

    async def metrics(self) -> dict[str, float]:
        async with self.session.get(self.url + "/metrics") as resp:
            text = await resp.text()
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines() if line}

    async def wait_up(self, backend: int, up: bool, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while (await self.metrics())[f'jaxserve_router_backend_up{{backend="{backend}"}}'] != up:
            assert time.monotonic() < deadline, f"backend {backend} never became {'up' if up else 'down'}"
            await asyncio.sleep(0.05)


def _events(raw: bytes) -> list[str]:
    return [part[len("data: ") :] for part in raw.decode().split("\n\n") if part.startswith("data: ")]


SYSTEM = "You are a helpful assistant. " * 2


def _turns(name: str, n: int) -> list[list[dict]]:
    """n growing chat histories of one conversation."""
    messages, out = [{"role": "system", "content": f"{name}: {SYSTEM}"}], []
    for i in range(n):
        messages = [*messages, {"role": "user", "content": f"question {i} of {name}?"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"answer {i}."}]
    return out


def test_conversations_stick_to_their_replica_and_new_ones_spread():
    async def scenario():
        async with Deployment(cache_threshold=0.5) as d:
            a, b = _turns("alice", 3), _turns("bob", 3)
            for turn in range(3):
                for conversation, replica in ((a, 0), (b, 1)):
                    before = d.served()
                    status, _ = await d.post("/v1/chat/completions", messages=conversation[turn])
                    assert status == 200
                    assert [x - y for x, y in zip(d.served(), before)] == [int(replica == 0), int(replica == 1)]
            m = await d.metrics()
            assert m["jaxserve_router_by_affinity_total"] == 4  # every turn after the first
            assert m["jaxserve_router_affinity_share"] == pytest.approx(4 / 6)
            assert m['jaxserve_router_backend_affinity_routed_total{backend="1"}'] == 2
            assert m['jaxserve_router_backend_estimated_hit_blocks_total{backend="0"}'] > 0

    run(scenario())


def test_round_robin_ignores_affinity():
    async def scenario():
        async with Deployment(policy="round_robin") as d:
            for _ in range(4):
                assert (await d.post(prompt="the same prompt, long enough"))[0] == 200
            assert d.served() == [2, 2]

    run(scenario())


def test_load_imbalance_overrides_affinity():
    async def scenario():
        async with Deployment(balance_abs=1, balance_rel=1.5) as d:
            release = asyncio.Event()

            async def held(request, raw):
                await release.wait()
                return web.json_response({"choices": [{"text": "held"}]})

            prompt = "a shared prefix that is many blocks long"
            assert (await d.post(prompt=prompt))[0] == 200  # to replica 0 (tie), indexed there
            d.replicas[0].answer = held
            pending = [asyncio.create_task(d.post(prompt=prompt)) for _ in range(2)]
            while d.served()[0] < 3:  # both held by replica 0: 2 - 0 > 1 and 2 > 0 * 1.5
                await asyncio.sleep(0.01)
            assert d.served() == [3, 0]
            assert (await d.post(prompt=prompt))[0] == 200
            assert d.served() == [3, 1]  # affinity overridden
            release.set()
            assert [s for s, _ in await asyncio.gather(*pending)] == [200, 200]

    run(scenario())


@pytest.mark.parametrize("failure", ["500", "refused", "dropped_before_first_byte"])
def test_a_request_failing_before_its_first_byte_is_retried_once_elsewhere(failure):
    async def scenario():
        async with Deployment() as d:
            if failure == "refused":
                await d.replicas[0].stop()  # its port now refuses connections
            else:

                async def fail(request, raw):
                    if failure == "500":
                        return web.json_response({"error": {"message": "boom"}}, status=500)
                    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await out.prepare(request)
                    request.transport.close()
                    return out

                d.replicas[0].answer = fail
            status, raw = await d.post(prompt="hello there")
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == f"from {d.replicas[1].port}"
            m = await d.metrics()
            assert m["jaxserve_router_retries_total"] == 1
            assert m['jaxserve_router_backend_failures_total{backend="0"}'] == 1
            if failure == "refused":
                assert m['jaxserve_router_backend_up{backend="0"}'] == 0
                await d.replicas[0].start()  # same port: health checks bring it back

    run(scenario())


def test_both_replicas_failing_returns_the_last_error_and_no_third_try():
    async def scenario():
        async with Deployment(replicas=3) as d:

            async def fail(request, raw):
                return web.json_response({"error": {"message": "boom"}}, status=503)

            for replica in d.replicas:
                replica.answer = fail
            status, raw = await d.post(prompt="hello")
            assert status == 503 and json.loads(raw)["error"]["message"] == "boom"
            assert sum(d.served()) == 2

    run(scenario())


def test_a_stream_cut_mid_way_ends_with_an_error_event_and_done_without_retry():
    async def scenario():
        async with Deployment() as d:

            async def cut(request, raw):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                for i in range(2):
                    await out.write(f'data: {{"i": {i}}}\n\n'.encode())
                    await asyncio.sleep(0.05)
                request.transport.close()
                return out

            d.replicas[0].answer = cut
            status, raw = await d.post(prompt="hello", stream=True)
            events = _events(raw)
            assert status == 200 and events[:2] == ['{"i": 0}', '{"i": 1}']
            assert json.loads(events[2])["error"]["type"] == "internal_error" and events[3:] == ["[DONE]"]
            assert d.served() == [1, 0]
            assert (await d.metrics())["jaxserve_router_streams_cut_total"] == 1

    run(scenario())


def test_a_json_answer_cut_mid_way_ends_with_the_connection_not_a_clean_200():
    async def scenario():
        async with Deployment() as d:

            async def cut(request, raw):
                out = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
                await out.prepare(request)
                await out.write(b'{"choices": [{"text": "par')
                await asyncio.sleep(0.05)
                request.transport.close()
                return out

            d.replicas[0].answer = cut
            async with d.session.post(d.url + "/v1/completions", json={"prompt": "hello"}) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            assert d.served() == [1, 0]

    run(scenario())


def test_a_silent_tokenizer_delays_routing_by_its_timeout_only():
    async def scenario():
        async with Deployment(tokenize_timeout_s=0.2) as d:

            async def hang(request):
                await asyncio.sleep(3600)  # bounded by the scenario's timeout

            for replica in d.replicas:
                replica.tokenize = hang
            # the scenario's own timeout (30 s) is the bound: /tokenize never answers
            status, _ = await d.post("/v1/chat/completions", messages=[{"role": "user", "content": "hi " * 40}])
            assert status == 200
            assert (await d.metrics())["jaxserve_router_by_affinity_total"] == 0

    run(scenario())


def test_streaming_and_the_request_body_pass_byte_for_byte():
    chunks = [
        b'data: {"a": "\\u00e9\\ud83d\\ude00"}\n\n',
        b"data: {",
        b'"b": 1}\n\n',
        b": comment\n\n",
        b"data: [DONE]\n\n",
    ]

    async def scenario():
        async with Deployment() as d:

            async def stream(request, raw):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": "r1"})
                await out.prepare(request)
                for chunk in chunks:
                    await out.write(chunk)
                    await asyncio.sleep(0.02)
                return out

            for replica in d.replicas:
                replica.answer = stream
            sent = b'{"model":"m",  "prompt": "caf\\u00e9", "stream": true,"extra":[1,2.50]}'
            headers = {"Content-Type": "application/json", "Authorization": "Bearer client-key"}
            async with d.session.post(d.url + "/v1/completions", data=sent, headers=headers) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                assert resp.headers["X-Request-Id"] == "r1"
                assert await resp.read() == b"".join(chunks)
            served = next(r for r in d.replicas if r.bodies)
            assert served.bodies == [sent] and served.headers[0]["Authorization"] == "Bearer client-key"

    run(scenario())


def test_client_internal_headers_and_kv_transfer_params_are_not_forwarded():
    async def scenario():
        async with Deployment() as d:
            status, _ = await d.post(prompt="x", kv_transfer_params={"do_remote_prefill": True})
            assert status == 400 and d.served() == [0, 0]
            assert (await d.post(prompt="x", headers={"X-KV-Transfer-Token": "forged-0123456789"}))[0] == 200
            assert all("X-KV-Transfer-Token" not in h for r in d.replicas for h in r.headers)

    run(scenario())


def test_health_checks_take_a_replica_out_and_bring_it_back():
    async def scenario():
        async with Deployment() as d:
            d.replicas[0].health_status = 500
            await d.wait_up(0, False)
            for _ in range(3):
                assert (await d.post(prompt="hello"))[0] == 200
            assert d.served() == [0, 3]
            d.replicas[1].health_status = 500
            await d.wait_up(1, False)
            status, _ = await d.post(prompt="hello")
            assert status == 503 and (await d.session.get(d.url + "/health")).status == 503
            d.replicas[0].health_status = 200
            await d.wait_up(0, True)
            assert (await d.post(prompt="hello"))[0] == 200 and d.served() == [1, 3]

    run(scenario())


def test_admin_backends_need_the_api_key_and_change_the_rotation():
    async def scenario():
        async with Deployment(replicas=1) as open_router:
            async with open_router.session.post(open_router.url + "/admin/backends", json={"url": "http://a:1"}) as r:
                assert r.status == 403  # no --api-key: no admin at all
        async with Deployment(replicas=1, api_key=KEY) as d:
            extra = await FakeReplica().start()
            auth = {"Authorization": f"Bearer {KEY}"}
            admin = d.url + "/admin/backends"
            async with d.session.post(admin, json={"url": extra.url}) as r:
                assert r.status == 401
            async with d.session.post(admin, json={"url": extra.url}, headers={"Authorization": "Bearer no"}) as r:
                assert r.status == 401
            async with d.session.post(admin, json={"url": "file:///etc"}, headers=auth) as r:
                assert r.status == 400
            async with d.session.post(admin, json={"url": extra.url}, headers=auth) as r:
                assert r.status == 201 and (await r.json())["id"] == 1
            async with d.session.post(admin, json={"url": extra.url}, headers=auth) as r:
                assert r.status == 409
            for i in range(254):  # 256 in all is the cap
                d.router.backends.add(f"http://127.0.0.{i % 250 + 2}:{1000 + i}")
            async with d.session.post(admin, json={"url": "http://127.0.0.1:9"}, headers=auth) as r:
                assert r.status == 409 and "at most 256" in (await r.json())["error"]["message"]
            for backend in list(d.router.backends.backends[2:]):
                d.router.backends.remove(backend.url)
            async with d.session.delete(admin, json={"url": d.replicas[0].url}, headers=auth) as r:
                assert r.status == 200
            assert (await d.post(prompt="hi", headers=auth))[0] == 200
            assert d.served() == [0] and len(extra.bodies) == 1
            async with d.session.get(admin, headers=auth) as r:
                assert [b["url"] for b in (await r.json())["backends"]] == [extra.url]
            await extra.stop()

    run(scenario())


def test_request_body_over_the_cap_is_refused():
    async def scenario():
        async with Deployment(max_body_bytes=1024) as d:
            status, _ = await d.post(prompt="x" * 2048)
            assert status == 413 and d.served() == [0, 0]

    run(scenario())


@pytest.mark.parametrize("policy, expected", [("cache_aware", [0, 1, 0, 1]), ("least_load", [0, 0, 0, 0])])
def test_pd_mode_picks_the_prefill_instance_by_prefix_affinity(policy, expected):
    """`jaxserve router --prefill ... --decode ...`: the proxy's two legs, the prefill instance
    chosen by the policy (least_load: the proxy's rule, the first of equals every time)."""
    from server.proxy_config import ProxyConfig
    from server.router_pd import PDRouter

    legs: list[int] = []  # which prefill instance took each request's first leg, in order

    async def scenario():
        prefill = [await FakeReplica().start() for _ in range(2)]
        decode = await FakeReplica().start()
        for i, replica in enumerate(prefill):

            async def prefill_leg(request, raw, i=i):
                assert json.loads(raw)["kv_transfer_params"] == {"do_remote_decode": True}
                legs.append(i)
                params = {"do_remote_prefill": True, "transfer_id": "t", "control_url": "http://127.0.0.1:1"}
                return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

            replica.answer = prefill_leg
        config = ProxyConfig((prefill[0].url, prefill[1].url), (decode.url,), policy=policy, block_size=4)
        router = PDRouter(config)
        runner, port = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as session:
                for prompt in ("one: hello there, how are you", "two: good morning, my friend") * 2:
                    body = {"model": "m", "prompt": prompt, "max_tokens": 3}
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    metrics = await resp.text()
        finally:
            await runner.cleanup()
            for replica in (*prefill, decode):
                await replica.stop()
        assert legs == expected
        assert all("kv_transfer_params" in json.loads(raw) for raw in decode.bodies) and len(decode.bodies) == 4
        if policy == "cache_aware":
            assert "jaxserve_proxy_prefill_by_affinity_total 2" in metrics

    run(scenario())


# ---- the official openai client, real jaxserve servers (FakeEngine) behind the router -------------
class ThreadedApp:
    """An aiohttp app on 127.0.0.1 served from its own thread's loop (for synchronous clients)."""

    def __init__(self, make_app):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            return await _serve(make_app())

        self.runner, port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_openai_client_through_the_router_equals_a_replica_alone():
    import openai

    from server.testing import FakeEngine, LiveServer, build_test_tokenizer

    tokenizer = build_test_tokenizer()
    engines = [FakeEngine(tokenizer, model_name="fake-model", max_model_len=256, num_slots=4) for _ in range(2)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Return the value"}]
    with LiveServer(engines[0]) as first, LiveServer(engines[1]) as second:
        router = ThreadedApp(lambda: Router(RouterConfig((first.url, second.url), block_size=2)).app())
        try:
            clients = [
                openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
                for url in (first.url, router.url)
            ]
            assert [m.id for m in clients[1].models.list().data] == ["fake-model"]
            answers = []
            for client in clients:
                chat = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=6)
                stream = client.chat.completions.create(
                    model="fake-model", messages=messages, max_tokens=6, stream=True
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                completion = client.completions.create(model="fake-model", prompt="Return the value", max_tokens=6)
                answers.append((chat.choices[0].message.content, text, completion.choices[0].text))
            assert answers[0][0] and answers[1] == answers[0]
        finally:
            router.close()


# ---- two real tiny-hybrid replicas on loopback ------------------------------------------------------
@pytest.mark.slow
def test_two_real_hybrid_replicas_keep_a_conversation_on_one_and_survive_a_kill(tiny_checkpoint):
    """Greedy answers through the router equal a replica's own; a conversation's turns land on
    one replica, whose own usage shows the history served from its prefix cache; after one
    replica is SIGKILLed, requests still succeed (refused connection -> the other replica)."""
    import openai

    from benchmarks.pd_cluster import BASE_FLAGS, Process, scrape

    path = tiny_checkpoint("qwen3_5")
    processes = []
    try:
        replicas = [Process(f"replica{i}", ["serve", str(path), *BASE_FLAGS]) for i in range(2)]
        processes += replicas
        argv = ["router", "--backend", replicas[0].url, "--backend", replicas[1].url, "--port", "0"]
        router = Process("router", [*argv, "--tokenizer", str(path), "--health-interval", "0.5"])
        processes.append(router)
        client = lambda url: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        routed, direct = client(router.url), client(replicas[1].url)
        model = routed.models.list().data[0].id
        system = {"role": "system", "content": "You answer in one short sentence, always politely. " * 4}
        history, usages, answers, prompts = [system], [], [], []
        for turn in range(3):
            history.append({"role": "user", "content": f"question number {turn}: what is {turn} + {turn}?"})
            got = routed.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0)
            prompts.append(list(history))
            usages.append(got.usage)
            answers.append(got.choices[0].message.content)
            history.append({"role": "assistant", "content": answers[-1]})
        for prompt, answer in zip(prompts, answers):  # after the routed turns: their cache hits are theirs
            alone = direct.chat.completions.create(model=model, messages=prompt, max_tokens=4, temperature=0)
            assert alone.choices[0].message.content == answer
        router_metrics = scrape(router.url)
        counts = [m for k, m in scrape_labelled(router.url).items() if k.startswith("jaxserve_router_backend_requests")]
        assert sorted(counts) == [0, 3], counts  # one replica served the whole conversation
        assert router_metrics["jaxserve_router_by_affinity_total"] >= 1
        assert sum(u.prompt_tokens_details.cached_tokens for u in usages[1:]) > 0, usages
        replicas[0].kill()
        for i in range(2):
            answer = routed.completions.create(model=model, prompt=f"after the kill {i}", max_tokens=2)
            assert answer.choices[0].text is not None
        assert scrape_labelled(router.url)['jaxserve_router_backend_up{backend="0"}'] == 0
    finally:
        for process in processes:
            process.kill()


def scrape_labelled(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in lines if line}
