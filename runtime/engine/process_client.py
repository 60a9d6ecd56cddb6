"""The engine loop in a process of its own, behind the server's `EngineClient` protocol.

`AsyncEngine` (runtime/engine/thread_client.py) runs the loop on a thread of the server's process, so
the engine's Python (scheduling, input building, detokenizing) and the HTTP event loop take
turns on one GIL. `EngineProcessClient` starts the same `LLMEngine` in a child process (spawned:
no fork of a process that may hold XLA threads) and talks to it over two pipes, as vLLM's
API server talks to its EngineCore:

- commands, parent -> child: `("add", EngineRequest)`, `("abort", request_id)`, `None` (stop).
  A reader thread in the child drains the pipe into a queue, so the parent never blocks on a
  full pipe while the child is inside a long step.
- outputs, child -> parent: one message per engine step, `("step", deltas, stats)`. The engine's
  outputs are cumulative (all tokens and text so far); across the pipe they travel as deltas
  (`_OutputDelta`: what is new since the last message) and the parent rebuilds the cumulative
  `RequestOutput` the protocol promises (an idle child sends `("step", [], stats)` every
  half second). `("reject", id, message)` answers an add the engine refused; `("dead", reason)`
  precedes the child's exit when its loop failed.

The parent reads the outputs pipe from its asyncio event loop (`add_reader`): no thread, no GIL
hand-off per step. The tokenizer comes from the child, pickled, so the parent's is the engine's.
The parent never initialises a JAX backend (no device memory, no XLA thread pool).

The child ignores SIGINT/SIGTERM (the server drains first, then stops it) and exits when the
command pipe closes, so it never outlives a killed server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from functools import cached_property

from runtime.engine.llm_engine import EngineDeadError
from runtime.engine.loading import load_engine
from runtime.engine.thread_client import queued_outputs
from runtime.types import CompletionOutput, EngineRequest, RequestOutput

log = logging.getLogger("jaxserve.engine")

_READY_TIMEOUT_S = 3600.0  # loading and compiling a large model takes long; a dead child is seen at once
_IDLE_POLL_S = 0.5


@dataclass(slots=True)
class _OutputDelta:
    """One request's progress in one step: what changed since the previous message."""

    request_id: str
    keep_tokens: int  # output token ids kept from the previous message (the rest are replaced)
    new_tokens: list[int]
    keep_text: int  # characters of text kept
    new_text: str
    keep_logprobs: int
    new_logprobs: list | None  # None: the request asked for no logprobs
    finish_reason: str | None
    stop_reason: int | str | None
    finished: bool
    num_cached_tokens: int
    error: str | None
    prompt_logprobs: list | None  # sent once, when the engine has scored the prompt
    kv_transfer_params: dict | None


class _DeltaEncoder:
    """Child side: cumulative `RequestOutput`s -> `_OutputDelta`s (remembers what each request sent)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, str, int, bool]] = {}  # id -> (tokens, text, logprobs, prompt_lp sent)

    def encode(self, out: RequestOutput) -> _OutputDelta:
        completion = out.outputs[0]  # the engine runs one completion per request (the server fans out)
        n_tokens, text, n_logprobs, prompt_sent = self._sent.get(out.request_id, (0, "", 0, False))
        tokens = completion.token_ids
        keep_tokens = n_tokens if len(tokens) >= n_tokens else 0  # tokens only grow; anything else: resend
        keep_text = len(text) if completion.text.startswith(text) else 0
        logprobs = completion.logprobs
        keep_logprobs = n_logprobs if logprobs is not None and len(logprobs) >= n_logprobs else 0
        send_prompt_lp = out.prompt_logprobs is not None and not prompt_sent
        delta = _OutputDelta(
            out.request_id,
            keep_tokens,
            tokens[keep_tokens:],
            keep_text,
            completion.text[keep_text:],
            keep_logprobs,
            None if logprobs is None else logprobs[keep_logprobs:],
            completion.finish_reason,
            completion.stop_reason,
            out.finished,
            out.num_cached_tokens,
            out.error,
            out.prompt_logprobs if send_prompt_lp else None,
            out.kv_transfer_params,
        )
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (
                len(tokens),
                completion.text,
                0 if logprobs is None else len(logprobs),
                prompt_sent or send_prompt_lp,
            )
        return delta

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class _Stream:
    """Parent side: one request's queue and the cumulative output rebuilt from deltas."""

    __slots__ = ("logprobs", "prompt_logprobs", "queue", "request", "text", "tokens")

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.prompt_logprobs = None

    def apply(self, d: _OutputDelta) -> RequestOutput:
        self.tokens = self.tokens[: d.keep_tokens] + d.new_tokens
        self.text = self.text[: d.keep_text] + d.new_text
        if d.new_logprobs is not None:
            self.logprobs = (self.logprobs or [])[: d.keep_logprobs] + d.new_logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        # fresh lists each step (rebound above, never mutated): earlier outputs stay as they were
        completion = CompletionOutput(
            0,
            self.tokens,
            self.text,
            self.logprobs,
            d.finish_reason if d.finished else None,
            d.stop_reason if d.finished else None,
        )
        return RequestOutput(
            d.request_id,
            self.request.prompt_token_ids,
            [completion],
            finished=d.finished,
            num_cached_tokens=d.num_cached_tokens,
            error=d.error,
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer_params=d.kv_transfer_params,
        )


class EngineProcessClient:
    """`EngineClient` over an `LLMEngine` running in a child process (see the module docstring).

    `start(config, model_path, model_name)` spawns the child, waits until it has loaded and
    compiled the model, and returns the client. Outputs are delivered to the event loop that made
    the first `generate` call (the server's)."""

    def __init__(self, process, commands, outputs, ready: dict, model_name: str):
        self._process, self._commands, self._outputs = process, commands, outputs
        self.model_name = model_name
        self.max_model_len: int = ready["max_model_len"]
        self.vocab_size: int = ready["vocab_size"]
        self.tokenizer = ready["tokenizer"]
        self._eos_token_ids: tuple[int, ...] = ready["eos_token_ids"]
        self._stats: dict = ready["stats"]
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._death: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()  # one message at a time on the pipe, whichever thread sends
        self.pid = process.pid

    @cached_property
    def grammar_compiler(self):
        """The server's grammar compiler (it compiles, and so validates, grammars before submitting),
        with the engine's EOS ids; built on the first grammar request."""
        if self.tokenizer is None:
            return None
        from runtime.structured_output import build_compiler

        return build_compiler(self.tokenizer, self.vocab_size, self._eos_token_ids)

    @classmethod
    def start(cls, config, model_path: str, model_name: str) -> EngineProcessClient:
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        root = logging.getLogger()
        process = ctx.Process(
            target=_child_main,
            name="jaxserve-engine",
            args=(cmd_recv, out_send, config, model_path, root.level),
            daemon=True,
        )
        process.start()
        cmd_recv.close()
        out_send.close()
        try:
            ready = _wait_ready(process, out_recv)
        except BaseException:
            cmd_send.close()
            out_recv.close()
            _stop_process(process, 5.0)
            raise
        log.info("engine process %d ready", process.pid)
        return cls(process, cmd_send, out_recv, ready, model_name)

    # ---- EngineClient -------------------------------------------------------------------------
    def validate_request(self, request: EngineRequest) -> EngineRequest:
        from runtime.validation import validate_request

        return validate_request(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def is_healthy(self) -> bool:
        return self._death is None and (self._stopping or self._process.is_alive())

    async def generate(self, request: EngineRequest):
        if not self.is_healthy():
            raise EngineDeadError(
                f"the engine process has died: {self._death or f'exit code {self._process.exitcode}'}"
            )
        self._bind_loop()
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream = _Stream(request)
        self._streams[rid] = stream
        self._send(("add", request))
        try:
            async with contextlib.aclosing(queued_outputs(stream.queue, lambda: self._send(("abort", rid)))) as outputs:
                async for item in outputs:
                    yield item
        finally:
            self._streams.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> dict:
        return dict(self._stats)

    async def shutdown(self) -> None:
        self._stopping = True
        self._send(None)
        await asyncio.to_thread(_stop_process, self._process, 30.0 if self._death is None else 2.0)
        self._unbind_loop()
        self._commands.close()
        self._outputs.close()

    # ---- plumbing -----------------------------------------------------------------------------
    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self._commands.send(message)
        except (OSError, ValueError) as err:  # the child is gone (broken pipe) or the pipe is closed
            if not self._stopping:
                self._mark_dead(f"cannot reach the engine process: {err}")

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._outputs.fileno(), self._on_readable)
        elif self._loop is not loop:
            raise RuntimeError("EngineProcessClient serves one event loop (the server's)")

    def _unbind_loop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._outputs.fileno())
        self._loop = None

    def _on_readable(self) -> None:
        try:
            while self._outputs.poll():
                self._dispatch(self._outputs.recv())
        except (EOFError, OSError) as err:
            self._unbind_loop()
            if not self._stopping:
                self._mark_dead(f"the engine process exited (code {self._process.exitcode}): {err!r}")

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "step":
            _, deltas, self._stats = message
            for d in deltas:
                stream = self._streams.get(d.request_id)
                if stream is not None:
                    stream.queue.put_nowait(stream.apply(d))
        elif kind == "reject":  # the server answers a refused request (a ValueError) with a 400
            _, rid, text = message
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(ValueError(text))
        elif kind == "dead":
            self._mark_dead(message[1])

    def _mark_dead(self, reason: str) -> None:
        if self._death is not None:
            return
        self._death = reason
        log.critical("the engine process is dead (%s); failing %d requests", reason, len(self._streams))
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(f"the engine is dead: {reason}"))


def _wait_ready(process, outputs) -> dict:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not outputs.poll(1.0):
        if not process.is_alive():
            raise RuntimeError(
                f"the engine process exited during start-up (code {process.exitcode}); its log above says why"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine process was not ready after {_READY_TIMEOUT_S:.0f} s")
    try:
        message = outputs.recv()
    except EOFError:
        process.join(5.0)
        raise RuntimeError(
            f"the engine process exited during start-up (code {process.exitcode}); its log above says why"
        ) from None
    if message[0] == "failed":
        raise RuntimeError(f"the engine failed to start: {message[1]}")
    return message[1]


def _stop_process(process, timeout_s: float) -> None:
    """Wait for the child to exit; then terminate it, then kill it (by its PID, via `process`)."""
    process.join(timeout_s)
    if process.is_alive():
        log.warning("engine process %d did not stop in %.0f s: terminating it", process.pid, timeout_s)
        process.terminate()
        process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)


# ---- the child ---------------------------------------------------------------------------------
def _child_main(commands, outputs, config, model_path: str, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains first, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    sys.setswitchinterval(config.server.gil_switch_interval_ms / 1e3)  # the command reader thread
    try:
        engine = load_engine(config, model_path)
        ready = {
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.model.cfg.vocab_size,
            "tokenizer": engine.tokenizer,
            "eos_token_ids": tuple(engine.model.cfg.eos_token_ids),
            "stats": engine.stats(),
        }
        outputs.send(("ready", ready))
    except BaseException as err:
        log.critical("the engine failed to start", exc_info=err)
        try:
            outputs.send(("failed", f"{type(err).__name__}: {err}"))
        finally:
            raise SystemExit(1) from None
    _ChildLoop(engine, commands, outputs).run()


class _ChildLoop:
    def __init__(self, engine, commands, outputs):
        self.engine, self.outputs = engine, outputs
        self.inbox: queue.Queue = queue.Queue()
        self.encoder = _DeltaEncoder()
        self.live: set[str] = set()  # requests the parent waits on
        self.compiling: dict[str, EngineRequest] = {}  # added, waiting for their grammar to compile
        threading.Thread(target=self._read, args=(commands,), name="jaxserve-engine-commands", daemon=True).start()

    def _read(self, commands) -> None:
        try:
            while True:
                message = commands.recv()
                self.inbox.put(message)
                if message is None:
                    return
        except (EOFError, OSError):  # the parent is gone: stop
            self.inbox.put(None)

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as err:
            log.critical("the engine loop died; failing %d requests", len(self.live), exc_info=err)
            try:
                self.outputs.send(("dead", f"the engine loop died: {type(err).__name__}: {err}"))
            except OSError:
                pass
            raise SystemExit(1) from None

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()  # idle: block (a grammar that finishes compiling wakes us)
            try:
                message = self.inbox.get(block=not busy, timeout=_IDLE_POLL_S if not busy else None)
                while True:
                    if message is None:
                        for rid in list(self.live):
                            engine.abort(rid)
                        return
                    self._handle(message)
                    message = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if engine.has_unfinished():
                deltas = []
                for out in engine.step():  # a failed step comes back as error outputs; raising is fatal
                    if out.request_id in self.live:
                        deltas.append(self.encoder.encode(out))
                        if out.finished:
                            self.live.discard(out.request_id)
                    else:
                        self.encoder.forget(out.request_id)
                self.outputs.send(("step", deltas, engine.stats()))
            elif not busy:  # idle: keep the server's stats fresh (adds and aborts change them)
                self.outputs.send(("step", [], engine.stats()))

    def _handle(self, message) -> None:
        kind, payload = message
        if kind == "add":
            grammar = payload.params.structured_output
            if grammar is not None and self.engine.tokenizer is not None:
                # compile on the compiler's pool, not in the loop: the running streams go on; the
                # request joins when its grammar is ready (a cache hit joins at once)
                future = self.engine.structured_output.compiler.submit(grammar)
                if not future.done():
                    rid = payload.request_id
                    self.compiling[rid] = payload
                    future.add_done_callback(lambda _future, rid=rid: self.inbox.put(("compiled", rid)))
                    return
            self._add(payload)
        elif kind == "compiled":
            request = self.compiling.pop(payload, None)
            if request is not None:  # not aborted meanwhile
                self._add(request)
        elif kind == "abort":
            self.compiling.pop(payload, None)
            out = self.engine.abort(payload)
            if payload in self.live:
                self.live.discard(payload)
                if out is not None:
                    self.outputs.send(("step", [self.encoder.encode(out)], self.engine.stats()))
            self.encoder.forget(payload)

    def _add(self, request: EngineRequest) -> None:
        rid = request.request_id
        try:
            self.engine.add_request(request)
        except ValueError as err:  # e.g. it can never fit, or its grammar is invalid (GrammarError)
            self.outputs.send(("reject", rid, str(err)))
            return
        self.live.add(rid)
