"""A fake engine whose outputs can be computed by hand, and a small real tokenizer for it.

`FakeEngine` implements `EngineClient` without a model (JetStream's mock-engine idea): after
the last prompt token `t`, it generates `next_token(t, seed, vocab)` = `(t * 7 + 3 + seed) % vocab`
(seed None counts as 0), one token per `token_delay_s`; or, when a text is queued in
`scripted_texts`, that text's tokens, then "stop". The sampled token's logprob is -0.5
and the j-th top alternative is token `(sampled + j) % vocab` with logprob `-0.5 - j`.
Text is `tokenizer.decode(generated_ids, skip_special_tokens=True)`, cut at the first stop
string. It owns `num_slots` slots: a request waits for a free one, and `abort` or the end of
generation frees it, so tests can observe that disconnects release capacity. It runs on the
same `runtime.engine.loop.EngineLoop` as the real transports and emits the same `RequestDelta`s.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import textwrap
import threading
import time
from collections.abc import AsyncIterator

from runtime.engine.loop import EngineLoop, deliver_to_event_loops
from runtime.types import EngineRequest, RequestDelta, TokenLogprob
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


class FakeCore:
    """The fake's engine side: what `EngineLoop` drives (add_request, abort, step, has_unfinished).

    Each `step()` admits waiting requests into free slots, then gives every running request its
    next token and a `RequestDelta` (text past what it sent, held back while it could still grow
    into a stop string or complete a UTF-8 character)."""

    def __init__(self, owner: FakeEngine):
        self.owner = owner
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: EngineRequest) -> None:
        if not request.validated:
            request = self.owner.validate_request(request)
        self.waiting.append(_FakeRequest(request))

    def abort(self, request_id: str) -> RequestDelta | None:
        for queue in (self.waiting, self.running):
            for fake in queue:
                if fake.request.request_id == request_id:
                    queue.remove(fake)
                    return fake.delta("", "abort", None)
        return None

    def step(self) -> list[RequestDelta]:
        owner, deltas = self.owner, []
        if owner.token_delay_s:
            time.sleep(owner.token_delay_s)  # the step's "device time"
        while self.waiting and len(self.running) < owner.num_slots:
            fake = self.waiting.pop(0)
            if fake.request.params.max_tokens == 0:  # scoring only
                owner.finished.add(fake.request.request_id)
                deltas.append(fake.delta("", "length", None))
                continue
            if owner.scripted_texts:
                fake.script = owner.tokenizer.encode(owner.scripted_texts.pop(0), add_special_tokens=False)
            self.running.append(fake)
        for fake in list(self.running):
            delta = fake.advance(owner.tokenizer, owner.vocab_size, owner.max_model_len)
            if delta.finished:
                self.running.remove(fake)
                owner.finished.add(fake.request.request_id)
            deltas.append(delta)
        return deltas


class _FakeRequest:
    def __init__(self, request: EngineRequest):
        self.request = request
        self.script: list[int] | None = None
        self.token_ids: list[int] = []
        self.sent = ""  # text sent in deltas so far

    def advance(self, tokenizer, vocab_size: int, max_model_len: int) -> RequestDelta:
        params, prompt = self.request.params, self.request.prompt_token_ids
        limit = max_model_len - len(prompt)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        if self.script is not None:
            limit = min(limit, len(self.script))
        previous = self.token_ids[-1] if self.token_ids else prompt[-1]
        token = (
            next_token(previous, params.seed, vocab_size) if self.script is None else self.script[len(self.token_ids)]
        )
        self.token_ids.append(token)
        logprobs = None
        if params.logprobs is not None:
            top = [((token + j) % vocab_size, sampled_logprob(j)) for j in range(params.logprobs)]
            logprobs = [TokenLogprob(token, sampled_logprob(0), top)]
        text = tokenizer.decode(self.token_ids, skip_special_tokens=params.skip_special_tokens)
        text, stop = _cut_at_stop(text, params.stop, params.include_stop_str_in_output)
        finish, stop_reason = None, None
        if stop is not None:
            finish, stop_reason = "stop", stop
        elif token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif len(self.token_ids) >= limit:
            finish = "length" if self.script is None or limit < len(self.script) else "stop"
        else:  # a possible stop string, an incomplete UTF-8 character: wait for more
            text = _hold_back_partial_stop(text, params.stop).rstrip("\ufffd")
        delta = self.delta(text, finish, stop_reason)
        delta.new_token_ids, delta.new_logprobs = [token], logprobs
        return delta

    def delta(self, text: str, finish, stop_reason) -> RequestDelta:
        new_text = ""
        if text.startswith(self.sent):
            new_text, self.sent = text[len(self.sent) :], text
        no_logprobs = self.request.params.logprobs is None
        return RequestDelta(self.request.request_id, [], new_text, None if no_logprobs else [], finish, stop_reason)


class FakeEngine:
    """An `EngineClient` with hand-computable outputs, per-token delay and observable slots: the
    one `runtime.engine.loop.EngineLoop` drives a `FakeCore` on a thread, as `AsyncEngine` drives
    an `LLMEngine` (it serves several event loops at once, e.g. several `LiveServer`s)."""

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
        self.requests: list[EngineRequest] = []  # every request received, in order
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.shutdown_called = False
        self.healthy = True  # tests flip it to play a dead engine loop
        # Scripted outputs: each new request takes the next text (if any) and generates its tokens
        # (tokenizer.encode, no special tokens) one per step, then stops ("stop").
        self.scripted_texts: list[str] = []
        self.core = FakeCore(self)
        self._loop = EngineLoop(self.core, deliver_to_event_loops)
        self._thread: threading.Thread | None = None  # the loop's, started by the first request
        self._thread_lock = threading.Lock()

    @property
    def slots_free(self) -> int:
        return self.num_slots - len(self.core.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.waiting)

    def validate_request(self, request: EngineRequest) -> EngineRequest:
        return validate_request(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def is_healthy(self) -> bool:
        return self.healthy and self._loop.death is None

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        self.requests.append(request)
        self._start()
        async for delta in self._loop.stream(request):
            yield delta

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self._loop.abort(request_id)

    def _start(self) -> None:
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                if self._loop.stopped:  # served again after a shutdown
                    self._loop = EngineLoop(self.core, deliver_to_event_loops)
                self._thread = threading.Thread(target=self._loop.run, name="fake-engine", daemon=True)
                self._thread.start()

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
        self._loop.stop()


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
