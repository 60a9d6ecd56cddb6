"""OpenAI response shapes: completion and chat bodies, SSE chunks, logprobs, usage.

Pure functions over plain values; no I/O. A token's text in logprobs is
`tokenizer.decode([token_id])` (a lone byte of a multi-byte character shows as U+FFFD; the
`bytes` field of chat logprobs is that text's UTF-8 encoding).
"""

from __future__ import annotations

import hashlib
import json
import time

from runtime.types import TokenLogprob


class TokenTexts:
    """Memoized `decode([token_id])` for logprobs."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI usage; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def system_fingerprint(server_version: str, model: str) -> str:
    """OpenAI's `fp_...`: changes when the server version or the served model does."""
    return "fp_" + hashlib.sha256(f"jaxserve {server_version} {model}".encode()).hexdigest()[:10]


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, text_offset: int) -> dict:
    """Legacy completions shape: parallel lists; top_logprobs holds up to k+1 entries (k + sampled)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token = texts(entry.token_id)
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        offsets.append(text_offset)
        text_offset += len(token)
        if entry.logprob is None:  # an echoed prompt's first token: nothing predicts it
            top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:  # best first: on a text collision the better one stays
            top.setdefault(texts(token_id), logprob)
        top.setdefault(token, entry.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_entries(prompt: list[int], scored: list[TokenLogprob | None] | None, k: int) -> list[TokenLogprob]:
    """Echoed prompt tokens as logprob entries: the first (and any unscored one) with logprob
    None, the others with their top k alternatives."""
    scored = scored or [None] * len(prompt)
    return [
        TokenLogprob(token, None, []) if entry is None else TokenLogprob(token, entry.logprob, entry.top[:k])
        for token, entry in zip(prompt, scored)
    ]


def vllm_prompt_logprobs(scored: list[TokenLogprob | None], texts: TokenTexts, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token a dict keyed by token id
    (as a string) of {logprob, rank, decoded_token}: the prompt token itself plus the top k."""
    out: list[dict | None] = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        ranked = {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": texts(t)}
            for rank, (t, lp) in enumerate(entry.top[:k], start=1)
        }
        ranked.setdefault(
            str(entry.token_id), {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": texts(entry.token_id)}
        )
        out.append(ranked)
    return out


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """Chat shape: `{"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": None}`."""

    def item(token_id: int, logprob: float) -> dict:
        token = texts(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = [
        {**item(entry.token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]}
        for entry in entries
    ]
    return {"content": content, "refusal": None}


def completion_body(
    response_id: str, model: str, created: int, choices: list[dict], usage_: dict, fingerprint: str
) -> dict:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "system_fingerprint": fingerprint,
    }


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_body(response_id: str, model: str, created: int, choices: list[dict], usage_: dict, fingerprint: str) -> dict:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "system_fingerprint": fingerprint,
    }


def chat_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict:
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": [], "tool_calls": []}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_chunk(
    response_id: str, model: str, created: int, choices: list[dict], include_usage: bool, fingerprint: str
) -> dict:
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": fingerprint,
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(
    response_id: str, model: str, created: int, choices: list[dict], include_usage: bool, fingerprint: str
) -> dict:
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": fingerprint,
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk_choice(
    index: int, delta: dict, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None = None
) -> dict:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def now() -> int:
    return int(time.time())
