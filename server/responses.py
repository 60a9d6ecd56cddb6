"""The OpenAI answer of one job: the final JSON body's choices and the SSE chunks of a stream.

`Formatter` shapes a job's choices for its endpoint (completions or chat) from what
`server.serving` added up (`Choice.result`, the text sent so far); reasoning and tool calls are
split out by the choice's `ChatOutputParser`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server import formats

if TYPE_CHECKING:
    from server.serving import Choice, Job


class Formatter:
    """Shapes for one endpoint (completions or chat)."""

    def __init__(self, chat: bool, texts: formats.TokenTexts, fingerprint: str):
        self.chat, self.texts, self.fingerprint = chat, texts, fingerprint

    def logprobs(self, entries: list, job: Job, choice: Choice, offset: int) -> dict | None:
        if job.logprobs is None:
            return None
        if self.chat:
            return formats.chat_logprobs(entries, self.texts)
        return formats.completion_logprobs(entries, self.texts, offset)

    def final_choice(self, job: Job, choice: Choice) -> dict:
        completion = choice.output
        if job.echo_logprobs:  # the prompt's tokens first (the first has no logprob), then the completion's
            logprobs = formats.completion_logprobs(
                self._echoed(job, choice) + (completion.logprobs or []), self.texts, 0
            )
        else:
            logprobs = self.logprobs(completion.logprobs or [], job, choice, len(choice.prefix))
        make = formats.chat_choice if self.chat else formats.completion_choice
        made = make(
            choice.index, choice.prefix + completion.text, logprobs, completion.finish_reason, completion.stop_reason
        )
        if choice.parser is not None:  # reasoning_content / tool_calls split out of the text
            made["message"].update(choice.parser.message(completion.text))
            made["finish_reason"] = choice.parser.finish_reason(completion.text, completion.finish_reason)
        return self._with_prompt_logprobs(job, choice, made)

    def prompt_choice(self, job: Job, choice: Choice) -> dict:
        """Streaming (completions): the chunk that opens a choice whose prompt is scored: the
        echoed prompt with its logprobs, and/or vLLM's prompt_logprobs."""
        logprobs = formats.completion_logprobs(self._echoed(job, choice), self.texts, 0) if job.echo_logprobs else None
        made = formats.completion_choice(choice.index, choice.prefix if job.echo_logprobs else "", logprobs, None, None)
        return self._with_prompt_logprobs(job, choice, made)

    def _echoed(self, job: Job, choice: Choice) -> list:
        return formats.prompt_entries(job.prompts[choice.prompt_index], choice.prompt_logprobs, job.logprobs)

    def _with_prompt_logprobs(self, job: Job, choice: Choice, made: dict) -> dict:
        if job.prompt_logprobs is not None:
            made["prompt_logprobs"] = formats.vllm_prompt_logprobs(
                choice.prompt_logprobs or [], self.texts, job.prompt_logprobs
            )
        return made

    def body(self, job: Job, created: int, choices: list[dict], usage: dict) -> dict:
        make = formats.chat_body if self.chat else formats.completion_body
        return make(_response_id(job, self.chat), job.model, created, choices, usage, self.fingerprint)

    def chunk(self, job: Job, created: int, choices: list[dict]) -> dict:
        make = formats.chat_chunk if self.chat else formats.completion_chunk
        chunk = make(_response_id(job, self.chat), job.model, created, choices, job.include_usage, self.fingerprint)
        if job.continuous_usage and choices:
            chunk["usage"] = usage(job)
        return chunk

    def chunk_choices(
        self, job: Job, choice: Choice, text: str, entries: list, finish: str | None, new_tokens: int = 0
    ) -> list[dict]:
        offset = len(choice.prefix) + len(choice.text) - len(text)
        logprobs = self.logprobs(entries, job, choice, offset) if entries else None
        stop_reason = choice.output.stop_reason if finish else None
        if not self.chat:
            return [formats.completion_choice(choice.index, text, logprobs, finish, stop_reason)]
        out = []
        if not choice.role_sent:
            choice.role_sent = True
            out.append(formats.chat_chunk_choice(choice.index, {"role": "assistant", "content": ""}, None, None))
        if choice.parser is not None and (text or logprobs or finish or new_tokens):
            out += _parsed_chunk_choices(choice, logprobs, finish, stop_reason)
        elif text or logprobs or finish or new_tokens:
            delta = {"content": text} if text or new_tokens else {}
            out.append(formats.chat_chunk_choice(choice.index, delta, logprobs, finish, stop_reason))
        return out


def _parsed_chunk_choices(choice: Choice, logprobs: dict | None, finish: str | None, stop_reason) -> list[dict]:
    """Chunks of a choice whose text is split by its ChatOutputParser (reasoning, tool calls);
    a step whose tokens are held back (a possible tag) sends an empty delta."""
    deltas = choice.parser.deltas(choice.text, finish is not None) or [{}]
    if finish is not None:
        finish = choice.parser.finish_reason(choice.text, finish)
    last = len(deltas) - 1
    return [
        formats.chat_chunk_choice(
            choice.index,
            delta,
            logprobs if i == last else None,
            finish if i == last else None,
            stop_reason if i == last else None,
        )
        for i, delta in enumerate(deltas)
    ]


def _response_id(job: Job, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{job.request_id}"


def usage(job: Job) -> dict:
    completion_tokens = sum(len(c.output.token_ids) for c in job.choices if c.output is not None)
    cached = {}  # per prompt, as prompt_tokens counts each prompt once (its n samples share it)
    for choice in job.choices:
        cached[choice.prompt_index] = max(cached.get(choice.prompt_index, 0), choice.num_cached_tokens)
    return formats.usage(sum(len(p) for p in job.prompts), completion_tokens, sum(cached.values()))
