"""The messages between the server's process and the engine process (runtime/engine/process_client.py).

Typed, picklable dataclasses; nothing else crosses the two pipes.

Parent -> child (the command pipe): `AddRequest`, `AbortRequest`, `CompileGrammar`, `Stop`.
Child -> parent (the output pipe): `Ready` or `StartFailed` once, then one `StepOutputs` per loop
iteration (the engine's `RequestDelta`s as they are, the requests it refused, its stats; an idle
child sends an empty one every half second), `GrammarCompiled` for each `CompileGrammar`, and
`EngineDied` before the child exits when its loop failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.types import EngineBusy, EngineDeadError, EngineRequest, RequestDelta, StructuredOutput

RefusalKind = Literal["invalid", "busy", "dead", "error"]


@dataclass(slots=True)
class AddRequest:
    request: EngineRequest


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class CompileGrammar:
    """Compile (and so validate) a grammar with the engine's compiler: its cache then serves the
    request's add, so a grammar is compiled once, in the engine's process."""

    ticket: int
    grammar: StructuredOutput


@dataclass(slots=True)
class Stop:
    pass


@dataclass(slots=True)
class Ready:
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the engine's own, pickled
    eos_token_ids: tuple[int, ...]
    stats: dict


@dataclass(slots=True)
class StartFailed:
    reason: str


@dataclass(slots=True)
class Refusal:
    """An add the engine refused, or a request its death ended: the parent raises it in `generate`."""

    request_id: str
    kind: RefusalKind
    message: str

    @classmethod
    def of(cls, request_id: str, err: BaseException) -> Refusal:
        if isinstance(err, EngineDeadError):
            kind = "dead"
        elif isinstance(err, EngineBusy):
            kind = "busy"
        elif isinstance(err, ValueError):
            kind = "invalid"
        else:
            kind = "error"
        return cls(request_id, kind, str(err) if kind != "error" else f"{type(err).__name__}: {err}")

    def error(self) -> Exception:
        """The exception the server expects: ValueError -> 400, EngineBusy -> 503, else a 500."""
        kinds = {"invalid": ValueError, "busy": EngineBusy, "dead": EngineDeadError, "error": RuntimeError}
        return kinds[self.kind](self.message)


@dataclass(slots=True)
class StepOutputs:
    deltas: list[RequestDelta] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


@dataclass(slots=True)
class GrammarCompiled:
    ticket: int
    error: str | None  # None: it compiled


@dataclass(slots=True)
class EngineDied:
    reason: str
