"""`jaxserve proxy`: the OpenAI front end of a disaggregated (prefill/decode) deployment.

    jaxserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 [--port 8000] [--api-key K]

Each completion / chat request goes first to a prefill instance, as a copy with `max_tokens: 1`,
`stream: false` and `kv_transfer_params: {"do_remote_decode": true}`; the prefill instance
answers with the transfer parameters of the state it now holds. The original request, plus those
parameters, then goes to a decode instance, whose answer (JSON or SSE: usage, logprobs, n, stop,
all of it) is streamed to the client byte for byte. Instances are picked by least outstanding
requests. Anything the prefill leg cannot do (a list of prompts, a prefill instance down or
failing) goes to a decode instance without transfer parameters: it prefills locally (counted).
A prefill-leg 4xx (the request itself is bad) is returned to the client as is. A client that
leaves between the legs has the held state released at once ("abort"), not at lease expiry.
The proxy imports no JAX and forwards the client's Authorization header to the instances.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys

import aiohttp
from aiohttp import web

log = logging.getLogger("jaxserve.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
# What the prefill leg must not carry: it computes the prompt and returns JSON, nothing else.
PREFILL_DROPPED_FIELDS = ("stream_options", "logprobs", "top_logprobs", "echo", "max_completion_tokens",
                          "min_tokens", "stop", "stop_token_ids", "n", "best_of")


def _error(status: int, message: str, error_type: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return web.json_response(body, status=status)


class Pool:
    """Backends of one role, picked by least outstanding requests (ties: the first listed)."""

    def __init__(self, urls: list[str]):
        self.urls = [u.rstrip("/") for u in urls]
        self.outstanding = {u: 0 for u in self.urls}

    @contextlib.contextmanager
    def pick(self):
        url = min(self.urls, key=lambda u: self.outstanding[u])
        self.outstanding[url] += 1
        try:
            yield url
        finally:
            self.outstanding[url] -= 1


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], api_key: str | None = None,
                 timeout_s: float = 600.0):
        self.prefill, self.decode = Pool(prefill), Pool(decode)
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.counters = {"requests": 0, "disaggregated": 0, "local_prefill_fallbacks": 0, "released_on_disconnect": 0}
        self.session: aiohttp.ClientSession | None = None

    # ---- app ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for route in ROUTES:
            app.router.add_post(route, self._relay)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)

    async def _stop(self, _app) -> None:
        await self.session.close()

    def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    def _headers(self, request: web.Request) -> dict:
        auth = request.headers.get("Authorization")
        return {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": self.prefill.urls, "decode": self.decode.urls})

    async def _metrics(self, _request: web.Request) -> web.Response:
        lines = [f"jaxserve_proxy_{name}_total {value}" for name, value in self.counters.items()]
        lines += [f'jaxserve_proxy_outstanding{{role="{role}",url="{url}"}} {n}'
                  for role, pool in (("prefill", self.prefill), ("decode", self.decode))
                  for url, n in pool.outstanding.items()]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _error(401, "invalid or missing API key", "authentication_error")
        with self.decode.pick() as url:
            async with self.session.get(url + "/v1/models", headers=self._headers(request)) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

    # ---- one request -------------------------------------------------------------------------
    async def _relay(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _error(401, "invalid or missing API key", "authentication_error")
        try:
            body = json.loads(await request.read())
        except ValueError as err:
            return _error(400, f"request body is not valid JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is set by the proxy, not by clients")
        self.counters["requests"] += 1
        transfer = None
        if self._single_prompt(request.path, body):
            outcome = await self._prefill(request, body)
            if isinstance(outcome, web.Response):
                return outcome
            transfer = outcome
        else:
            self.counters["local_prefill_fallbacks"] += 1
        if transfer is not None:
            body = {**body, "kv_transfer_params": transfer}
            self.counters["disaggregated"] += 1
        streamed = False
        try:
            with self.decode.pick() as url:
                async with self.session.post(url + request.path, json=body, headers=self._headers(request)) as resp:
                    streamed = True
                    return await self._pass_through(request, resp)
        except aiohttp.ClientError as err:
            return _error(502, f"decode instance failed: {err}", "internal_error")
        finally:
            if transfer is not None and not streamed:  # the decode leg never started: free the prefill side now
                self.counters["released_on_disconnect"] += 1
                asyncio.ensure_future(self._release(transfer))

    @staticmethod
    def _single_prompt(path: str, body: dict) -> bool:
        if path.endswith("/chat/completions"):
            return True
        prompt = body.get("prompt")
        return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                           and all(isinstance(t, int) for t in prompt))

    async def _prefill(self, request: web.Request, body: dict):
        """-> transfer parameters (None: nothing to pull, or the prefill leg failed: decode
        prefills locally), or a 4xx Response to return as is."""
        leg = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        try:
            with self.prefill.pick() as url:
                async with self.session.post(url + request.path, json=leg, headers=self._headers(request)) as resp:
                    data = await resp.read()
                    if 400 <= resp.status < 500:
                        return web.Response(body=data, status=resp.status, content_type="application/json")
                    if resp.status != 200:
                        raise aiohttp.ClientError(f"status {resp.status}: {data[:200]!r}")
                    return json.loads(data).get("kv_transfer_params")
        except (aiohttp.ClientError, ValueError) as err:
            log.warning("prefill leg failed (%s); the decode instance prefills locally", err)
            self.counters["local_prefill_fallbacks"] += 1
            return None

    async def _pass_through(self, request: web.Request, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers={
            k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "cache-control", "x-request-id")})
        await out.prepare(request)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out

    async def _release(self, transfer: dict) -> None:
        url = str(transfer.get("control_url", "")).rstrip("/") + "/kv_transfer/release"
        with contextlib.suppress(Exception):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                await session.post(url, json={"transfer_id": transfer.get("transfer_id"), "status": "abort"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve proxy", description="route requests prefill -> decode")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require this bearer token (forwarded to the instances)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(args.prefill, args.decode, api_key=args.api_key)
    asyncio.run(_serve(proxy, args.host, args.port))
    return 0


async def _serve(proxy: Proxy, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT; a client that leaves cancels its handler (and both legs)."""
    from server.runner import start_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    runner, bound_host, bound_port = await start_app(proxy.app(), host, port)
    log.info("jaxserve proxy ready at http://%s:%d (prefill %s, decode %s)", bound_host, bound_port,
             proxy.prefill.urls, proxy.decode.urls)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
