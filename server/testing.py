"""A fake engine whose outputs can be computed by hand, and a small real tokenizer for it.

`FakeEngine` implements `EngineClient` without a model (JetStream's mock-engine idea): after
the last prompt token `t`, it generates `next_token(t, seed, vocab)` = `(t * 7 + 3 + seed) % vocab`
(seed None counts as 0), one token per `token_delay_s`; or, when a text is queued in
`scripted_texts`, that text's tokens, then "stop". The sampled token's logprob is -0.5
and the j-th top alternative is token `(sampled + j) % vocab` with logprob `-0.5 - j`.
Text is `tokenizer.decode(generated_ids, skip_special_tokens=True)`, cut at the first stop
string. It owns `num_slots` slots: a request waits for a free one, and `abort` or the end of
generation frees it, so tests can observe that disconnects release capacity.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import textwrap
from collections.abc import AsyncIterator

from runtime.types import CompletionOutput, EngineRequest, RequestOutput, TokenLogprob
from runtime.validation import validate_request

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def next_token(token: int, seed: int | None, vocab_size: int) -> int:
    return (token * 7 + 3 + (seed or 0)) % vocab_size


def sampled_logprob(rank: int) -> float:
    return -0.5 - rank


def build_test_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on docstrings of the standard library (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [module.__doc__ or "" for module in (asyncio, inspect, json, textwrap)]
    corpus += [inspect.getdoc(obj) or "" for obj in (dict, list, str, bytes, int, open, print, sorted)]
    lines = [line for text in corpus for line in text.splitlines() if line.strip()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


class FakeEngine:
    """An `EngineClient` with hand-computable outputs, per-token delay and observable slots."""

    def __init__(
        self,
        tokenizer,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 256,
        num_slots: int = 8,
        token_delay_s: float = 0.0,
    ):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.num_slots = num_slots
        self.token_delay_s = token_delay_s
        self.slots_free = num_slots
        self.num_waiting = 0
        self.requests: list[EngineRequest] = []  # every request received, in order
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.shutdown_called = False
        self.healthy = True  # tests flip it to play a dead engine loop
        # Scripted outputs: each new request takes the next text (if any) and generates its tokens
        # (tokenizer.encode, no special tokens) one per step, then stops ("stop").
        self.scripted_texts: list[str] = []
        self._slot_released: asyncio.Condition | None = None

    def validate_request(self, request: EngineRequest) -> EngineRequest:
        return validate_request(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def is_healthy(self) -> bool:
        return self.healthy

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        if self._slot_released is None:
            self._slot_released = asyncio.Condition()
        holds_slot = False
        try:
            self.num_waiting += 1
            try:
                async with self._slot_released:
                    await self._slot_released.wait_for(
                        lambda: self.slots_free > 0 or request.request_id in self.aborted
                    )
                    if request.request_id not in self.aborted:
                        self.slots_free -= 1
                        holds_slot = True
            finally:
                self.num_waiting -= 1
            async for output in self._run(request):
                yield output
        finally:
            if holds_slot:
                self.slots_free += 1
                async with self._slot_released:
                    self._slot_released.notify_all()

    async def _run(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        params = request.params
        prompt = request.prompt_token_ids
        limit = self.max_model_len - len(prompt)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        completion = CompletionOutput(index=0, logprobs=[] if params.logprobs is not None else None)
        token = prompt[-1]
        if params.max_tokens == 0:  # scoring only
            completion.finish_reason = "length"
            self.finished.add(request.request_id)
            yield self._output(request, completion)
            return
        script = None
        if self.scripted_texts:
            script = self.tokenizer.encode(self.scripted_texts.pop(0), add_special_tokens=False)
            limit = min(limit, len(script))
        while True:
            if request.request_id in self.aborted:
                completion.finish_reason = "abort"
                yield self._output(request, completion)
                return
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            token = (
                next_token(token, params.seed, self.vocab_size) if script is None else script[len(completion.token_ids)]
            )
            completion.token_ids.append(token)
            if completion.logprobs is not None:
                top = [((token + j) % self.vocab_size, sampled_logprob(j)) for j in range(params.logprobs)]
                completion.logprobs.append(TokenLogprob(token, sampled_logprob(0), top))
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=params.skip_special_tokens)
            completion.text, stop = _cut_at_stop(text, params.stop, params.include_stop_str_in_output)
            if stop is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop
            elif token in params.stop_token_ids:
                completion.finish_reason, completion.stop_reason = "stop", token
            elif len(completion.token_ids) >= limit:
                completion.finish_reason = "length" if script is None or limit < len(script) else "stop"
            else:
                completion.text = _hold_back_partial_stop(completion.text, params.stop)
            if completion.finished:
                self.finished.add(request.request_id)
            yield self._output(request, completion)
            if completion.finished:
                return
            if not self.token_delay_s:
                await asyncio.sleep(0)

    @staticmethod
    def _output(request: EngineRequest, completion: CompletionOutput) -> RequestOutput:
        snapshot = CompletionOutput(
            index=0,
            token_ids=list(completion.token_ids),
            text=completion.text,
            logprobs=None if completion.logprobs is None else list(completion.logprobs),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        return RequestOutput(request.request_id, list(request.prompt_token_ids), [snapshot], finished=snapshot.finished)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        if self._slot_released is not None:
            async with self._slot_released:
                self._slot_released.notify_all()

    def stats(self) -> dict:
        running = self.num_slots - self.slots_free
        return {
            "pages_total": 64,
            "pages_free": 64 - 2 * running,
            "pages_cached": 0,
            "slots_total": self.num_slots,
            "slots_free": self.slots_free,
            "slots_cached": 0,
            "prefix_cache_hit_rate": 0.0,
            "num_preemptions": 0,
            "num_running": running,
            "num_waiting": self.num_waiting,
        }

    async def shutdown(self) -> None:
        self.shutdown_called = True


def _cut_at_stop(text: str, stops: tuple[str, ...], include_stop: bool) -> tuple[str, str | None]:
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    if not hits:
        return text, None
    position, stop = min(hits)
    return text[: position + len(stop) if include_stop else position], stop


def _hold_back_partial_stop(text: str, stops: tuple[str, ...]) -> str:
    """Drop a suffix of `text` that could still grow into a stop string."""
    keep = len(text)
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                keep = min(keep, len(text) - length)
                break
    return text[:keep]


class LiveServer:
    """The app on 127.0.0.1 (a free port) served from a background thread's event loop.

    For tests that drive the server with ordinary clients (openai, aiohttp) from their own
    loop. `call(coro)` runs a coroutine on the server's loop (e.g. to inspect or drain).
    """

    def __init__(self, engine, server_config=None, kv_transfer_token: str | None = None):
        import threading

        from server.app import create_app
        from server.runner import start_app

        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="jaxserve-test-server", daemon=True)
        self._thread.start()
        self.app = self.call(self._create(create_app, engine, server_config, kv_transfer_token))
        self.runner, _host, self.port = self.call(start_app(self.app, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    async def _create(create_app, engine, server_config, kv_transfer_token):
        return create_app(engine, server_config, kv_transfer_token)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.call(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
