"""AsyncEngine: the engine loop on its own thread, behind the server's `EngineClient` protocol.

The loop thread owns the `LLMEngine` (all mutable serving state). The asyncio side only
enqueues commands (add / abort) and receives cumulative `RequestOutput`s through per-request
asyncio queues fed with `call_soon_threadsafe`. Messages are plain dataclasses, so the loop can
later move to its own process behind the same interface.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.engine import EngineDeadError, LLMEngine
from runtime.engine_config import EngineConfig
from runtime.kv_transfer import KVTransferConfig
from runtime.mesh import initialize_multihost
from runtime.types import EngineRequest

log = logging.getLogger("jaxserve.engine")


@dataclass
class _Add:
    request: EngineRequest
    sink: "_Sink"


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


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
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request.request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> dict:
        return dict(self._stats)  # a snapshot the loop refreshes every iteration: cheap, thread-safe

    async def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    # ---- the loop -----------------------------------------------------------------------------
    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            rid = cmd.request.request_id
            if rid in self._sinks:
                cmd.sink.put(ValueError(f"request id {rid!r} is already in use"))
                return
            try:
                self.engine.add_request(cmd.request)
            except ValueError as err:
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
        except BaseException as err:  # noqa: BLE001 - the loop is gone: say so, fail everyone
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
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink.put(out)
                        if out.finished:
                            del self._sinks[out.request_id]
            self._stats = self.engine.stats()
        for rid in list(self._sinks):
            self.engine.abort(rid)


def engine_config_from_launch(config, model_path: str) -> EngineConfig:
    """Map the validated YAML launch config onto the engine's config.

    `parallel`: `role` prefill / decode (with the `kv_transfer` section) sets up disaggregation;
    `multihost` starts `jax.distributed` (so call this before any other JAX work); `mesh` becomes
    `mesh_shape` when it spans more than one device."""
    cache, sched, kernels, comp = config.cache, config.scheduler, config.kernels, config.compile
    parallel = config.parallel
    initialize_multihost(parallel)
    mesh = parallel.mesh
    return EngineConfig(
        model=model_path, dtype=config.model.dtype, max_model_len=config.model.max_model_len,
        page_size=cache.page_size, num_pages=cache.num_pages, memory_fraction=cache.memory_fraction or 0.9,
        kv_cache_dtype=cache.kv_cache_dtype, enable_prefix_caching=cache.enable_prefix_caching,
        hybrid_checkpoint_policy=cache.hybrid_checkpoint_policy, hybrid_checkpoint_budget=cache.hybrid_checkpoint_budget,
        max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
        policy=sched.policy, async_scheduling=sched.async_scheduling, token_buckets=tuple(sched.token_buckets) if sched.token_buckets else None,
        attention_backend=kernels.attention_backend, gdn_backend=kernels.gdn_backend,
        layer_loop=kernels.layer_loop, fuse_greedy=kernels.fuse_greedy,
        mesh_shape=(mesh.data, mesh.model) if mesh.num_devices > 1 else None, aot_compile=comp.aot,
        compile_cache_dir=str(Path(comp.cache_dir).expanduser()) if comp.cache_dir else None,
        quantization=config.model.quantization, quantization_group_size=config.model.quantization_group_size,
        quantization_keep_float=(tuple(config.model.quantization_keep_float)
                                 if config.model.quantization_keep_float is not None else None),
        keep_gguf_quantized=config.model.keep_gguf_quantized,
        kv_transfer=KVTransferConfig(role=parallel.role, **config.kv_transfer.model_dump()))


def create_engine_client(config) -> AsyncEngine:
    """The real engine behind `jaxserve serve`: loads the model (the default one when no path is
    given), compiles its buckets, starts the loop thread."""
    path = config.model.path
    if path is None:
        from models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        path, name = str(ensure_default_model()), DEFAULT_MODEL_NAME
    else:
        name = Path(path).name
    t0 = time.perf_counter()
    engine = LLMEngine(engine_config_from_launch(config, str(path)), progress=True)
    log.info("engine ready in %.1fs: %s, %d KV pages of %d tokens, buckets %s", time.perf_counter() - t0, name,
             engine.cache_config.num_pages, engine.config.page_size, list(engine.token_buckets))
    return AsyncEngine(engine, config.model.served_model_name or name)
