"""`jaxserve proxy` against fake prefill / decode instances: no JAX, no model, all on 127.0.0.1.

Each fake instance is a small aiohttp app in the test's own event loop that records every
request (path, headers, body) and behaves as the test says (slow, silent, failing, unhealthy,
gone). The proxy runs in the same loop (timeouts and health checks shortened to fractions of a
second); one test starts it as a `jaxserve proxy` process. Every scenario is bounded by
`asyncio.wait_for`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from import_testing import imports_jax

from server.proxy import TOKEN_HEADER, Proxy, main, same_secret
from server.proxy_config import ProxyConfig, ProxyConfigError, build_config, is_loopback

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "proxy-token-0123456789"
FORGED = "client-forged-token-0123456789"
SCENARIO_TIMEOUT_S = 30.0


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, SCENARIO_TIMEOUT_S))


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, runner.addresses[0][1]


class FakeInstance:
    """A prefill or decode instance stand-in. `answer` (a coroutine of the request and its JSON
    body) replaces the default completion; `health_status` is what /health answers."""

    def __init__(self, role: str):
        self.role = role
        self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.releases: list[tuple[dict, dict]] = []  # (headers, body)
        self.health_status = 200
        self.answer = None
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def completions(self) -> list[dict]:
        return [body for path, _, body in self.requests if path.startswith("/v1/")]

    async def start(self) -> FakeInstance:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/kv_transfer/release", self._release)
        self.runner, self.port = await _serve(app, self.port)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _health(self, _request):
        return web.json_response({"status": "ok" if self.health_status == 200 else "no"}, status=self.health_status)

    async def _release(self, request):
        self.releases.append((dict(request.headers), await request.json()))
        return web.json_response({"released": True})

    async def _completion(self, request):
        body = await request.json()
        self.requests.append((request.path, dict(request.headers), body))
        if self.answer is not None:
            return await self.answer(request, body)
        if self.role == "prefill":
            params = {"do_remote_prefill": True, "transfer_id": f"t{len(self.requests)}", "control_url": self.url}
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        return web.json_response({"choices": [{"text": f"decoded by {self.port}"}]})


async def _stream(request, events: int, every_s: float, silent_after: int | None = None):
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(events):
        if i == silent_after:
            await asyncio.sleep(3600)  # bounded by the scenario's timeout
        await out.write(f'data: {{"i": {i}}}\n\n'.encode())
        await asyncio.sleep(every_s)
    await out.write(b"data: [DONE]\n\n")
    return out


class Deployment:
    """Fake instances and an in-process proxy in front of them."""

    def __init__(self, prefill: int = 1, decode: int = 1, **config):
        self.prefill = [FakeInstance("prefill") for _ in range(prefill)]
        self.decode = [FakeInstance("decode") for _ in range(decode)]
        self.config = config
        self.proxy: Proxy | None = None

    async def __aenter__(self) -> Deployment:
        for instance in self.prefill + self.decode:
            await instance.start()
        config = ProxyConfig(
            prefill=tuple(i.url for i in self.prefill),
            decode=tuple(i.url for i in self.decode),
            **{"health_interval_s": 0.1, "health_timeout_s": 0.5, "health_failures": 2, **self.config},
        )
        self.proxy = Proxy(config, **({"insecure_warning_interval_s": 0.05} if config.insecure_kv_transfer else {}))
        self.proxy_runner, port = await _serve(self.proxy.app())
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.proxy_runner.cleanup()
        for instance in self.prefill + self.decode:
            await instance.stop()

    async def complete(self, stream: bool = False, headers: dict | None = None, prompt="hello"):
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
        async with self.session.post(self.url + "/v1/completions", json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    async def metrics(self) -> dict[str, float]:
        async with self.session.get(self.url + "/metrics") as resp:
            text = await resp.text()
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines() if line}

    async def wait_up(self, role: str, index: int, up: bool, timeout_s: float = 10.0) -> None:
        key = f'jaxserve_proxy_backend_up{{role="{role}",index="{index}"}}'
        deadline = time.monotonic() + timeout_s
        while (await self.metrics())[key] != up:
            assert time.monotonic() < deadline, f"{role}[{index}] never became {'up' if up else 'down'}"
            await asyncio.sleep(0.05)


def _events(raw: bytes) -> list[str]:
    return [line[len("data: ") :] for line in raw.decode().split("\n\n") if line.startswith("data: ")]


# ---- (a) idle timeouts, not a total one -----------------------------------------------------------
def test_stream_longer_than_a_total_timeout_completes_and_a_silent_backend_is_cut():
    """A 3 s stream (a chunk every 0.2 s) through a proxy with a 1 s idle timeout arrives whole.
    Before: the proxy's session had a total timeout; with total=1 s the same stream breaks.
    A backend silent mid-stream is cut after ~1 s: an error event, then [DONE]."""

    async def scenario():
        async with Deployment(idle_timeout_s=1.0) as pd:
            decode = pd.decode[0]
            decode.answer = lambda request, body: _stream(request, events=15, every_s=0.2)
            with pytest.raises(asyncio.TimeoutError):  # the old setting, same backend
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as old:
                    async with old.post(decode.url + "/v1/completions", json={"stream": True}) as resp:
                        await resp.read()
            started = time.monotonic()
            status, raw = await pd.complete(stream=True)
            assert status == 200 and time.monotonic() - started >= 2.9
            assert _events(raw) == [json.dumps({"i": i}) for i in range(15)] + ["[DONE]"]

            decode.answer = lambda request, body: _stream(request, events=15, every_s=0.2, silent_after=2)
            started = time.monotonic()
            status, raw = await pd.complete(stream=True)
            events = _events(raw)
            assert status == 200 and time.monotonic() - started < 3.0  # silent for an hour otherwise
            assert events[:2] == ['{"i": 0}', '{"i": 1}'] and events[-1] == "[DONE]"
            assert "sent nothing for 1 s" in json.loads(events[2])["error"]["message"]
            assert (await pd.metrics())["jaxserve_proxy_decode_failures_total"] == 1

    run(scenario())


def test_a_backend_silent_before_answering_is_cut():
    """Silent for 2 s before any byte: 504 after the 1 s idle timeout. Silent mid-JSON: the
    connection is closed, so a truncated body never reaches the client as a clean 200."""

    async def silent(request, body):
        await asyncio.sleep(2.0)
        return web.json_response({})

    async def half_json(request, body):
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        await out.prepare(request)
        await out.write(b'{"choices": [')
        await asyncio.sleep(3600)

    async def scenario():
        async with Deployment(idle_timeout_s=1.0) as pd:
            pd.decode[0].answer = silent
            started = time.monotonic()
            status, raw = await pd.complete()
            assert status == 504 and time.monotonic() - started < 2.0  # else a 200 after 2 s
            assert json.loads(raw)["error"]["type"] == "internal_error"
            pd.decode[0].answer = half_json
            with pytest.raises(aiohttp.ClientPayloadError):
                await pd.complete()

    run(scenario())


# ---- (b) a failing prefill leg falls back to local prefill ----------------------------------------
@pytest.mark.parametrize("failure", ["slow", "status_500", "refused"])
def test_failing_prefill_leg_falls_back_to_decode(failure):
    async def slow(request, body):
        await asyncio.sleep(3.0)
        return web.json_response({})

    async def status_500(request, body):
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def scenario():
        async with Deployment(prefill_timeout_s=0.5, health_interval_s=60) as pd:
            prefill = pd.prefill[0]
            if failure == "refused":
                await prefill.stop()
            prefill.answer = {"slow": slow, "status_500": status_500}.get(failure)
            started = time.monotonic()
            status, raw = await pd.complete()
            assert status == 200 and json.loads(raw)["choices"][0]["text"].startswith("decoded")
            assert time.monotonic() - started < 2.5
            assert "kv_transfer_params" not in pd.decode[0].completions()[0]
            metrics = await pd.metrics()
            assert metrics["jaxserve_proxy_local_prefill_fallbacks_total"] == 1
            assert metrics["jaxserve_proxy_disaggregated_total"] == 0
            if failure == "refused":
                await prefill.start()  # for __aexit__; same port

    run(scenario())


# ---- (c) active health checks -------------------------------------------------------------------
def test_health_check_takes_a_failing_decode_out_and_puts_it_back():
    """decode[0] answers /health 503: out after 2 checks, every request goes to decode[1]; once
    it answers 200 it is back (and, idle, first in line again). Then decode[0] refuses
    connections (stopped): out; restarted: back."""

    async def scenario():
        async with Deployment(decode=2) as pd:
            first, second = pd.decode
            first.health_status = 503
            await pd.wait_up("decode", 0, False)
            for _ in range(4):
                assert (await pd.complete())[0] == 200
            assert len(first.completions()) == 0 and len(second.completions()) == 4
            first.health_status = 200
            await pd.wait_up("decode", 0, True)
            assert (await pd.complete())[0] == 200 and len(first.completions()) == 1

            await first.stop()
            await pd.wait_up("decode", 0, False)
            for _ in range(3):
                assert (await pd.complete())[0] == 200
            assert len(first.completions()) == 1 and len(second.completions()) == 7
            await first.start()
            await pd.wait_up("decode", 0, True)
            assert (await pd.complete())[0] == 200 and len(first.completions()) == 2

    run(scenario())


def test_a_refused_decode_connection_is_retried_on_another_backend():
    """Between two health checks a decode instance dies: the request that finds it gone goes to
    the next one (nothing had been sent) and the dead one is out at once."""

    async def scenario():
        async with Deployment(decode=2, health_interval_s=60) as pd:
            await pd.decode[0].stop()
            status, raw = await pd.complete()
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == f"decoded by {pd.decode[1].port}"
            assert (await pd.metrics())['jaxserve_proxy_backend_up{role="decode",index="0"}'] == 0
            await pd.decode[0].start()

    run(scenario())


def test_no_decode_in_service_is_a_503_and_no_prefill_goes_straight_to_decode():
    async def scenario():
        async with Deployment() as pd:
            pd.prefill[0].health_status = 503
            await pd.wait_up("prefill", 0, False)
            status, raw = await pd.complete()
            assert status == 200 and pd.prefill[0].completions() == []
            assert "kv_transfer_params" not in pd.decode[0].completions()[0]
            assert (await pd.metrics())["jaxserve_proxy_local_prefill_fallbacks_total"] == 1

            pd.decode[0].health_status = 503
            await pd.wait_up("decode", 0, False)
            status, raw = await pd.complete()
            assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"
            assert len(pd.decode[0].completions()) == 1
            async with pd.session.get(pd.url + "/health") as resp:
                assert resp.status == 503 and (await resp.json())["status"] == "unavailable"

    run(scenario())


# ---- (d) the API key ----------------------------------------------------------------------------
def test_api_key_checked_as_a_bearer_token():
    async def scenario():
        async with Deployment(api_key="right-key-123") as pd:
            for headers in (
                {},
                {"Authorization": "Bearer wrong-key-123"},
                {"Authorization": "Basic right-key-123"},
                {"Authorization": "right-key-123"},
                {"Authorization": "Bearer right-key-1234"},
            ):
                status, raw = await pd.complete(headers=headers)
                assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error", headers
            async with pd.session.get(pd.url + "/v1/models") as resp:
                assert resp.status == 401
            for headers in ({"Authorization": "Bearer right-key-123"}, {"Authorization": "bearer  right-key-123"}):
                assert (await pd.complete(headers=headers))[0] == 200
            assert len(pd.decode[0].completions()) == 2

    run(scenario())
    assert same_secret("abc", "abc") and not same_secret("abc", "abd") and not same_secret("", "abc")


# ---- (e) /health names no backend ---------------------------------------------------------------
def test_health_and_metrics_name_no_backend_address():
    async def scenario():
        async with Deployment(prefill=2, decode=1) as pd:
            async with pd.session.get(pd.url + "/health") as resp:
                assert resp.status == 200
                text = await resp.text()
            async with pd.session.get(pd.url + "/metrics") as resp:
                metrics = await resp.text()
            for instance in pd.prefill + pd.decode:
                assert str(instance.port) not in text and str(instance.port) not in metrics
            assert json.loads(text) == {
                "status": "ok",
                "prefill": {"in_service": 2, "total": 2},
                "decode": {"in_service": 1, "total": 1},
            }

    run(scenario())


# ---- (f) the kv transfer token ------------------------------------------------------------------
def test_token_reaches_both_legs_and_the_release_and_a_client_token_does_not():
    async def silent(request, body):
        await asyncio.sleep(2.0)
        return web.json_response({})

    async def scenario():
        async with Deployment(kv_transfer_token=TOKEN, idle_timeout_s=0.5) as pd:
            prefill, decode = pd.prefill[0], pd.decode[0]
            assert (await pd.complete(headers={TOKEN_HEADER: FORGED}))[0] == 200
            for instance in (prefill, decode):
                assert instance.requests[0][1][TOKEN_HEADER] == TOKEN
            assert decode.completions()[0]["kv_transfer_params"]["transfer_id"] == "t1"

            decode.answer = silent  # the decode leg never starts: the proxy releases the held state
            assert (await pd.complete(headers={TOKEN_HEADER: FORGED}))[0] == 504
            for _ in range(100):
                if prefill.releases:
                    break
                await asyncio.sleep(0.02)
            headers, body = prefill.releases[0]
            assert headers[TOKEN_HEADER] == TOKEN and body == {"transfer_id": "t2", "status": "abort"}

        async with Deployment() as pd:  # no token configured: the client's is not forwarded either
            assert (await pd.complete(headers={TOKEN_HEADER: FORGED}))[0] == 200
            for instance in pd.prefill + pd.decode:
                assert TOKEN_HEADER not in instance.requests[0][1]

    run(scenario())


def test_proxy_process_reads_the_token_from_the_environment():
    """`jaxserve proxy` as a process, the token in JAXSERVE_KV_TRANSFER_TOKEN only."""

    async def scenario():
        prefill, decode = await FakeInstance("prefill").start(), await FakeInstance("decode").start()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "server.cli",
            "proxy",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--port",
            "0",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "JAXSERVE_KV_TRANSFER_TOKEN": TOKEN},
        )
        try:
            lines = []
            while b"ready at" not in (line := await asyncio.wait_for(process.stdout.readline(), 20)):
                assert line, b"".join(lines).decode()
                lines.append(line)
            url = line.decode().split("ready at ")[1].split()[0]
            assert TOKEN not in b"".join(lines).decode()
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
                    assert resp.status == 200
            assert prefill.requests[0][1][TOKEN_HEADER] == TOKEN and decode.requests[0][1][TOKEN_HEADER] == TOKEN
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()
            await prefill.stop()
            await decode.stop()

    run(scenario())


# ---- (g) start-up checks ------------------------------------------------------------------------
def test_non_loopback_bind_without_token_refuses_to_start(monkeypatch, capsys):
    monkeypatch.delenv("JAXSERVE_KV_TRANSFER_TOKEN", raising=False)
    backends = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert main([*backends, "--host", "0.0.0.0"]) == 2  # returns before binding anything
    message = capsys.readouterr().err
    assert "refusing to serve on '0.0.0.0'" in message and "JAXSERVE_KV_TRANSFER_TOKEN" in message
    assert "--insecure-kv-transfer" in message
    assert main([*backends, "--host", "0.0.0.0", "--kv-transfer-token", "short"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err

    assert build_config([*backends, "--host", "0.0.0.0", "--insecure-kv-transfer"], environ={}).insecure_kv_transfer
    assert (
        build_config([*backends, "--host", "0.0.0.0"], environ={"JAXSERVE_KV_TRANSFER_TOKEN": TOKEN}).kv_transfer_token
        == TOKEN
    )
    flag_wins = build_config(
        [*backends, "--host", "10.0.0.5", "--kv-transfer-token", "f" * 16],
        environ={"JAXSERVE_KV_TRANSFER_TOKEN": TOKEN},
    )
    assert flag_wins.kv_transfer_token == "f" * 16 and TOKEN not in repr(flag_wins) and "f" * 16 not in repr(flag_wins)
    assert build_config(backends, environ={}).host == "127.0.0.1"  # loopback: no token needed
    with pytest.raises(ProxyConfigError):
        build_config([*backends, "--host", "proxy.example.com"], environ={})
    for host, loopback in (
        ("127.0.0.1", True),
        ("127.9.8.7", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("proxy.example.com", False),
        ("", False),
    ):
        assert is_loopback(host) == loopback, host


def test_insecure_mode_warns_repeatedly(caplog):
    async def scenario():
        async with Deployment(host="0.0.0.0", insecure_kv_transfer=True):  # served on 127.0.0.1 all the same
            await asyncio.sleep(0.3)

    with caplog.at_level(logging.WARNING, logger="jaxserve.proxy"):
        run(scenario())
    warnings = [r for r in caplog.records if "--insecure-kv-transfer" in r.getMessage()]
    assert len(warnings) >= 2


def test_proxy_imports_no_jax():
    assert not imports_jax("server.proxy", "server.proxy_config", "server.proxy_health")


def test_through_jaxserve_servers_with_fake_engines():
    """The real OpenAI server (FakeEngine, no model) as both instances: the proxy's answers, JSON
    and SSE, carry the same text as the decode instance answering alone, and both instances
    pass its health checks."""
    from server.testing import FakeEngine, LiveServer, build_test_tokenizer

    tokenizer = build_test_tokenizer()
    body = {"model": "fake-model", "prompt": "Return the value", "max_tokens": 6, "temperature": 0}

    async def texts(session, url, stream):
        async with session.post(url + "/v1/completions", json={**body, "stream": stream}) as resp:
            assert resp.status == 200, await resp.text()
            if not stream:
                return (await resp.json())["choices"][0]["text"]
            events = _events(await resp.read())
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    async def scenario(prefill_url, decode_url):
        config = ProxyConfig(prefill=(prefill_url,), decode=(decode_url,), health_interval_s=0.1)
        proxy = Proxy(config)
        runner, port = await _serve(proxy.app())
        try:
            async with aiohttp.ClientSession() as session:
                for stream in (False, True):
                    alone = await texts(session, decode_url, stream)
                    assert alone and await texts(session, f"http://127.0.0.1:{port}", stream) == alone
                await asyncio.sleep(0.3)
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    assert (await resp.json())["decode"] == {"in_service": 1, "total": 1}
                    assert (await resp.json())["prefill"] == {"in_service": 1, "total": 1}
        finally:
            await runner.cleanup()

    engines = [FakeEngine(tokenizer, model_name="fake-model", max_model_len=256, num_slots=4) for _ in range(2)]
    with LiveServer(engines[0]) as prefill, LiveServer(engines[1]) as decode:
        run(scenario(prefill.url, decode.url))
