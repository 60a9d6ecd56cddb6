"""The aiohttp application: OpenAI-compatible routes over an `EngineClient`.

`create_app(engine, server_config)` wires the routes and one middleware
(`server.middleware.errors_and_policy`: request ids, the API key, draining, body limits, the
JSON error shape). Per-app state lives in `app[STATE]` (`server.state.ServerState`); nothing
here is global.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from aiohttp import web
from pydantic import BaseModel

from configs.schema import ServerConfig
from runtime.kv_transfer.control import TOKEN_HEADER as KV_TRANSFER_TOKEN_HEADER
from runtime.kv_transfer.control import token_matches
from server import formats, structured
from server.chat_messages import normalize_messages
from server.chat_output import ChatOutputParser
from server.chat_template import TemplateTimeout, render_chat_template
from server.engine_client import EngineClient
from server.metrics import ServerMetrics
from server.middleware import errors_and_policy
from server.openapi import openapi_document
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    ignored_fields_set,
    parse_body,
)
from server.serving import DEFAULT_COMPLETION_MAX_TOKENS, Job, build_job, run_job
from server.state import REQUEST_ID, STATE, ServerState, server_version

logger = logging.getLogger("jaxserve.server")

__all__ = ["STATE", "create_app"]


def create_app(
    engine: EngineClient, server_config: ServerConfig | None = None, kv_transfer_token: str | None = None
) -> web.Application:
    config = server_config or ServerConfig()
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[errors_and_policy])
    app[STATE] = ServerState(
        engine,
        config,
        ServerMetrics(engine.stats),
        formats.TokenTexts(engine.tokenizer),
        kv_transfer_token=kv_transfer_token,
    )
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/version", _version)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/tokenizer_info", _tokenizer_info)
    return app


async def _read_json(request: web.Request, model: type[BaseModel]):
    timeout_s = request.app[STATE].config.body_read_timeout_s
    try:  # raises 413 past client_max_size, also for chunked bodies
        body = await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise RequestError(
            408, f"The request body did not arrive within {timeout_s:g} s", code="request_timeout"
        ) from None
    parsed = parse_body(model, body)
    ignored = ignored_fields_set(parsed)
    if ignored:
        logger.debug(
            "request %s: ignored fields (they do not change the output): %s", request[REQUEST_ID], ", ".join(ignored)
        )
    return parsed


def _check_kv_transfer(request: web.Request, state: ServerState, body) -> None:
    """P/D: `kv_transfer_params` steer what this instance offers or pulls, so only the proxy may
    send them — with the internal token (constant-time compare) when one is configured."""
    if body.kv_transfer_params is None:
        return
    if not token_matches(request.headers.get(KV_TRANSFER_TOKEN_HEADER), state.kv_transfer_token):
        raise RequestError(
            400,
            f"kv_transfer_params: accepted only from the P/D proxy (the internal "
            f"{KV_TRANSFER_TOKEN_HEADER} header is missing or wrong)",
            param="kv_transfer_params",
        )


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.engine.model_name:
        raise RequestError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.engine.model_name}`",
            param="model",
            code="model_not_found",
            error_type="invalid_request_error",
        )


def _check_capacity(state: ServerState, num_requests: int) -> None:
    limit = state.config.max_waiting_requests
    if num_requests > limit:  # could never be admitted: not a retry-later
        raise RequestError(
            400,
            f"n: this request needs {num_requests} completions (n x prompts) but the server "
            f"queues at most {limit} (server.max_waiting_requests)",
            param="n",
        )
    waiting = int(state.engine.stats().get("num_waiting", 0))
    if waiting + num_requests > state.config.max_waiting_requests:
        raise RequestError(
            429,
            f"The waiting queue is full ({waiting} requests waiting); retry later",
            code="queue_full",
            error_type="rate_limit_error",
        )


async def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _read_json(request, CompletionRequest)
    _check_kv_transfer(request, state, body)
    _check_model(state, body.model)
    if body.max_tokens == 0 and not body.echo:
        raise RequestError(400, "max_tokens: 0 is allowed only with echo (scoring the prompt)", param="max_tokens")
    _check_stream_options(body)
    tokenizer = state.engine.tokenizer
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
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
    job = build_job(
        state.engine,
        body,
        uuid.uuid4().hex,
        prompts,
        body.max_tokens,
        DEFAULT_COMPLETION_MAX_TOKENS,
        body.logprobs,
        echo_texts,
        prompt_logprobs=body.prompt_logprobs,
        echo_logprobs=body.echo and body.logprobs is not None,
        structured_output=grammar,
    )
    return await _run(request, state, job, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _read_json(request, ChatCompletionRequest)
    _check_kv_transfer(request, state, body)
    _check_model(state, body.model)
    _check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    tools = structured.tool_plan(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        max_tool_calls=state.config.max_tool_calls,
        auto_tool_choice=state.config.enable_auto_tool_choice,
    )
    template_kwargs = dict(body.chat_template_kwargs or {})
    if tools.functions:
        template_kwargs["tools"] = [{"type": "function", "function": f} for f in tools.functions]
    request_template = body.request_chat_template()
    prompt = await _render_chat(
        state, body.messages, body.add_generation_prompt, template_kwargs, request_template, functions=tools.functions
    )
    template_text = state.template_text(request_template)

    def model_may_think(reasoning) -> bool:
        return reasoning.model_may_open(template_text, state.vocabulary_has(reasoning.start_tag))

    grammar, reasoning = await structured.chat_grammar(
        body,
        tools,
        state.tool_parser,
        template_kwargs,
        prompt,
        state.engine.tokenizer,
        state.config.reasoning_parser,
        state.compiler,
        model_may_think,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens == 0:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise RequestError(400, f"{param}: must be at least 1", param=param)
    job = build_job(
        state.engine, body, uuid.uuid4().hex, [prompt], max_tokens, None, logprobs, structured_output=grammar
    )
    if reasoning is not None or tools.parses_calls:
        tool_parser = state.tool_parser if tools.parses_calls else None
        for choice in job.choices:
            choice.parser = ChatOutputParser(reasoning, tool_parser, tools.max_calls)
    return await _run(request, state, job, chat=True)


async def _run(request: web.Request, state: ServerState, job: Job, chat: bool) -> web.StreamResponse:
    _check_capacity(state, len(job.requests))
    job.client_request_id = request[REQUEST_ID]
    return await run_job(request, state.engine, state.metrics, job, state.formatter(chat), state.cut)


def _check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise RequestError(400, "stream_options: only allowed when stream is true", param="stream_options")


async def _render_chat(
    state: ServerState,
    messages,
    add_generation_prompt: bool,
    template_kwargs: dict | None,
    request_template: str | None = None,
    functions: list[dict] | None = None,
) -> list[int]:
    """Render with the chat template (the client's if allowed, else --chat-template's, else the
    model's) in the sandbox under a time limit, then encode without adding special tokens again.
    Messages are normalized first (`server/chat_messages.py`); `functions`: the request's tools."""
    if request_template is not None and not state.config.trust_request_chat_template:
        raise RequestError(
            400,
            "chat_template: client-supplied chat templates are disabled on this server "
            "(start it with --trust-request-chat-template to allow them)",
            param="chat_template",
        )
    tokenizer = state.engine.tokenizer
    conversation = normalize_messages(messages, state.template_text(request_template), state.tool_parser, functions)
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "chat_template"}
    try:
        text = await render_chat_template(
            tokenizer,
            conversation,
            template=request_template or state.chat_template,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=kwargs,
            timeout_s=state.config.chat_template_timeout_s,
        )
        prompt = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    except TemplateTimeout as err:
        raise RequestError(400, f"messages: {err}", param="messages") from None
    except Exception as err:  # template errors (e.g. a role order the template refuses) are the client's
        raise RequestError(400, f"messages: the chat template rejected them: {err}", param="messages") from None
    if not prompt:
        raise RequestError(400, "messages: render to zero tokens", param="messages")
    return prompt


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.engine.model_name,
        "object": "model",
        "created": formats.now(),
        "owned_by": "jaxserve",
        "root": state.engine.model_name,
        "parent": None,
        "max_model_len": state.engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    if not request.app[STATE].engine.is_healthy():
        return web.json_response({"status": "unhealthy", "reason": "the engine loop has died"}, status=503)
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
        tokens = await _render_chat(state, body.messages, body.add_generation_prompt, None)
    else:
        tokens = await _encode(tokenizer, body.prompt, body.add_special_tokens)
    return web.json_response({"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens})


async def _tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's `GET /tokenizer_info`: the tokenizer's configuration (lm-eval reads it)."""
    state = request.app[STATE]
    tokenizer = state.engine.tokenizer
    info = {
        key: value
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if _is_json_value(value) and not key.endswith("_file")
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = state.engine.max_model_len
    info["vocab_size"] = len(tokenizer)
    template = state.chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return web.json_response(info)


def _is_json_value(value) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json_value(item) for key, item in value.items())
    return False


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
