"""The aiohttp application: OpenAI-compatible routes over an `EngineClient`.

`create_app(engine, server_config)` wires the routes and one middleware that owns the
cross-cutting rules: request ids (`X-Request-ID`, echoed), the API key, draining (503), body
limits (413) and turning every error into OpenAI's JSON error shape, never a stack trace.
Per-app state lives in `app[STATE]`; nothing here is global.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from dataclasses import dataclass, field
from importlib import metadata

from aiohttp import web
from pydantic import BaseModel

from configs.schema import ServerConfig
from server import formats
from server.engine_client import EngineClient
from server.metrics import ServerMetrics
from server.openapi import openapi_document
from server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest,
    parse_body,
)
from server.serving import DEFAULT_COMPLETION_MAX_TOKENS, Formatter, build_job, run_job
from server import structured
from server.chat_output import ChatOutputParser

logger = logging.getLogger("jaxserve.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_ALWAYS_OPEN = ("/metrics", "/version")  # still answered while draining


def server_version() -> str:
    try:
        return metadata.version("jaxserve")
    except metadata.PackageNotFoundError:
        return "0.1.0+local"


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    metrics: ServerMetrics
    texts: formats.TokenTexts
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    grammar_compiler: object = None  # built on the first grammar request (runtime.structured_output)

    def __post_init__(self) -> None:
        self.idle.set()

    def compiler(self):
        """The engine's grammar compiler (shared cache), or one of our own for an engine without."""
        if self.grammar_compiler is None:
            compiler = getattr(self.engine, "grammar_compiler", None)
            if compiler is None:
                from runtime.structured_output import build_compiler

                tokenizer = self.engine.tokenizer
                compiler = build_compiler(tokenizer, self.engine.vocab_size, (tokenizer.eos_token_id,))
            compiler.timeout_s = self.config.grammar_compile_timeout_s
            self.grammar_compiler = compiler
        return self.grammar_compiler


STATE = web.AppKey("jaxserve_state", ServerState)
REQUEST_ID = web.RequestKey("jaxserve_request_id", str) if hasattr(web, "RequestKey") else "jaxserve_request_id"


def create_app(engine: EngineClient, server_config: ServerConfig | None = None) -> web.Application:
    config = server_config or ServerConfig()
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors_and_policy])
    app[STATE] = ServerState(engine, config, ServerMetrics(engine.stats), formats.TokenTexts(engine.tokenizer))
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/version", _version)
    app.router.add_get("/openapi.json", _openapi)
    return app


def _error_response(err: RequestError, request_id: str | None) -> web.Response:
    headers = {"X-Request-ID": request_id} if request_id else None
    return web.json_response(err.body(), status=err.status, headers=headers)


_HTTP_ERRORS = {
    404: ("invalid_request_error", "route_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


@web.middleware
async def _errors_and_policy(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request.headers.get("X-Request-ID")
    try:
        if request_id is not None and not _REQUEST_ID.match(request_id):
            request_id = None
            raise RequestError(400, "X-Request-ID: must be 1-128 characters of [A-Za-z0-9._:-]",
                               param="X-Request-ID")
        request_id = request_id or uuid.uuid4().hex
        request[REQUEST_ID] = request_id
        path = request.path
        if state.draining and path not in _ALWAYS_OPEN:
            raise RequestError(503, "The server is shutting down", code="draining", error_type="service_unavailable")
        if state.config.api_key and path.startswith(_PROTECTED_PREFIXES):
            _check_api_key(request, state.config.api_key)
        if request.content_length is not None and request.content_length > state.config.max_body_bytes:
            raise RequestError(413, f"The request body ({request.content_length} bytes) exceeds the limit of "
                                    f"{state.config.max_body_bytes} bytes", code="request_too_large")
        state.in_flight += 1
        state.idle.clear()
        try:
            response = await handler(request)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0:
                state.idle.set()
        response.headers.setdefault("X-Request-ID", request_id)
        return response
    except RequestError as err:
        state.metrics.rejected_requests.labels(status=str(err.status)).inc()
        if err.status >= 500:
            logger.error("request %s failed: %s", request_id, err.message)
        return _error_response(err, request_id)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        error_type, code = _HTTP_ERRORS.get(err.status, ("invalid_request_error", None))
        message = f"{request.method} {request.path}: {err.reason}"
        if err.status == 413:
            message = f"The request body exceeds the limit of {state.config.max_body_bytes} bytes"
        state.metrics.rejected_requests.labels(status=str(err.status)).inc()
        return _error_response(RequestError(err.status, message, code=code, error_type=error_type), request_id)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:  # a bug: log it with its traceback, tell the client only that it happened
        logger.exception("request %s: unhandled error", request_id)
        state.metrics.rejected_requests.labels(status="500").inc()
        return _error_response(RequestError(500, "Internal server error", error_type="internal_error"), request_id)


def _check_api_key(request: web.Request, api_key: str) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")


async def _read_json(request: web.Request, model: type[BaseModel]):
    body = await request.read()  # raises 413 past client_max_size, also for chunked bodies
    return parse_body(model, body)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.engine.model_name:
        raise RequestError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{state.engine.model_name}`", param="model", code="model_not_found",
                           error_type="invalid_request_error")


def _check_capacity(state: ServerState, num_requests: int) -> None:
    waiting = int(state.engine.stats().get("num_waiting", 0))
    if waiting + num_requests > state.config.max_waiting_requests:
        raise RequestError(429, f"The waiting queue is full ({waiting} requests waiting); retry later",
                           code="queue_full", error_type="rate_limit_error")


async def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _read_json(request, CompletionRequest)
    _check_model(state, body.model)
    if body.echo and body.logprobs is not None:
        raise RequestError(400, "echo: echo together with logprobs (prompt logprobs) is not supported", param="echo")
    _check_stream_options(body)
    tokenizer = state.engine.tokenizer
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    prompts = [await _encode(tokenizer, p, True) if isinstance(p, str) else list(p) for p in raw]
    if any(not p for p in prompts):
        raise RequestError(400, "prompt: encodes to zero tokens", param="prompt")
    echo_texts = None
    if body.echo:
        echo_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in raw]
    grammar, param = structured.request_grammar(body)
    if grammar is not None:
        await structured.compile_or_400(state.compiler(), grammar, param)
    job = build_job(state.engine, body, request[REQUEST_ID], prompts, body.max_tokens,
                    DEFAULT_COMPLETION_MAX_TOKENS, body.logprobs, echo_texts, structured_output=grammar)
    _check_capacity(state, len(job.requests))
    return await run_job(request, state.engine, state.metrics, job, Formatter(False, state.texts))


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _read_json(request, ChatCompletionRequest)
    _check_model(state, body.model)
    _check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    tools = structured.tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if tools.functions:
        template_kwargs["tools"] = [{"type": "function", "function": f} for f in tools.functions]
    tokenizer = state.engine.tokenizer
    prompt = await _render_chat(tokenizer, body.messages, body.add_generation_prompt, template_kwargs)
    grammar, reasoning = await structured.chat_grammar(body, tools, template_kwargs, prompt, tokenizer,
                                                       state.config.reasoning_parser, state.compiler)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    job = build_job(state.engine, body, request[REQUEST_ID], [prompt], max_tokens, None, logprobs,
                    structured_output=grammar)
    if reasoning is not None or tools.parses_calls:
        for choice in job.choices:
            choice.parser = ChatOutputParser(reasoning, tools.parses_calls)
    _check_capacity(state, len(job.requests))
    return await run_job(request, state.engine, state.metrics, job, Formatter(True, state.texts))


def _check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise RequestError(400, "stream_options: only allowed when stream is true", param="stream_options")


async def _render_chat(tokenizer, messages, add_generation_prompt: bool, template_kwargs: dict | None) -> list[int]:
    """Render with the tokenizer's own chat template, then encode without adding special tokens again."""
    conversation = [message.template_dict() for message in messages]

    def render() -> list[int]:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **(template_kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        prompt = await asyncio.to_thread(render)
    except Exception as err:  # template errors (e.g. a role order the template refuses) are the client's
        raise RequestError(400, f"messages: the chat template rejected them: {err}", param="messages") from None
    if not prompt:
        raise RequestError(400, "messages: render to zero tokens", param="messages")
    return prompt


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.engine.model_name, "object": "model", "created": formats.now(), "owned_by": "jaxserve",
            "root": state.engine.model_name, "parent": None, "max_model_len": state.engine.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": server_version()})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(server_version()))


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _read_json(request, TokenizeRequest)
    _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError(400, "prompt: give exactly one of prompt or messages", param="prompt")
    tokenizer = state.engine.tokenizer
    if body.messages is not None:
        tokens = await _render_chat(tokenizer, body.messages, body.add_generation_prompt, None)
    else:
        tokens = await _encode(tokenizer, body.prompt, body.add_special_tokens)
    return web.json_response({"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens})


async def _detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _read_json(request, DetokenizeRequest)
    _check_model(state, body.model)
    vocab_size = len(state.engine.tokenizer)
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"tokens: token id {bad} is out of vocabulary (size {vocab_size})", param="tokens")
    text = await asyncio.to_thread(state.engine.tokenizer.decode, body.tokens)
    return web.json_response({"prompt": text})
