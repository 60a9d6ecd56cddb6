"""Driving an LLMEngine to completion in tests, checking the scheduler's accounting each step."""

import asyncio
import contextlib

from runtime.types import accumulate


class Outputs(dict):
    """request id -> its cumulative RequestOutput so far, added up from an engine's deltas."""

    def step(self, engine) -> list:
        """One `engine.step()`; its deltas are added up here and returned."""
        prompts = {rid: req.prompt_token_ids for rid, req in engine._requests.items()}
        deltas = engine.step()
        for delta in deltas:
            previous = self.get(delta.request_id)
            prompt = prompts.get(delta.request_id, previous.prompt_token_ids if previous else [])
            self[delta.request_id] = accumulate(previous, delta, prompt)
        return deltas

    def finished(self) -> dict:
        return {rid: out for rid, out in self.items() if out.finished}


def drain(engine, check_invariants: bool = True, outputs: Outputs | None = None) -> dict:
    """Step until nothing is left; -> {request_id: final RequestOutput} (`outputs`: what earlier
    steps already added up, for a test that stepped by hand first)."""
    outputs = Outputs() if outputs is None else outputs
    while engine.has_unfinished():
        outputs.step(engine)
        if check_invariants:
            engine.scheduler.check_invariants()
    return outputs.finished()


class FailingStep:
    """Fault injection (tests only): wraps an engine's `StepExecutables` and makes chosen calls
    raise. `fail` names the method ("run_table_backbone", "run_sampler", ...), `times` how many calls
    fail (-1: every call); `after_real_call=True`
    runs the real executable first (its donated caches are consumed) and then raises, the way a
    device failure mid-step would.

        engine.executables = FailingStep(engine.executables, "run_sampler", times=1)
    """

    def __init__(self, executables, fail: str, *, times: int = 1, after_real_call: bool = False):
        self._inner, self._fail, self._left, self._after = executables, fail, times, after_real_call
        self.failures = 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name != self._fail or self._left == 0:
            return attr

        def failing(*args, **kwargs):
            self._left -= 1
            self.failures += 1
            if self._after:
                attr(*args, **kwargs)
            raise RuntimeError(f"injected failure in {name}")

        return failing


def small_engine_config(path, **overrides):
    """A small float32 EngineConfig compiled on first use (64 pages of 16, 4 sequences, 64-token
    steps, 256-token context); `overrides` replace any field."""
    from runtime.engine_config import EngineConfig

    base = dict(
        model=str(path),
        dtype="float32",
        page_size=16,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        aot_compile=False,
    )
    return EngineConfig(**{**base, **overrides})


def spec_engine(path, spec, **overrides):
    """A small float32 engine for speculative decoding tests (pages of 4, 8 sequences, 32-token
    steps: prompts prefill in chunks and the batch preempts; 128-token context), compiled on first
    use; `spec`: its speculative_config; `overrides` replace any field."""
    from runtime.engine.llm_engine import LLMEngine

    base = dict(page_size=4, num_pages=48, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
    base.update(token_buckets=(8, 16, 32), speculative_config=spec)
    return LLMEngine(small_engine_config(path, **{**base, **overrides}))


def launch_config(path, num_pages: int = 120, aot: bool = False):
    """The launch config of test_server_engine's engines (float32, 8 sequences, 64-token steps);
    `aot`: compile the start-up set first (`jaxserve serve`'s default), else what runs."""
    from configs.schema import LaunchConfig

    return LaunchConfig.model_validate(
        {
            "model": {"path": str(path), "dtype": "float32", "max_model_len": 512},
            "cache": {"num_pages": num_pages},
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
            "compile": {"aot": aot},
        }
    )


class RecordingEngine:
    """An `EngineClient` that keeps every request it is given (`requests`), so a test can read
    the prompt the server rendered; everything else is the wrapped client's."""

    def __init__(self, inner):
        self._inner = inner
        self.requests = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, request):
        self.requests.append(request)
        async for output in self._inner.generate(request):
            yield output


@contextlib.contextmanager
def live_engine_server(engine, model_name: str, max_waiting_requests: int, record: bool = False, **server_options):
    """A real engine behind the HTTP server on a free loopback port; closed (server, then engine
    thread) on exit, whatever happened. `server_options`: more ServerConfig fields; `record`:
    the server's engine client is a `RecordingEngine` (`live.engine.requests`)."""
    from configs.schema import ServerConfig
    from runtime.engine.thread_client import AsyncEngine
    from server.testing import LiveServer

    async_engine = AsyncEngine(engine, model_name)
    try:
        live = LiveServer(
            RecordingEngine(async_engine) if record else async_engine,
            ServerConfig(max_waiting_requests=max_waiting_requests, **server_options),
        )
        try:
            yield live
        finally:
            live.close()
    finally:
        asyncio.run(async_engine.shutdown())
