"""`jaxserve router`: one OpenAI endpoint in front of many jaxserve replicas.

    jaxserve router --backend http://127.0.0.1:8101 --backend http://127.0.0.1:8102 [--policy cache_aware]
    jaxserve router --prefill URL ... --decode URL ...     (P/D pools; `jaxserve proxy` is this mode)

Each /v1/completions and /v1/chat/completions request goes to one replica chosen by the policy
(server/router_policy.py; cache_aware by default: prefix affinity from hashed prompt blocks,
overridden by load imbalance), and its answer (JSON or SSE) is passed to the client byte for byte,
the request body too. A request that fails before its first byte reached the client (refused
connection, timeout, a 5xx, a connection dropped before the first chunk) is retried once on
another replica; a stream cut mid-way ends with an error event and `data: [DONE]`; a JSON answer
cut mid-way ends with the connection, so a truncated body is never a clean 200. Replicas leave
the rotation on failures and return on a healthy `/health` (server/router_backends.py), and are
added or removed at run time with `POST` / `DELETE /admin/backends {"url": ...}`, which need the
API key. The router imports no JAX, forwards the client's Authorization header, and never
forwards a client's `kv_transfer_params` or internal-token header (P/D mode holds that token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

import aiohttp
from aiohttp import web

from server.proxy import same_secret
from server.proxy_health import HealthChecker
from server.router_backends import Backend, BackendSet
from server.router_config import RouterConfig, RouterConfigError, build_config, check_url, is_pd_mode
from server.router_policy import BlockIndex, block_hashes, make_policy
from server.router_tokens import BackendTokenizer, LocalTokenizer, prompt_tokens

log = logging.getLogger("jaxserve.router")
ROUTES = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("content-type", "cache-control", "x-request-id")
MAX_ERROR_BODY = 64 * 1024  # of a replica's 5xx answer kept for the client


class FailedBeforeFirstByte(Exception):
    """Nothing reached the client yet: the request may go to another replica."""

    def __init__(self, reason: str, status: int = 502, body: bytes | None = None, content_type: str = ""):
        super().__init__(reason)
        self.status, self.body, self.content_type = status, body, content_type


def error_response(status: int, message: str, error_type: str = "invalid_request_error", headers=None):
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


class Router:
    def __init__(self, config: RouterConfig, tokenizer=None):
        self.config = config
        self.index = BlockIndex(config.index_blocks)
        self.backends = BackendSet(config.backends, self.index, config.health_failures)
        self.policy = make_policy(
            config.policy, self.index, config.cache_threshold, config.balance_abs, config.balance_rel
        )
        self.tokenizer = tokenizer or BackendTokenizer()
        self.read_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.idle_timeout_s
        )
        self.counters = dict.fromkeys(
            ("requests", "routed", "by_affinity", "retries", "streams_cut", "no_backend", "failed"), 0
        )
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for route in ROUTES:
            app.router.add_post(route, self._relay)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/backends", self._list_backends)
        app.router.add_post("/admin/backends", self._add_backend)
        app.router.add_delete("/admin/backends", self._remove_backend)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        c = self.config
        checker = HealthChecker(
            [self.backends], self.session, c.health_interval_s, c.health_timeout_s, c.health_failures
        )
        self._health_task = asyncio.create_task(checker.run())

    async def _stop(self, _app) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.session.close()

    # ---- helpers -----------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        if self.config.api_key is None:
            return True
        scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and same_secret(credential.strip(), self.config.api_key)

    @staticmethod
    def _unauthorized() -> web.Response:
        return error_response(
            401,
            "Missing or invalid API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            headers={"WWW-Authenticate": 'Bearer realm="jaxserve"'},
        )

    @staticmethod
    def _headers(request: web.Request) -> dict:
        """Built afresh: only the client's Authorization passes (never an internal token)."""
        headers = {"Content-Type": "application/json"}
        if request.headers.get("Authorization"):
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    # ---- one request -------------------------------------------------------------------------
    async def _relay(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return self._unauthorized()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as err:
            return error_response(400, f"request body is not valid JSON: {err}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        if "kv_transfer_params" in body:
            return error_response(400, "kv_transfer_params is set by the router in P/D mode, not by clients")
        self.counters["requests"] += 1
        headers = self._headers(request)
        hashes = await self._hashes(request.path, body, headers)
        tried: set[int] = set()
        failure: FailedBeforeFirstByte | None = None
        for attempt in range(2):
            candidates = self.backends.candidates(exclude=tried)
            if not candidates:
                break
            decision = self.policy.choose(candidates, hashes)
            backend = self.backends.get(decision.backend_id)
            tried.add(backend.id)
            self._account(backend, decision, hashes)
            try:
                return await self._forward(request, backend, raw, headers)
            except FailedBeforeFirstByte as err:
                failure = err
                log.warning("%s failed before the first byte (%s)%s", backend.name, err, " - retrying" * (1 - attempt))
                self.counters["retries"] += attempt == 0
        if failure is None:
            self.counters["no_backend"] += 1
            return error_response(503, "no backend is in service; retry later", "service_unavailable")
        self.counters["failed"] += 1
        if failure.body is not None:  # the last replica's own 5xx, as it answered
            return web.Response(body=failure.body, status=failure.status, content_type=failure.content_type or None)
        return error_response(failure.status, f"the backend failed: {failure}", "internal_error")

    async def _hashes(self, path: str, body: dict, headers: dict) -> list[bytes]:
        if self.config.policy != "cache_aware":
            return []
        urls = [self.backends.get(c.backend_id).url for c in self.backends.candidates()]
        tokens = await prompt_tokens(
            self.tokenizer,
            path,
            body,
            self.session,
            urls,
            self.config.tokenize_timeout_s,
            self.config.max_prompt_chars,
            headers,
        )
        return block_hashes(tokens, self.config.block_size) if tokens else []

    def _account(self, backend: Backend, decision, hashes: list[bytes]) -> None:
        backend.requests += 1
        backend.by_affinity += decision.by_affinity
        backend.hit_blocks += decision.matched_blocks
        self.counters["routed"] += 1
        self.counters["by_affinity"] += decision.by_affinity
        if hashes:
            self.index.insert(backend.id, hashes)

    async def _forward(self, request: web.Request, backend: Backend, raw: bytes, headers: dict):
        with BackendSet.hold(backend):
            try:
                resp = await self.session.post(
                    backend.url + request.path, data=raw, headers=headers, timeout=self.read_timeout
                )
            except aiohttp.ClientConnectorError as err:
                self.backends.record_failure(backend, True, f"connection failed: {err.os_error or err}")
                raise FailedBeforeFirstByte(f"connection failed: {err.os_error or err}") from None
            except (TimeoutError, aiohttp.ClientError) as err:
                self.backends.record_failure(backend, False, f"request failed: {type(err).__name__}")
                raise FailedBeforeFirstByte(self._reason(err), 504 if isinstance(err, TimeoutError) else 502) from None
            async with resp:
                if resp.status >= 500:
                    data = None
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        data = await resp.content.read(MAX_ERROR_BODY)
                    self.backends.record_failure(backend, False, f"answered {resp.status}")
                    raise FailedBeforeFirstByte(f"answered {resp.status}", resp.status, data, resp.content_type)
                try:
                    first = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError) as err:
                    self.backends.record_failure(backend, False, f"failed before its first byte: {err!r}")
                    raise FailedBeforeFirstByte(self._reason(err)) from None
                return await self._pass_through(request, backend, resp, first)

    def _reason(self, err: Exception) -> str:
        if isinstance(err, TimeoutError):
            return f"no answer within {self.config.idle_timeout_s:g} s"
        return type(err).__name__

    async def _pass_through(self, request, backend: Backend, resp: aiohttp.ClientResponse, first: bytes):
        out = web.StreamResponse(
            status=resp.status, headers={k: v for k, v in resp.headers.items() if k.lower() in PASSED_HEADERS}
        )
        await out.prepare(request)
        chunk = first
        while chunk:
            await out.write(chunk)
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as err:
                return await self._cut(request, out, backend, resp, err)
        await out.write_eof()
        self.backends.record_success(backend)
        return out

    async def _cut(self, request, out, backend: Backend, resp, err: Exception) -> web.StreamResponse:
        """Mid-answer failure: SSE ends with an error event and [DONE]; anything else with the connection."""
        self.counters["streams_cut"] += 1
        reason = f"the backend {self._reason(err)}" if isinstance(err, TimeoutError) else "the backend failed"
        self.backends.record_failure(backend, False, f"cut mid-answer: {err!r}")
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            error = {"error": {"message": reason, "type": "internal_error", "param": None, "code": None}}
            with contextlib.suppress(ConnectionError):
                await out.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
                await out.write_eof()
        elif request.transport is not None:
            request.transport.close()
        return out

    # ---- the rest of the API -----------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return self._unauthorized()
        for candidate in sorted(self.backends.candidates(), key=lambda c: c.load):
            backend = self.backends.get(candidate.backend_id)
            try:
                async with self.session.get(
                    backend.url + "/v1/models", headers=self._headers(request), timeout=self.read_timeout
                ) as resp:
                    return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
            except (TimeoutError, aiohttp.ClientError) as err:
                log.warning("%s: /v1/models failed: %r", backend.name, err)
        return error_response(503, "no backend is in service; retry later", "service_unavailable")

    async def _health(self, _request: web.Request) -> web.Response:
        live = self.backends.live_count()
        body = {"status": "ok" if live else "unavailable", "in_service": live, "total": len(self.backends.backends)}
        return web.json_response(body, status=200 if live else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        lines = [f"jaxserve_router_{name}_total {value}" for name, value in self.counters.items()]
        lines.append(f"jaxserve_router_backends_in_service {self.backends.live_count()}")
        share = self.counters["by_affinity"] / self.counters["routed"] if self.counters["routed"] else 0.0
        lines.append(f"jaxserve_router_affinity_share {share:.6f}")
        for b in self.backends.backends:
            label = f'{{backend="{b.id}"}}'
            lines += [
                f"jaxserve_router_backend_up{label} {int(b.in_service)}",
                f"jaxserve_router_backend_requests_total{label} {b.requests}",
                f"jaxserve_router_backend_in_flight{label} {b.outstanding}",
                f"jaxserve_router_backend_failures_total{label} {b.failures}",
                f"jaxserve_router_backend_affinity_routed_total{label} {b.by_affinity}",
                f"jaxserve_router_backend_estimated_hit_blocks_total{label} {b.hit_blocks}",
                f"jaxserve_router_backend_index_blocks{label} {self.index.size(b.id)}",
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _admin_url(self, request: web.Request) -> str | web.Response:
        if self.config.api_key is None:
            return error_response(403, "/admin needs the router started with --api-key", "permission_error")
        if not self._authorized(request):
            return self._unauthorized()
        try:
            body = json.loads(await request.read() or b"{}")
            return check_url(str(body["url"]))
        except (ValueError, KeyError, TypeError) as err:
            return error_response(400, f'expected {{"url": "http://host:port"}}: {err}')

    async def _list_backends(self, request: web.Request) -> web.Response:
        if self.config.api_key is None:
            return error_response(403, "/admin needs the router started with --api-key", "permission_error")
        if not self._authorized(request):
            return self._unauthorized()
        rows = [{"id": b.id, "url": b.url, "in_service": b.in_service} for b in self.backends.backends]
        return web.json_response({"backends": rows})

    async def _add_backend(self, request: web.Request) -> web.Response:
        url = await self._admin_url(request)
        if isinstance(url, web.Response):
            return url
        try:
            backend = self.backends.add(url)
        except ValueError as err:
            return error_response(409, str(err))
        return web.json_response({"id": backend.id, "url": url}, status=201)

    async def _remove_backend(self, request: web.Request) -> web.Response:
        url = await self._admin_url(request)
        if isinstance(url, web.Response):
            return url
        try:
            backend = self.backends.remove(url)
        except KeyError:
            return error_response(404, f"{url} is not a backend")
        return web.json_response({"id": backend.id, "url": url})


def main(argv: list[str] | None = None, command: str = "router") -> int:
    """`jaxserve router ...`; with --prefill/--decode (and always as `jaxserve proxy`), the P/D mode."""
    argv = sys.argv[1:] if argv is None else argv
    if command == "proxy" or is_pd_mode(argv):
        from server.router_pd import main as pd_main

        return pd_main(argv)
    try:
        config = build_config(argv)
    except RouterConfigError as err:
        print(f"jaxserve router: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer = LocalTokenizer(config.tokenizer) if config.tokenizer else None
    except (OSError, ValueError) as err:
        print(f"jaxserve router: --tokenizer {config.tokenizer}: {err}", file=sys.stderr)
        return 2
    asyncio.run(_serve(Router(config, tokenizer)))
    return 0


async def _serve(router: Router) -> None:
    from server.runner import start_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    runner, host, port = await start_app(router.app(), router.config.host, router.config.port)
    log.info("jaxserve router ready at http://%s:%d (%s, %d backends)", host, port, router.config.policy,
             len(router.backends.backends))  # fmt: skip
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
