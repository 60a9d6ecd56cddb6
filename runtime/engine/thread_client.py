"""AsyncEngine: the engine loop on its own thread, behind the server's `EngineClient` protocol.

The loop thread runs `runtime.engine.loop.EngineLoop` over the `LLMEngine` (all mutable serving
state). The asyncio side only queues commands (add / abort) and receives each request's
`RequestDelta`s through its asyncio queue, fed with `call_soon_threadsafe` once per step.
`jaxserve serve` runs the same loop in a child process by default (runtime/engine/process_client.py);
this thread serves multi-host and P/D roles and `server.engine_process: false`
(runtime/engine/client_factory.py picks).
"""

from __future__ import annotations

import asyncio
import threading

from runtime.engine.loop import EngineLoop, deliver_to_event_loops
from runtime.types import EngineDeadError, EngineRequest


class AsyncEngine:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.cfg.vocab_size
        self.tokenizer = engine.tokenizer
        # The server compiles (and so validates) grammars on it first: the engine's add is a cache hit.
        self.grammar_compiler = engine.structured_output.compiler if engine.tokenizer is not None else None
        self._loop = EngineLoop(engine, self._deliver, compiler=self.grammar_compiler)
        self._stats = engine.stats()
        self._stopped = threading.Event()
        self._death: BaseException | None = None  # set by mark_dead (e.g. a lost multi-host follower)
        self.shutdown_hooks: list = []  # called after the loop stopped (multi-process: stop the followers)
        self._thread = threading.Thread(target=self._loop.run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def _deliver(self, deliveries) -> None:
        deliver_to_event_loops(deliveries)
        self._stats = self.engine.stats()

    # ---- EngineClient -------------------------------------------------------------------------
    def validate_request(self, request: EngineRequest) -> EngineRequest:
        return self.engine.validate_request(request)  # pure: reads only immutable model facts

    def is_healthy(self) -> bool:
        death = self._death or self._loop.death
        return death is None and (self._thread.is_alive() or self._stopped.is_set())

    async def generate(self, request: EngineRequest):
        if not self.is_healthy():
            raise EngineDeadError(f"the engine loop has died: {(self._death or self._loop.death)!r}")
        async for delta in self._loop.stream(request):
            yield delta

    async def abort(self, request_id: str) -> None:
        self._loop.abort(request_id)

    def stats(self) -> dict:
        return dict(self._stats)  # a snapshot the loop refreshes every iteration: cheap, thread-safe

    async def shutdown(self) -> None:
        self._stopped.set()
        self._loop.stop()
        # a dead engine's loop may be stuck in a collective with a lost process: do not wait long
        dead = self._death is not None or self._loop.death is not None
        await asyncio.to_thread(self._thread.join, 2 if dead else 30)
        for hook in self.shutdown_hooks:
            hook()

    def mark_dead(self, err: BaseException) -> None:
        """From any thread: the engine can no longer serve (e.g. a multi-host follower was lost).
        /health turns 503, new requests are refused, in-flight ones end with EngineDeadError."""
        if self._death is None:
            self._death = err
        self._stopped.set()
        self._loop.stop()
        dead = EngineDeadError(f"the engine is dead: {err}")
        deliver_to_event_loops([(sink, dead) for sink in self._loop.open_sinks()])
