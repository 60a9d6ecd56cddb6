"""The router's view of a request's prompt: its token ids, for block hashing.

With `--tokenizer PATH` the router loads that tokenizer and its chat template once (transformers,
imported only then; no JAX) and renders chat messages with the generation prompt, as a replica
does. Without it, the router asks a replica's `POST /tokenize` (jaxserve serves it, vLLM's shape).
Either way the wait is bounded (`tokenize_timeout_s`) and any failure means "no tokens": the
request is then routed by load alone, never refused for it. Only a prompt's first text is used
(a list of prompts routes by its first); prompts past `max_prompt_chars` are not tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

log = logging.getLogger("jaxserve.router")


def tokenize_request(path: str, body: dict, max_chars: int) -> dict | None:
    """The /tokenize body that renders this request's prompt, or None (nothing to tokenize)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if len(json.dumps(messages)) > max_chars:
            return None
        return {"messages": messages, "add_generation_prompt": True}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt and len(prompt) <= max_chars:
        return {"prompt": prompt}
    return None


def token_prompt(body: dict) -> list[int] | None:
    """A completion prompt given as token ids (one list, or the first of a list of lists)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


class LocalTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer  # only with --tokenizer; imports no JAX

        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def _render(self, request: dict) -> list[int]:
        if "messages" in request:
            ids = self.tokenizer.apply_chat_template(request["messages"], tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer.encode(request["prompt"], add_special_tokens=True)

    async def tokens(self, request: dict, session, urls, timeout_s: float, headers=None) -> list[int] | None:
        return await asyncio.wait_for(asyncio.to_thread(self._render, request), timeout_s)


class BackendTokenizer:
    """Asks the first replica in `urls` that answers `/tokenize`."""

    async def tokens(self, request: dict, session: aiohttp.ClientSession, urls, timeout_s: float, headers=None):
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        for url in urls[:2]:
            async with session.post(url + "/tokenize", json=request, headers=headers, timeout=timeout) as resp:
                if resp.status == 200:
                    tokens = (await resp.json()).get("tokens")
                    if isinstance(tokens, list):
                        return tokens
        return None


async def prompt_tokens(source, path: str, body: dict, session, urls, timeout_s: float, max_chars: int, headers=None):
    """The prompt's token ids for routing, or None (route by load)."""
    tokens = token_prompt(body) if not path.endswith("/chat/completions") else None
    if tokens is not None:
        return tokens
    request = tokenize_request(path, body, max_chars)
    if request is None or not urls:
        return None
    try:
        return await asyncio.wait_for(source.tokens(request, session, urls, timeout_s, headers), timeout_s)
    except Exception as err:  # a template error, a timeout, a replica's 4xx: routing falls back to load
        log.debug("prompt not tokenized for routing: %r", err)
        return None
