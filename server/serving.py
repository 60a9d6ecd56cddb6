"""The life of one generation request: validate, tokenize, fan out, stream or collect.

`build_job` turns a parsed body into n x prompts `EngineRequest`s (choice index =
prompt_index * n + i, engine id `<job id>-<choice index>` where the job id is a fresh uuid, never
the client's `X-Request-ID`; `runtime.types.fan_out` for the n samples of a prompt), each
checked by the engine's own `validate_request` (its `SamplingParamsError` becomes a 400 naming
the field; the engine does not check the requests again); `run_job` merges their `RequestDelta`s
and answers with one JSON body or an SSE stream (shaped by `server.responses.Formatter`).
Whatever ends the handler early (client disconnect, error, shutdown) aborts every engine request
that has not finished and counts it in `jaxserve_request_success{finished_reason="abort"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from runtime.types import (
    EngineBusy,
    EngineRequest,
    RequestDelta,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
    TokenLogprob,
    accumulate,
    fan_out,
)
from server import formats
from server.chat_output import ChatOutputParser
from server.engine_client import EngineClient
from server.metrics import CompletionTimer, ServerMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, internal_error
from server.responses import Formatter, usage

logger = logging.getLogger("jaxserve.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context limit


@dataclass
class Choice:
    """Streaming bookkeeping of one choice."""

    index: int
    prompt_index: int
    prefix: str = ""  # echoed prompt text
    text: str = ""  # text sent (or to be sent) so far, without the prefix
    held: str = ""  # text received but held back (an incomplete UTF-8 character)
    role_sent: bool = False
    result: RequestOutput | None = None  # the deltas so far, added up
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once the engine has scored the prompt
    num_cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache
    timer: CompletionTimer | None = field(default=None, repr=False)
    parser: ChatOutputParser | None = field(default=None, repr=False)  # reasoning / tool calls (chat)

    @property
    def output(self):
        """The completion so far (a `CompletionOutput`), None before the first delta."""
        return None if self.result is None else self.result.outputs[0]


@dataclass
class Job:
    """A validated request, ready for the engine."""

    request_id: str  # unique per job: engine ids and the response id derive from it
    model: str
    prompts: list[list[int]]
    requests: list[EngineRequest]
    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo_logprobs: bool = False  # completions: echo + logprobs puts the prompt's logprobs first
    prompt_logprobs: int | None = None  # vLLM's extension: a `prompt_logprobs` list per choice
    client_request_id: str = ""  # the X-Request-ID echoed to the client and named in logs
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Build SamplingParams; an out-of-range value becomes a 400 naming the field."""
    stop = body.stop if body.stop is not None else ()
    optional = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        if getattr(body, name) is not None
    }
    try:
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(body),
            **optional,
        )
    except SamplingParamsError as err:
        raise _field_error(body, err) from None


def _logit_bias(body) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    try:
        return {int(token): bias for token, bias in (body.logit_bias or {}).items()}
    except ValueError:
        raise RequestError(400, "logit_bias: keys must be token ids (integers)", param="logit_bias") from None


def _field_error(body, err: SamplingParamsError) -> RequestError:
    param = err.param
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"
    return RequestError(400, f"{param}: {str(err).removeprefix(err.param + ' ')}", param=param)


def build_job(
    engine: EngineClient,
    body,
    request_id: str,
    prompts: list[list[int]],
    requested_max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    echo_texts: list[str] | None = None,
    prompt_logprobs: int | None = None,
    echo_logprobs: bool = False,
    structured_output: StructuredOutput | None = None,
) -> Job:
    """Fan the prompts out into engine requests, each validated by the engine (400 on a bad field).

    Without `max_tokens` a request generates `default_max_tokens` (None: up to the context limit).
    `prompt_logprobs` (vLLM's field) and `echo_logprobs` (echo + logprobs) both make the engine
    score the prompt, with the larger of the two top-k widths. `structured_output`: the
    request's grammar (already compiled once by the server, so a bad one was a 400)."""
    requests, choices = [], []
    for prompt_index, prompt in enumerate(prompts):
        max_tokens = requested_max_tokens
        if max_tokens is None:
            room = max(engine.max_model_len - len(prompt), 1)  # no room at all: the engine's 400
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        scored = [k for k in (prompt_logprobs, logprobs if echo_logprobs else None) if k is not None]
        base = sampling_params(body, max_tokens, logprobs, max(scored) if scored else None)
        if structured_output is not None:
            base = base.replace(structured_output=structured_output)
        try:
            checked = engine.validate_request(EngineRequest(f"{request_id}-{prompt_index}", list(prompt), base))
        except SamplingParamsError as err:
            raise _field_error(body, err) from None
        for i, params in enumerate(fan_out(checked.params, body.n)):
            index = prompt_index * body.n + i
            requests.append(  # still validated: the fan-out changes only the seed
                dataclasses.replace(
                    checked,
                    request_id=f"{request_id}-{index}",
                    params=params,
                    priority=body.priority,
                    arrival_time=time.time(),
                    kv_transfer_params=_kv_transfer_params(body, index),
                )
            )
            prefix = echo_texts[prompt_index] if echo_texts else ""
            choices.append(Choice(index=index, prompt_index=prompt_index, prefix=prefix))
    options = body.stream_options
    include_usage = bool(options and (options.include_usage or options.continuous_usage_stats))
    return Job(
        request_id,
        engine.model_name,
        prompts,
        requests,
        choices,
        body.stream,
        include_usage,
        logprobs,
        echo_logprobs=echo_logprobs,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=bool(options and options.continuous_usage_stats),
    )


async def merged_outputs(
    engine: EngineClient, requests: list[EngineRequest], client_request_id: str = "", cut: asyncio.Event | None = None
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave the delta streams of several engine requests as `(request index, delta)`.

    Use it under `contextlib.aclosing`: closing it early aborts the unfinished requests.
    Engine failures reach the client as "internal error (request id ...)"; details go to the log.
    Once `cut` is set (a drain that ran out of time), it raises a 503 RequestError instead of
    waiting for more: the event is watched once per request, not once per output.
    """
    queue: asyncio.Queue = asyncio.Queue()
    unfinished = {request.request_id for request in requests}
    done_marker, cut_marker = object(), object()
    watcher = None
    if cut is not None:
        watcher = asyncio.ensure_future(cut.wait())
        watcher.add_done_callback(lambda w: None if w.cancelled() else queue.put_nowait((-1, cut_marker)))

    async def pump(index: int, request: EngineRequest) -> None:
        stream = engine.generate(request)
        try:
            async for output in stream:
                queue.put_nowait((index, output))
                if output.finished:
                    break
        except Exception as err:
            queue.put_nowait((index, err))
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
            queue.put_nowait((index, done_marker))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done_marker:
                remaining -= 1
                continue
            if item is cut_marker:
                raise RequestError(
                    503,
                    "The server is shutting down; this request was cut off",
                    code="draining",
                    error_type="service_unavailable",
                )
            if isinstance(item, ValueError):  # the engine refused the request (e.g. it can never fit)
                raise RequestError(400, str(item), error_type="invalid_request_error") from item
            if isinstance(item, EngineBusy):  # a capacity is full for now
                raise RequestError(503, str(item), code="overloaded", error_type="service_unavailable") from item
            if isinstance(item, Exception):
                logger.error("request %s: engine failure: %s: %s", client_request_id, type(item).__name__, item)
                raise internal_error(client_request_id) from item
            if item.error:
                logger.error("request %s: engine error: %s", client_request_id, item.error)
                raise internal_error(client_request_id)
            if item.finished:
                unfinished.discard(requests[index].request_id)
            yield index, item
    finally:
        if watcher is not None:
            watcher.cancel()
        for task in tasks:
            task.cancel()
        for request_id in unfinished:
            with contextlib.suppress(Exception):
                await engine.abort(request_id)
        await asyncio.gather(*tasks, return_exceptions=True)


def _advance(choice: Choice, delta: RequestDelta, prompt: list[int]) -> tuple[str, list, str | None, int]:
    """Add a delta to the choice; return (new text to send, new logprob entries, finish reason,
    number of new tokens)."""
    choice.result = accumulate(choice.result, delta, prompt)
    if delta.prompt_logprobs is not None:
        choice.prompt_logprobs = delta.prompt_logprobs
    choice.num_cached_tokens = delta.num_cached_tokens
    text = choice.held + delta.new_text
    if not delta.finished:  # an incomplete UTF-8 character: wait for its other bytes
        visible = text.rstrip("\ufffd")
        text, choice.held = visible, text[len(visible) :]
    else:
        choice.held = ""
    choice.text += text
    if choice.timer is not None:
        choice.timer.on_output(len(choice.output.token_ids), delta.finish_reason)
    return text, delta.new_logprobs or [], delta.finish_reason, len(delta.new_token_ids)


def _kv_transfer_params(body, index: int) -> dict | None:
    """P/D: a transfer serves one engine request (the first); the others of `n` compute locally."""
    params = getattr(body, "kv_transfer_params", None)
    return params if index == 0 else None


async def run_job(
    request: web.Request,
    engine: EngineClient,
    metrics: ServerMetrics,
    job: Job,
    formatter: Formatter,
    cut: asyncio.Event | None = None,
) -> web.StreamResponse:
    """Send the job to the engine and answer with JSON or SSE; `cut` set: the server stops
    (drain timeout), so end now with an error (in-band for a stream, then `[DONE]`)."""
    for choice, engine_request in zip(job.choices, job.requests):
        choice.timer = metrics.track(len(engine_request.prompt_token_ids))
    try:
        return await _answer(request, engine, job, formatter, cut or asyncio.Event())
    finally:
        for choice in job.choices:  # a client gone, an error, a cut: the unfinished were aborted
            choice.timer.on_abandoned()


async def _answer(
    request: web.Request, engine: EngineClient, job: Job, formatter: Formatter, cut: asyncio.Event
) -> web.StreamResponse:
    created = formats.now()
    headers = {"X-Request-ID": job.client_request_id or job.request_id}
    if not job.stream:
        kv_transfer_params = None
        async with contextlib.aclosing(merged_outputs(engine, job.requests, job.client_request_id, cut)) as outputs:
            async for index, delta in outputs:
                choice = job.choices[index]
                _advance(choice, delta, job.prompts[choice.prompt_index])
                kv_transfer_params = delta.kv_transfer_params or kv_transfer_params
        choices = [formatter.final_choice(job, choice) for choice in job.choices]
        body = formatter.body(job, created, choices, usage(job))
        if kv_transfer_params is not None:  # a prefill instance's offer, for the proxy
            body["kv_transfer_params"] = kv_transfer_params
        return web.json_response(body, headers=headers)

    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async with contextlib.aclosing(merged_outputs(engine, job.requests, job.client_request_id, cut)) as outputs:
            for choice in job.choices:  # chat: the role first; completions: the echoed prompt
                opening = (
                    formatter.chunk_choices(job, choice, "", [], None)
                    if formatter.chat
                    else (
                        [formats.completion_choice(choice.index, choice.prefix, None, None, None)]
                        if choice.prefix and not job.echo_logprobs
                        else []
                    )
                )
                for choice_chunk in opening:
                    await response.write(formats.sse(formatter.chunk(job, created, [choice_chunk])))
            async for index, delta in outputs:
                choice = job.choices[index]
                first = choice.result is None
                text, entries, finish, new_tokens = _advance(choice, delta, job.prompts[choice.prompt_index])
                if first and (job.echo_logprobs or job.prompt_logprobs is not None):
                    # the prompt is scored once its prefill is done: it leads the choice's stream
                    prompt_chunk = formatter.prompt_choice(job, choice)
                    await response.write(formats.sse(formatter.chunk(job, created, [prompt_chunk])))
                # Like vLLM, a chunk for every step that produced tokens, even when they add no
                # visible text yet (a partial UTF-8 character, a possible stop string held
                # back): clients and `vllm bench serve` then see every token's timing.
                if not (text or entries or finish or new_tokens):
                    continue
                for choice_chunk in formatter.chunk_choices(job, choice, text, entries, finish, new_tokens):
                    await response.write(formats.sse(formatter.chunk(job, created, [choice_chunk])))
        if job.include_usage:
            final = formatter.chunk(job, created, [])
            final["usage"] = usage(job)
            await response.write(formats.sse(final))
    except RequestError as err:  # headers are gone: report in-band, as OpenAI-style servers do
        await response.write(formats.sse(err.body()))
    await response.write(formats.sse("[DONE]"))
    await response.write_eof()
    return response
