"""The life of one generation request: validate, tokenize, fan out, stream or collect.

`serve_completion` and `serve_chat` turn a validated body into n x prompts `EngineRequest`s
(choice index = prompt_index * n + i, engine id `<request id>-<choice index>`, seed + i for
the i-th sample of a prompt), merge their cumulative outputs, and answer with one JSON body
or an SSE stream. Whatever ends the handler early (client disconnect, error, shutdown)
aborts every engine request that has not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web

from runtime.types import EngineRequest, RequestOutput, SamplingParams, SamplingParamsError
from server import formats
from server.engine_client import EngineClient
from server.metrics import CompletionTimer, ServerMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest, RequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context limit


@dataclass
class Choice:
    """Streaming bookkeeping of one choice."""

    index: int
    prompt_index: int
    prefix: str = ""  # echoed prompt text
    text: str = ""  # text sent (or to be sent) so far, without the prefix
    tokens_sent: int = 0
    role_sent: bool = False
    output: object = None  # the latest CompletionOutput
    timer: CompletionTimer | None = field(default=None, repr=False)


@dataclass
class Job:
    """A validated request, ready for the engine."""

    request_id: str
    model: str
    prompts: list[list[int]]
    requests: list[EngineRequest]
    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: int | None


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """Build SamplingParams; an out-of-range value becomes a 400 naming the field."""
    stop = body.stop if body.stop is not None else ()
    optional = {name: getattr(body, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        if getattr(body, name) is not None}
    try:
        return SamplingParams(
            n=1, max_tokens=max_tokens, min_tokens=body.min_tokens, seed=body.seed, stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs, **optional)
    except SamplingParamsError as err:
        param = err.param
        if param == "max_tokens" and isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise RequestError(400, f"{param}: {str(err).removeprefix(err.param + ' ')}", param=param) from None


def build_job(engine: EngineClient, body, request_id: str, prompts: list[list[int]],
              requested_max_tokens: int | None, default_max_tokens: int | None,
              logprobs: int | None, echo_texts: list[str] | None = None) -> Job:
    """Check lengths against max_model_len and fan the prompts out into engine requests."""
    base = sampling_params(body, requested_max_tokens, logprobs)
    vocab_size = engine.vocab_size  # the model's, as vLLM checks (a tokenizer may be smaller or larger)
    max_len = engine.max_model_len
    requests, choices = [], []
    for prompt_index, prompt in enumerate(prompts):
        room = max_len - len(prompt)
        if room < 1:
            raise RequestError(400, f"prompt: {len(prompt)} tokens leave no room to generate within the "
                                    f"model's maximum context length of {max_len} tokens", param="prompt")
        if max(prompt) >= vocab_size:
            raise RequestError(400, f"prompt: token id {max(prompt)} is out of vocabulary (size {vocab_size})",
                               param="prompt")
        if requested_max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif requested_max_tokens > room:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
            raise RequestError(400, f"{param}: {requested_max_tokens} tokens requested but the prompt has "
                                    f"{len(prompt)} tokens and the maximum context length is {max_len}", param=param)
        else:
            max_tokens = requested_max_tokens
        for i in range(body.n):
            index = prompt_index * body.n + i
            seed = None if body.seed is None else body.seed + i
            params = base.replace(max_tokens=max_tokens, seed=seed)
            requests.append(EngineRequest(f"{request_id}-{index}", list(prompt), params,
                                          priority=body.priority, arrival_time=time.time(),
                                          kv_transfer_params=_kv_transfer_params(body, index)))
            prefix = echo_texts[prompt_index] if echo_texts else ""
            choices.append(Choice(index=index, prompt_index=prompt_index, prefix=prefix))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(request_id, engine.model_name, prompts, requests, choices, body.stream, include_usage, logprobs)


async def merged_outputs(engine: EngineClient, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the output streams of several engine requests as `(request index, output)`.

    Use it under `contextlib.aclosing`: closing it early aborts the unfinished requests.
    """
    queue: asyncio.Queue = asyncio.Queue()
    unfinished = {request.request_id for request in requests}
    done_marker = object()

    async def pump(index: int, request: EngineRequest) -> None:
        stream = engine.generate(request)
        try:
            async for output in stream:
                queue.put_nowait((index, output))
                if output.finished:
                    break
        except Exception as err:  # noqa: BLE001 - reported to the consumer
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
            if isinstance(item, ValueError):  # the engine refused the request (e.g. it can never fit)
                raise RequestError(400, str(item), error_type="invalid_request_error") from item
            if isinstance(item, Exception):
                raise RequestError(500, f"engine failure: {type(item).__name__}: {item}",
                                   error_type="internal_error") from item
            if item.error:
                raise RequestError(500, f"engine error: {item.error}", error_type="internal_error")
            if item.finished:
                unfinished.discard(requests[index].request_id)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for request_id in unfinished:
            with contextlib.suppress(Exception):
                await engine.abort(request_id)
        await asyncio.gather(*tasks, return_exceptions=True)


def _advance(choice: Choice, output: RequestOutput) -> tuple[str, list, str | None, int]:
    """Record a new cumulative output; return (new text, new logprob entries, finish reason,
    number of new tokens)."""
    completion = output.outputs[0]
    choice.output = completion
    text = completion.text
    if not completion.finished:
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for its other bytes
    new_text = text[len(choice.text):] if text.startswith(choice.text) else ""
    if new_text:
        choice.text = text
    new_logprobs = (completion.logprobs or [])[choice.tokens_sent:]
    new_tokens = len(completion.token_ids) - choice.tokens_sent
    choice.tokens_sent = len(completion.token_ids)
    if choice.timer is not None:
        choice.timer.on_output(len(completion.token_ids), completion.finish_reason)
    return new_text, new_logprobs, completion.finish_reason, new_tokens


class Formatter:
    """Shapes for one endpoint (completions or chat)."""

    def __init__(self, chat: bool, texts: formats.TokenTexts):
        self.chat, self.texts = chat, texts

    def logprobs(self, entries: list, job: Job, choice: Choice, offset: int) -> dict | None:
        if job.logprobs is None:
            return None
        if self.chat:
            return formats.chat_logprobs(entries, self.texts)
        return formats.completion_logprobs(entries, self.texts, offset)

    def final_choice(self, job: Job, choice: Choice) -> dict:
        completion = choice.output
        logprobs = self.logprobs(completion.logprobs or [], job, choice, len(choice.prefix))
        make = formats.chat_choice if self.chat else formats.completion_choice
        return make(choice.index, choice.prefix + completion.text, logprobs,
                    completion.finish_reason, completion.stop_reason)

    def body(self, job: Job, created: int, choices: list[dict], usage: dict) -> dict:
        make = formats.chat_body if self.chat else formats.completion_body
        return make(_response_id(job, self.chat), job.model, created, choices, usage)

    def chunk(self, job: Job, created: int, choices: list[dict]) -> dict:
        make = formats.chat_chunk if self.chat else formats.completion_chunk
        return make(_response_id(job, self.chat), job.model, created, choices, job.include_usage)

    def chunk_choices(self, job: Job, choice: Choice, text: str, entries: list, finish: str | None,
                      new_tokens: int = 0) -> list[dict]:
        offset = len(choice.prefix) + len(choice.text) - len(text)
        logprobs = self.logprobs(entries, job, choice, offset) if entries else None
        stop_reason = choice.output.stop_reason if finish else None
        if not self.chat:
            return [formats.completion_choice(choice.index, text, logprobs, finish, stop_reason)]
        out = []
        if not choice.role_sent:
            choice.role_sent = True
            out.append(formats.chat_chunk_choice(choice.index, {"role": "assistant", "content": ""}, None, None))
        if text or logprobs or finish or new_tokens:
            delta = {"content": text} if text or new_tokens else {}
            out.append(formats.chat_chunk_choice(choice.index, delta, logprobs, finish, stop_reason))
        return out


def _kv_transfer_params(body, index: int) -> dict | None:
    """P/D: a transfer serves one engine request (the first); the others of `n` compute locally."""
    params = getattr(body, "kv_transfer_params", None)
    return params if index == 0 else None


def _response_id(job: Job, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{job.request_id}"


def _usage(job: Job) -> dict:
    completion_tokens = sum(len(c.output.token_ids) for c in job.choices if c.output is not None)
    return formats.usage(sum(len(p) for p in job.prompts), completion_tokens)


async def run_job(request: web.Request, engine: EngineClient, metrics: ServerMetrics, job: Job,
                  formatter: Formatter) -> web.StreamResponse:
    """Send the job to the engine and answer with JSON or SSE."""
    for choice, engine_request in zip(job.choices, job.requests):
        choice.timer = metrics.track(len(engine_request.prompt_token_ids))
    created = formats.now()
    headers = {"X-Request-ID": job.request_id}
    if not job.stream:
        kv_transfer_params = None
        async with contextlib.aclosing(merged_outputs(engine, job.requests)) as outputs:
            async for index, output in outputs:
                _advance(job.choices[index], output)
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
        choices = [formatter.final_choice(job, choice) for choice in job.choices]
        body = formatter.body(job, created, choices, _usage(job))
        if kv_transfer_params is not None:  # a prefill instance's offer, for the proxy
            body["kv_transfer_params"] = kv_transfer_params
        return web.json_response(body, headers=headers)

    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async with contextlib.aclosing(merged_outputs(engine, job.requests)) as outputs:
            for choice in job.choices:  # chat: the role first; completions: the echoed prompt
                opening = formatter.chunk_choices(job, choice, "", [], None) if formatter.chat else (
                    [formats.completion_choice(choice.index, choice.prefix, None, None, None)] if choice.prefix else [])
                for choice_chunk in opening:
                    await response.write(formats.sse(formatter.chunk(job, created, [choice_chunk])))
            async for index, output in outputs:
                choice = job.choices[index]
                text, entries, finish, new_tokens = _advance(choice, output)
                # Like vLLM, a chunk for every step that produced tokens, even when they add no
                # visible text yet (a partial UTF-8 character, a possible stop string held
                # back): clients and `vllm bench serve` then see every token's timing.
                if not (text or entries or finish or new_tokens):
                    continue
                for choice_chunk in formatter.chunk_choices(job, choice, text, entries, finish, new_tokens):
                    await response.write(formats.sse(formatter.chunk(job, created, [choice_chunk])))
        if job.include_usage:
            final = formatter.chunk(job, created, [])
            final["usage"] = _usage(job)
            await response.write(formats.sse(final))
    except RequestError as err:  # headers are gone: report in-band, as OpenAI-style servers do
        await response.write(formats.sse(err.body()))
    await response.write(formats.sse("[DONE]"))
    await response.write_eof()
    return response
