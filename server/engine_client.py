"""The only door between the HTTP server and an engine: the `EngineClient` protocol.

The server codes against this protocol and nothing else of the runtime, so the real JAX
engine, the in-process `FakeEngine` of `server.testing`, or a remote engine proxy can sit
behind the same routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from runtime.types import EngineRequest, RequestDelta

STATS_KEYS = (
    "pages_total",
    "pages_free",
    "pages_cached",
    "slots_total",
    "slots_free",
    "slots_cached",
    "prefix_cache_hit_rate",
    "num_preemptions",
    "num_running",
    "num_waiting",
)


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine.

    `generate` yields one request's `RequestDelta`s, appends only: the token ids, text and
    logprobs each engine step added (the engine detokenizes and applies stop strings, holding
    back a possible partial stop string; `runtime.types.accumulate` adds them up); its last delta
    has `finished=True`. Every implementation runs `runtime.engine.loop.EngineLoop`. A refused
    request raises from `generate`: a ValueError (the server's 400), `EngineBusy` (503), anything
    else a 500. One EngineRequest is always one completion (n=1):
    the server fans `n > 1` out into several requests. `abort` ends a request early and frees
    its pages and state slot; it is harmless for an unknown or already finished id.

    `validate_request` is the engine's one validation site (`runtime.validation`): it returns
    the request normalised for the model and marked `validated` (the engine does not check it
    again), or raises `SamplingParamsError` (a ValueError whose
    `.param` names the field), which the server answers with a 400. A step that fails ends the
    requests in it with an output whose `error` is set (the server's 500); `is_healthy()` turns
    False for good when the engine can no longer serve (its loop died): /health answers 503 and
    the server drains and exits non-zero.
    """

    model_name: str  # the served model id reported by /v1/models
    max_model_len: int
    vocab_size: int  # rows of the model's embedding: prompt token ids must be below it
    tokenizer: Any  # a transformers PreTrainedTokenizerBase

    def validate_request(self, request: EngineRequest) -> EngineRequest: ...

    def is_healthy(self) -> bool: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...  # the STATS_KEYS above

    async def shutdown(self) -> None: ...
