"""The engine loop: commands in, one `step()` at a time, each delta to its request's sink.

    loop = EngineLoop(engine, deliver, compiler=...)
    loop.add(request, sink); loop.abort(request_id); loop.stop()   # from any thread
    loop.run()                                                     # on the loop's own thread

Every transport runs this loop and differs only in its sinks and `deliver`: `AsyncEngine` on a
thread (runtime/engine/thread_client.py), the engine process's child
(runtime/engine/process_client.py) and `server.testing.FakeEngine` (a `FakeCore` on a thread). One
iteration takes the queued commands, steps the engine if it has work and hands the iteration's
deliveries, `(sink, RequestDelta | Exception)` pairs, to `deliver` at once: one wake-up of a
consumer per step, not one per request.

An add whose grammar is still compiling waits off the loop (the compiler's pool) and joins the
engine when it is ready, so running streams go on; a cache hit joins at once. An add the engine
refuses delivers its exception (a ValueError, `EngineBusy`). If `step()` raises (an
`EngineDeadError`: nothing on the device can be trusted) or the loop itself fails, every open
request gets an `EngineDeadError`, `death` is set and `run` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from runtime.types import EngineBusy, EngineDeadError, EngineRequest, RequestDelta

log = logging.getLogger("jaxserve.engine")

IDLE_POLL_S = 0.5  # an idle loop still delivers (an empty batch) this often: transports refresh stats


@dataclass(slots=True)
class _Add:
    request: EngineRequest
    sink: Any


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Compiled:
    request_id: str


Delivery = tuple[Any, RequestDelta | Exception]


class EngineLoop:
    def __init__(
        self,
        engine,
        deliver: Callable[[list[Delivery]], None],
        *,
        compiler=None,
        idle_poll_s: float = IDLE_POLL_S,
    ):
        """`engine`: add_request, abort, step, has_unfinished (an `LLMEngine` or a fake);
        `compiler`: the engine's `GrammarCompiler` (None: grammars are compiled by `add_request`)."""
        self.engine, self.compiler, self.idle_poll_s = engine, compiler, idle_poll_s
        self._deliver = deliver
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Any] = {}  # requests the engine holds
        self._compiling: dict[str, _Add] = {}  # adds waiting for their grammar
        self.death: BaseException | None = None
        self.stopped = False

    # ---- any thread -------------------------------------------------------------------------
    def add(self, request: EngineRequest, sink) -> None:
        self._commands.put(_Add(request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """`request` added from an event loop, its deltas yielded there (via `deliver_to_event_loops`);
        a consumer that stops early aborts it."""
        sink = AsyncSink(asyncio.get_running_loop(), asyncio.Queue())
        rid = request.request_id
        self.add(request, sink)
        async with contextlib.aclosing(queued_deltas(sink.queue, lambda: self.abort(rid))) as deltas:
            async for delta in deltas:
                yield delta

    def stop(self) -> None:
        self._commands.put(None)

    @property
    def num_open(self) -> int:
        return len(self._sinks) + len(self._compiling)

    def open_sinks(self) -> list:
        """A snapshot of the open requests' sinks (for a transport that learns of a death first)."""
        return [*self._sinks.values(), *(add.sink for add in list(self._compiling.values()))]

    # ---- the loop's thread ------------------------------------------------------------------
    def run(self) -> None:
        """Iterate until stopped (unfinished requests are aborted) or dead (they get an error)."""
        try:
            while self.run_once(block=True):
                pass
        except BaseException as err:
            self.fail(err)

    def run_once(self, block: bool) -> bool:
        """Take the queued commands (an idle loop waits up to `idle_poll_s` for one when `block`),
        step once if there is work, deliver. False once stopped."""
        deliveries: list[Delivery] = []
        busy = self.engine.has_unfinished()
        try:
            command = self._commands.get(block=block and not busy, timeout=self.idle_poll_s)
            while True:
                if command is None:
                    self._stop()
                    return False
                self._handle(command, deliveries)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        try:
            if self.engine.has_unfinished():
                for delta in self.engine.step():  # a failed step comes back as error deltas; raising is fatal
                    sink = self._sinks.get(delta.request_id)
                    if sink is not None:
                        deliveries.append((sink, delta))
                        if delta.finished:
                            del self._sinks[delta.request_id]
        finally:  # refusals and aborts of this iteration reach their requests even if the step died
            self._deliver(deliveries)
        return True

    def fail(self, err: BaseException) -> None:
        """The engine is dead: every open request ends with an EngineDeadError."""
        if self.death is None:
            self.death = err
        log.critical("the engine loop died; failing %d requests", self.num_open, exc_info=err)
        dead = EngineDeadError(f"the engine loop died: {type(err).__name__}: {err}")
        sinks = self.open_sinks()
        self._sinks.clear()
        self._compiling.clear()
        try:
            self._deliver([(sink, dead) for sink in sinks])
        except Exception:  # e.g. the pipe to the server is gone too
            log.exception("could not tell %d requests that the engine died", len(sinks))

    def _stop(self) -> None:
        self.stopped = True
        for request_id in list(self._sinks):
            self.engine.abort(request_id)
        self._sinks.clear()
        self._compiling.clear()

    def _handle(self, command, deliveries: list[Delivery]) -> None:
        if isinstance(command, _Add):
            rid = command.request.request_id
            if rid in self._sinks or rid in self._compiling:
                deliveries.append((command.sink, ValueError(f"request id {rid!r} is already in use")))
            elif not self._grammar_pending(command):
                self._admit(command, deliveries)
        elif isinstance(command, _Compiled):
            add = self._compiling.pop(command.request_id, None)
            if add is not None:  # not aborted meanwhile
                self._admit(add, deliveries)
        elif isinstance(command, _Abort):
            rid = command.request_id
            self._compiling.pop(rid, None)
            delta = self.engine.abort(rid)
            sink = self._sinks.pop(rid, None)
            if delta is not None and sink is not None:
                deliveries.append((sink, delta))

    def _grammar_pending(self, add: _Add) -> bool:
        """Start compiling the add's grammar; True when it must wait for it (joins on _Compiled)."""
        grammar = add.request.params.structured_output
        if grammar is None or self.compiler is None:
            return False
        future = self.compiler.submit(grammar)
        if future.done():
            return False
        rid = add.request.request_id
        self._compiling[rid] = add
        future.add_done_callback(lambda _future: self._commands.put(_Compiled(rid)))
        return True

    def _admit(self, add: _Add, deliveries: list[Delivery]) -> None:
        rid = add.request.request_id
        try:
            self.engine.add_request(add.request)
        except (ValueError, EngineBusy) as err:  # e.g. it can never fit, or its grammar is invalid
            deliveries.append((add.sink, err))
            return
        except Exception as err:
            log.exception("request %s: refused by an unexpected error", rid)
            deliveries.append((add.sink, err))
            return
        self._sinks[rid] = add.sink


# ---- the asyncio side: a request's sink is a queue read by the server's event loop -----------
@dataclass(slots=True)
class AsyncSink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def deliver_to_event_loops(deliveries: list[Delivery]) -> None:
    """An iteration's deliveries to their `AsyncSink`s, from any thread: one wake-up of each event
    loop per step, not one per request (each `call_soon_threadsafe` writes the loop's self-pipe;
    16 streams at ~150 steps/s made that a sixth of the engine thread's time on the 2-core bench)."""
    by_loop: dict = {}
    for sink, item in deliveries:
        by_loop.setdefault(sink.loop, []).append((sink.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed: nobody is waiting for these any more
            log.debug("dropped %d deliveries to a closed event loop", len(items))


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


async def queued_deltas(queue: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[RequestDelta]:
    """One request's deltas from its queue, up to the finished one; an Exception in the queue is
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
