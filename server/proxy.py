"""`jaxserve proxy`: the OpenAI front end of a disaggregated (prefill/decode) deployment.

    jaxserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 [--port 8000] [--api-key K]

Each completion / chat request goes first to a prefill instance, as a copy with `max_tokens: 1`,
`stream: false` and `kv_transfer_params: {"do_remote_decode": true}`; the prefill instance
answers with the transfer parameters of the state it now holds. The original request, plus those
parameters, then goes to a decode instance, whose answer (JSON or SSE: usage, logprobs, n, stop,
all of it) is streamed to the client byte for byte. Instances are picked by least outstanding
requests among those in service (server/proxy_health.py polls their `/health`). Anything the
prefill leg cannot do (a list of prompts, no prefill instance in service, a prefill leg that
fails or outlasts `--prefill-timeout`) goes to a decode instance without transfer parameters:
it prefills locally (counted). A prefill-leg 4xx (the request itself is bad) is returned to the
client as is. A client that leaves between the legs has the held state released at once
("abort"), not at lease expiry. Backend reads have an idle timeout, not a total one, so a long
stream completes and a silent backend is cut.

Both legs and the release carry the internal credential `X-KV-Transfer-Token`
(JAXSERVE_KV_TRANSFER_TOKEN or `--kv-transfer-token`); a client's own such header and
`kv_transfer_params` are never forwarded. Bound to a non-loopback address, the proxy refuses to start without that token unless
`--insecure-kv-transfer` is given. The proxy imports no JAX and forwards the client's
Authorization header to the instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import signal
import sys

import aiohttp
from aiohttp import web

from runtime.kv_transfer.control import TOKEN_HEADER
from server.proxy_config import ProxyConfig, ProxyConfigError, build_config, insecure_bind
from server.proxy_health import HealthChecker, Pool

log = logging.getLogger("jaxserve.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
# What the prefill leg must not carry: it computes the prompt and returns JSON, nothing else.
PREFILL_DROPPED_FIELDS = (
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "max_completion_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "n",
    "best_of",
)
INSECURE_WARNING_INTERVAL_S = 60.0
RELEASE_TIMEOUT_S = 5.0


class NoBackend(Exception):
    """Every backend of a role is out of service (or refused the connection just now)."""


def _error(status: int, message: str, error_type: str = "invalid_request_error", headers=None) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


def _unauthorized() -> web.Response:
    return _error(
        401,
        "Missing or invalid API key: send 'Authorization: Bearer <key>'",
        "authentication_error",
        headers={"WWW-Authenticate": 'Bearer realm="jaxserve"'},
    )


def same_secret(presented: str, expected: str) -> bool:
    """Constant-time comparison; hashing first hides the expected length too."""

    def digest(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    return hmac.compare_digest(digest(presented), digest(expected))


class Proxy:
    def __init__(self, config: ProxyConfig, insecure_warning_interval_s: float = INSECURE_WARNING_INTERVAL_S):
        self.config = config
        self.prefill, self.decode = Pool("prefill", config.prefill), Pool("decode", config.decode)
        # No total timeout: a stream may run for hours; a backend silent for idle_timeout_s is cut.
        self.read_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.idle_timeout_s
        )
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout_s, sock_connect=config.connect_timeout_s
        )
        self.insecure_warning_interval_s = insecure_warning_interval_s
        self.counters = {
            "requests": 0,
            "disaggregated": 0,
            "local_prefill_fallbacks": 0,
            "released_on_disconnect": 0,
            "decode_unavailable": 0,
            "decode_failures": 0,
        }
        self.session: aiohttp.ClientSession | None = None
        self._loops: list[asyncio.Task] = []  # health checks, the insecure-mode warning
        self._releases: set[asyncio.Task] = set()

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
        # limit=0: the default cap of 100 connections would queue the 101st stream behind the others.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        checker = HealthChecker(
            [self.prefill, self.decode],
            self.session,
            self.config.health_interval_s,
            self.config.health_timeout_s,
            self.config.health_failures,
        )
        self._loops.append(asyncio.create_task(checker.run()))
        if insecure_bind(self.config):
            self._loops.append(asyncio.create_task(self._warn_insecure()))

    async def _stop(self, _app) -> None:
        for task in self._loops:
            task.cancel()
        if self._releases:  # still being posted
            await asyncio.wait(self._releases, timeout=RELEASE_TIMEOUT_S)
        await self.session.close()

    def _release_soon(self, transfer: dict) -> None:
        task = asyncio.get_running_loop().create_task(self._release(transfer))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _warn_insecure(self) -> None:
        while True:
            log.warning(
                "serving on %s with no kv transfer token (--insecure-kv-transfer): anyone who can reach "
                "the instances can pass kv_transfer_params; set JAXSERVE_KV_TRANSFER_TOKEN",
                self.config.host,
            )
            await asyncio.sleep(self.insecure_warning_interval_s)

    def _authorized(self, request: web.Request) -> bool:
        if self.config.api_key is None:
            return True
        scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and same_secret(credential.strip(), self.config.api_key)

    def _headers(self, request: web.Request | None = None) -> dict:
        """What the instances receive: built afresh, so a client's X-KV-Transfer-Token never passes."""
        headers = {"Content-Type": "application/json"}
        auth = request.headers.get("Authorization") if request is not None else None
        if auth:
            headers["Authorization"] = auth
        if self.config.kv_transfer_token:
            headers[TOKEN_HEADER] = self.config.kv_transfer_token
        return headers

    async def _health(self, _request: web.Request) -> web.Response:
        pools = {
            pool.role: {"in_service": pool.live_count(), "total": len(pool.backends)}
            for pool in (self.prefill, self.decode)
        }
        serving = self.decode.live_count() > 0
        body = {"status": "ok" if serving else "unavailable", **pools}
        return web.json_response(body, status=200 if serving else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        lines = [f"jaxserve_proxy_{name}_total {value}" for name, value in self.counters.items()]
        for pool in (self.prefill, self.decode):
            for b in pool.backends:
                labels = f'role="{b.role}",index="{b.index}"'
                lines += [
                    f"jaxserve_proxy_outstanding{{{labels}}} {b.outstanding}",
                    f"jaxserve_proxy_backend_up{{{labels}}} {int(b.in_service)}",
                ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _unauthorized()
        candidates = self.decode.candidates()
        if not candidates:
            return _error(503, "no decode instance is in service", "service_unavailable")
        with Pool.hold(candidates[0]) as backend:
            try:
                async with self.session.get(
                    backend.url + "/v1/models", headers=self._headers(request), timeout=self.read_timeout
                ) as resp:
                    return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
            except (TimeoutError, aiohttp.ClientError) as err:
                log.warning("%s: /v1/models failed: %r", backend.name, err)
                return _error(502, f"the decode instance failed ({type(err).__name__})", "internal_error")

    # ---- one request -------------------------------------------------------------------------
    async def _relay(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _unauthorized()
        try:
            body = json.loads(await request.read())
        except ValueError as err:
            return _error(400, f"request body is not valid JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is set by the proxy, not by clients")
        self.counters["requests"] += 1
        if not self.decode.candidates():
            return self._decode_unavailable()
        headers = self._headers(request)
        transfer = None
        if self._single_prompt(request.path, body) and self.prefill.candidates():
            outcome = await self._prefill(request.path, body, headers)
            if isinstance(outcome, web.Response):
                return outcome
            transfer = outcome
        else:
            self.counters["local_prefill_fallbacks"] += 1
        if transfer is not None:
            body = {**body, "kv_transfer_params": transfer}
            self.counters["disaggregated"] += 1
        started = False
        try:
            async with self._post(self.decode, request.path, body, headers, self.read_timeout) as resp:
                started = True
                return await self._pass_through(request, resp)
        except (TimeoutError, NoBackend, aiohttp.ClientError) as err:
            if started:  # the client's connection failed mid-answer: nobody to answer
                raise
            return self._decode_failed(err)
        finally:
            if transfer is not None and not started:  # the decode leg never started: free the prefill side now
                self.counters["released_on_disconnect"] += 1
                self._release_soon(transfer)

    def _decode_failed(self, err: Exception) -> web.Response:
        if isinstance(err, NoBackend):
            return self._decode_unavailable()
        self.counters["decode_failures"] += 1
        log.warning("decode leg failed: %r", err)
        if isinstance(err, asyncio.TimeoutError):  # aiohttp's timeouts (some are ClientErrors too)
            return _error(
                504, f"the decode instance did not answer within {self.config.idle_timeout_s:g} s", "internal_error"
            )
        return _error(502, f"the decode instance failed ({type(err).__name__})", "internal_error")

    def _decode_unavailable(self) -> web.Response:
        self.counters["decode_unavailable"] += 1
        return _error(503, "no decode instance is in service; retry later", "service_unavailable")

    @staticmethod
    def _single_prompt(path: str, body: dict) -> bool:
        if path.endswith("/chat/completions"):
            return True
        prompt = body.get("prompt")
        return isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
        )

    @contextlib.asynccontextmanager
    async def _post(self, pool: Pool, path: str, body: dict, headers: dict, timeout: aiohttp.ClientTimeout):
        """The answer of the least loaded backend in service. One that refuses the connection
        (nothing was sent) is taken out and the next is tried; none left raises NoBackend."""
        for backend in pool.candidates():
            with Pool.hold(backend):
                try:
                    resp = await self.session.post(backend.url + path, json=body, headers=headers, timeout=timeout)
                except aiohttp.ClientConnectorError as err:
                    pool.take_out(backend, f"connection failed: {err.os_error or err}")
                    continue
                async with resp:
                    yield resp
                return
        raise NoBackend(pool.role)

    async def _prefill(self, path: str, body: dict, headers: dict):
        """-> transfer parameters (None: nothing to pull, or the prefill leg failed: decode
        prefills locally), or a 4xx Response to return as is."""
        leg = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        try:
            async with self._post(self.prefill, path, leg, headers, self.prefill_timeout) as resp:
                data = await resp.read()
                if 400 <= resp.status < 500:
                    return web.Response(body=data, status=resp.status, content_type="application/json")
                if resp.status != 200:
                    raise aiohttp.ClientError(f"status {resp.status}: {data[:200]!r}")
                reply = json.loads(data)
                params = reply.get("kv_transfer_params") if isinstance(reply, dict) else "not a JSON object"
                if params is not None and not isinstance(params, dict):
                    raise ValueError(f"unexpected reply: {str(params)[:200]}")
                return params
        except TimeoutError:
            reason = f"no answer within {self.config.prefill_timeout_s:g} s"
        except (NoBackend, aiohttp.ClientError, ValueError) as err:
            reason = repr(err)
        log.warning("prefill leg failed (%s); the decode instance prefills locally", reason)
        self.counters["local_prefill_fallbacks"] += 1
        return None

    async def _pass_through(self, request: web.Request, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(
            status=resp.status,
            headers={
                k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "cache-control", "x-request-id")
            },
        )
        await out.prepare(request)
        while True:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as err:
                return await self._cut(request, out, resp, err)
            if not chunk:
                break
            await out.write(chunk)
        await out.write_eof()
        return out

    async def _cut(
        self, request: web.Request, out: web.StreamResponse, resp: aiohttp.ClientResponse, err: Exception
    ) -> web.StreamResponse:
        """The decode instance failed or went silent mid-answer: a stream ends with an error
        event and [DONE] (as an instance's own cut-off stream does); other answers, whose status
        is already sent, end with the connection, so a truncated body is never a clean 200."""
        self.counters["decode_failures"] += 1
        silent = isinstance(err, asyncio.TimeoutError)
        reason = f"sent nothing for {self.config.idle_timeout_s:g} s" if silent else f"failed ({type(err).__name__})"
        log.warning("decode stream cut: the decode instance %s", reason)
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            error = {
                "error": {
                    "message": f"the decode instance {reason}",
                    "type": "internal_error",
                    "param": None,
                    "code": None,
                }
            }
            await out.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await out.write_eof()
        elif request.transport is not None:
            request.transport.close()
        return out

    async def _release(self, transfer: dict) -> None:
        """Tell the prefill instance (its control server) to free state nobody will pull."""
        control_url = str(transfer.get("control_url", ""))
        if not control_url.startswith(("http://", "https://")):
            return
        body = {"transfer_id": transfer.get("transfer_id"), "status": "abort"}
        try:
            async with self.session.post(
                control_url.rstrip("/") + "/kv_transfer/release",
                json=body,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S),
            ) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError) as err:
            log.warning("release of transfer %s failed: %r", transfer.get("transfer_id"), err)


def main(argv: list[str] | None = None) -> int:
    try:
        config = build_config(argv)
    except ProxyConfigError as err:
        print(f"jaxserve proxy: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(Proxy(config)))
    return 0


async def _serve(proxy: Proxy) -> None:
    """Serve until SIGTERM/SIGINT; a client that leaves cancels its handler (and both legs)."""
    from server.runner import start_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    runner, bound_host, bound_port = await start_app(proxy.app(), proxy.config.host, proxy.config.port)
    for backend in proxy.prefill.backends + proxy.decode.backends:
        log.info("%s = %s", backend.name, backend.url)
    log.info(
        "jaxserve proxy ready at http://%s:%d (%d prefill, %d decode instances)",
        bound_host,
        bound_port,
        len(proxy.prefill.backends),
        len(proxy.decode.backends),
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
