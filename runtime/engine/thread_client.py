"""AsyncEngine: the engine loop on its own thread, behind the server's `EngineClient` protocol.

The loop thread owns the `LLMEngine` (all mutable serving state). The asyncio side only
enqueues commands (add / abort) and receives cumulative `RequestOutput`s through per-request
asyncio queues fed with `call_soon_threadsafe`. `jaxserve serve` runs the same loop in a child
process by default (runtime/engine/process_client.py); this thread serves multi-host and P/D roles
and `server.engine_process: false` (runtime/engine/client_factory.py picks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from runtime.engine.llm_engine import EngineDeadError, LLMEngine
from runtime.types import EngineBusy, EngineRequest, RequestOutput

log = logging.getLogger("jaxserve.engine")


@dataclass
class _Add:
    request: EngineRequest
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


async def queued_outputs(queue: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to the finished one; an Exception in the queue is
    raised. A consumer that stops early (closes the generator: use `contextlib.aclosing`) calls
    `abort()`, which frees the request's pages and state slot."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            abort()


def _deliver(deliveries: list[tuple[_Sink, object]]) -> None:
    """A step's outputs to their requests' queues: one wake-up of each event loop per step, not
    one per request (each `call_soon_threadsafe` writes the loop's self-pipe; 16 streams at
    ~150 steps/s made that a sixth of the engine thread's time on the 2-core bench)."""
    by_loop: dict = {}
    for sink, item in deliveries:
        by_loop.setdefault(sink.loop, []).append((sink.queue, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.cfg.vocab_size
        self.tokenizer = engine.tokenizer
        # Shared with the server, which compiles (and so validates) grammars before submitting.
        self.grammar_compiler = engine.structured_output.compiler if engine.tokenizer is not None else None
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stats = engine.stats()
        self._stopped = threading.Event()
        self._death: BaseException | None = None  # why the loop thread died, if it did
        self.shutdown_hooks: list = []  # called after the loop stopped (multi-process: stop the followers)
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- EngineClient -------------------------------------------------------------------------
    def validate_request(self, request: EngineRequest) -> EngineRequest:
        return self.engine.validate_request(request)  # pure: reads only immutable model facts

    def is_healthy(self) -> bool:
        return self._death is None and (self._thread.is_alive() or self._stopped.is_set())

    async def generate(self, request: EngineRequest):
        if not self.is_healthy():
            raise EngineDeadError(f"the engine loop has died: {self._death!r}")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(_Add(request, sink))
        abort = _Abort(request.request_id)
        async with contextlib.aclosing(queued_outputs(sink.queue, lambda: self._commands.put(abort))) as outputs:
            async for item in outputs:
                yield item

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> dict:
        return dict(self._stats)  # a snapshot the loop refreshes every iteration: cheap, thread-safe

    async def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        # a dead engine's loop may be stuck in a collective with a lost process: do not wait long
        await asyncio.to_thread(self._thread.join, 30 if self._death is None else 2)
        for hook in self.shutdown_hooks:
            hook()

    def mark_dead(self, err: BaseException) -> None:
        """From any thread: the engine can no longer serve (e.g. a multi-host follower was lost).
        /health turns 503, new requests are refused, in-flight ones end with EngineDeadError."""
        if self._death is None:
            self._death = err
        self._stopped.set()
        self._commands.put(None)
        for sink in list(self._sinks.values()):
            sink.put(EngineDeadError(f"the engine is dead: {err}"))

    # ---- the loop -----------------------------------------------------------------------------
    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            rid = cmd.request.request_id
            if rid in self._sinks:
                cmd.sink.put(ValueError(f"request id {rid!r} is already in use"))
                return
            try:
                self.engine.add_request(cmd.request)
            except (ValueError, EngineBusy) as err:
                cmd.sink.put(err)
                return
            except Exception as err:
                log.exception("request %s: refused by an unexpected error", rid)
                cmd.sink.put(err)
                return
            self._sinks[rid] = cmd.sink
        elif isinstance(cmd, _Abort):
            out = self.engine.abort(cmd.request_id)
            sink = self._sinks.pop(cmd.request_id, None)
            if out is not None and sink is not None:
                sink.put(out)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:
            self._death = err
            log.critical("the engine loop died; failing %d requests", len(self._sinks), exc_info=err)
            for sink in self._sinks.values():
                sink.put(EngineDeadError(f"the engine loop died: {type(err).__name__}"))
            self._sinks.clear()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            block = not self.engine.has_unfinished()
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                while cmd is not None:
                    self._handle(cmd)
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                pass
            if self._stopped.is_set():
                break
            if self.engine.has_unfinished():
                outputs = self.engine.step()  # a failed step comes back as error outputs; raising is fatal
                deliveries = []
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        deliveries.append((sink, out))
                        if out.finished:
                            del self._sinks[out.request_id]
                _deliver(deliveries)
            self._stats = self.engine.stats()
        for rid in list(self._sinks):
            self.engine.abort(rid)
