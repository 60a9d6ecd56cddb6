"""The engine loop in a process of its own, behind the server's `EngineClient` protocol.

`AsyncEngine` (runtime/engine/thread_client.py) runs the loop on a thread of the server's process, so
the engine's Python (scheduling, input building, detokenizing) and the HTTP event loop take
turns on one GIL. `EngineProcessClient` starts the same `LLMEngine` in a child process (spawned:
no fork of a process that may hold XLA threads), where the same `runtime.engine.loop.EngineLoop`
drives it, and talks to it over two pipes, as vLLM's API server talks to its EngineCore. The
messages are the typed dataclasses of runtime/engine/messages.py:

- commands, parent -> child: `AddRequest`, `AbortRequest`, `CompileGrammar`, `Stop`. A reader
  thread in the child drains the pipe into the loop's queue, so the parent never blocks on a full
  pipe while the child is inside a long step.
- outputs, child -> parent: one `StepOutputs` per loop iteration: the engine's `RequestDelta`s as
  they are (appends only, so a step that adds one token sends that token, not the history), the
  adds it refused and its stats (an idle child sends an empty one every half second);
  `GrammarCompiled` answers a `CompileGrammar`; `EngineDied` precedes the child's exit when its
  loop failed.

The server compiles (and so validates) a request's grammar through `grammar_compiler`, which asks
the child's compiler: the grammar is compiled once, in the engine's process, and the request's add
finds it in that compiler's cache. The parent reads the outputs pipe from its asyncio event loop
(`add_reader`): no thread, no GIL hand-off per step. The tokenizer comes from the child, pickled,
so the parent's is the engine's. The parent never initialises a JAX backend (no device memory, no
XLA thread pool).

The child ignores SIGINT/SIGTERM (the server drains first, then stops it) and exits when the
command pipe closes, so it never outlives a killed server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import signal
import sys
import threading
import time

from runtime.engine.loading import load_engine
from runtime.engine.loop import EngineLoop, queued_deltas
from runtime.engine.messages import (
    AbortRequest,
    AddRequest,
    CompileGrammar,
    EngineDied,
    GrammarCompiled,
    Ready,
    Refusal,
    StartFailed,
    StepOutputs,
    Stop,
)
from runtime.structured_output.backend import GrammarError
from runtime.structured_output.compiler import DEFAULT_COMPILE_TIMEOUT_S
from runtime.types import EngineDeadError, EngineRequest, RequestDelta, StructuredOutput

log = logging.getLogger("jaxserve.engine")

_READY_TIMEOUT_S = 3600.0  # loading and compiling a large model takes long; a dead child is seen at once


class RemoteGrammarCompiler:
    """The engine process's grammar compiler, seen from the server (`compile_or_400` takes it):
    `submit` sends a `CompileGrammar` and returns a future that its `GrammarCompiled` resolves."""

    def __init__(self, client: EngineProcessClient):
        self._client = client
        self.timeout_s = DEFAULT_COMPILE_TIMEOUT_S  # the server sets its own
        self._tickets = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}

    def submit(self, grammar: StructuredOutput) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._client._death is not None:
            future.set_exception(EngineDeadError(f"the engine is dead: {self._client._death}"))
            return future
        self._client._bind_loop()  # the answer is read by the event loop
        ticket = next(self._tickets)
        self._pending[ticket] = future
        self._client._send(CompileGrammar(ticket, grammar))
        return future

    def resolve(self, message: GrammarCompiled) -> None:
        future = self._pending.pop(message.ticket, None)
        if future is None or future.done():
            return
        if message.error is None:
            future.set_result(None)
        else:
            future.set_exception(GrammarError(message.error))

    def fail_all(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))


class EngineProcessClient:
    """`EngineClient` over an `LLMEngine` running in a child process (see the module docstring).

    `start(config, model_path, model_name)` spawns the child, waits until it has loaded and
    compiled the model, and returns the client. Deltas are delivered to the event loop that made
    the first `generate` call (the server's)."""

    def __init__(self, process, commands, outputs, ready: Ready, model_name: str):
        self._process, self._commands, self._outputs = process, commands, outputs
        self.model_name = model_name
        self.max_model_len: int = ready.max_model_len
        self.vocab_size: int = ready.vocab_size
        self.tokenizer = ready.tokenizer
        self._stats: dict = ready.stats
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its deltas
        self._loop: asyncio.AbstractEventLoop | None = None
        self._death: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()  # one message at a time on the pipe, whichever thread sends
        self.pid = process.pid
        self.grammar_compiler = RemoteGrammarCompiler(self) if self.tokenizer is not None else None

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
        queue = self._streams[rid] = asyncio.Queue()
        self._send(AddRequest(request))
        try:
            async with contextlib.aclosing(queued_deltas(queue, lambda: self._send(AbortRequest(rid)))) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._streams.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def stats(self) -> dict:
        return dict(self._stats)

    async def shutdown(self) -> None:
        self._stopping = True
        self._send(Stop())
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
        if isinstance(message, StepOutputs):
            self._stats = message.stats
            for delta in message.deltas:
                queue = self._streams.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
            for refusal in message.refused:  # a ValueError is the server's 400
                queue = self._streams.get(refusal.request_id)
                if queue is not None:
                    queue.put_nowait(refusal.error())
        elif isinstance(message, GrammarCompiled):
            self.grammar_compiler.resolve(message)
        elif isinstance(message, EngineDied):
            self._mark_dead(message.reason)

    def _mark_dead(self, reason: str) -> None:
        if self._death is not None:
            return
        self._death = reason
        log.critical("the engine process is dead (%s); failing %d requests", reason, len(self._streams))
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(f"the engine is dead: {reason}"))
        self.grammar_compiler.fail_all(f"the engine is dead: {reason}")


def _wait_ready(process, outputs) -> Ready:
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
    if isinstance(message, StartFailed):
        raise RuntimeError(f"the engine failed to start: {message.reason}")
    return message


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
        ready = Ready(
            engine.max_model_len,
            engine.model.cfg.vocab_size,
            engine.tokenizer,
            tuple(engine.model.cfg.eos_token_ids),
            engine.stats(),
        )
        outputs.send(ready)
    except BaseException as err:
        log.critical("the engine failed to start", exc_info=err)
        try:
            outputs.send(StartFailed(f"{type(err).__name__}: {err}"))
        finally:
            raise SystemExit(1) from None
    _Child(engine, commands, outputs).run()


class _Child:
    """The child's side: the reader thread feeds the `EngineLoop`, whose deliveries go up the pipe."""

    def __init__(self, engine, commands, outputs):
        self.engine, self.outputs = engine, outputs
        self._send_lock = threading.Lock()  # the loop and the grammar pool both send
        self.compiler = engine.structured_output.compiler if engine.tokenizer is not None else None
        self.loop = EngineLoop(engine, self._deliver, compiler=self.compiler)  # a request's sink: its id
        threading.Thread(target=self._read, args=(commands,), name="jaxserve-engine-commands", daemon=True).start()

    def _send(self, message) -> None:
        with self._send_lock:
            self.outputs.send(message)

    def _read(self, commands) -> None:
        try:
            while True:
                message = commands.recv()
                if isinstance(message, AddRequest):
                    self.loop.add(message.request, message.request.request_id)
                elif isinstance(message, AbortRequest):
                    self.loop.abort(message.request_id)
                elif isinstance(message, CompileGrammar):
                    self._compile(message)
                else:  # Stop
                    self.loop.stop()
                    return
        except (EOFError, OSError):  # the parent is gone: stop
            self.loop.stop()

    def _compile(self, message: CompileGrammar) -> None:
        if self.compiler is None:
            self._send(GrammarCompiled(message.ticket, "structured output needs the tokenizer"))
            return

        def answer(future) -> None:
            try:
                self.compiler.result(future, message.grammar)
                error = None
            except GrammarError as err:
                error = str(err)
            with contextlib.suppress(OSError):
                self._send(GrammarCompiled(message.ticket, error))

        self.compiler.submit(message.grammar).add_done_callback(answer)

    def _deliver(self, deliveries) -> None:
        deltas = [item for _, item in deliveries if isinstance(item, RequestDelta)]
        refused = [Refusal.of(rid, item) for rid, item in deliveries if isinstance(item, BaseException)]
        self._send(StepOutputs(deltas, refused, self.engine.stats()))

    def run(self) -> None:
        self.loop.run()
        if self.loop.death is not None:
            with contextlib.suppress(OSError):
                self._send(EngineDied(f"the engine loop died: {type(self.loop.death).__name__}: {self.loop.death}"))
            raise SystemExit(1)
