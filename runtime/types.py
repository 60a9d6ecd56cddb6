"""Typed messages that cross the engine boundary (server <-> runtime).

Nothing here imports JAX: the server builds these, the engine consumes them, and the
engine answers with `RequestDelta`s (`accumulate` adds them up into `RequestOutput`s). Every field of `SamplingParams` is validated once, in
`__post_init__`, with an error that names the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineBusy(RuntimeError):
    """A request refused for now, not for what it is (a capacity such as the P/D transfer caps
    is full): the server answers 503, and retrying later can succeed."""


class EngineDeadError(RuntimeError):
    """The engine can serve no more (its loop died, or a step lost the device caches): every open
    request ends with it, `EngineClient.is_healthy()` turns False for good (the server's 503)."""


GrammarKind = Literal["json", "regex", "choice", "lark", "ebnf"]
GRAMMAR_KINDS = ("json", "regex", "choice", "lark", "ebnf")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (structured output, forced tool calls).

    kind "json": `spec` is a JSON schema serialized as JSON text; "regex": a regular expression;
    "choice": a JSON list of the allowed strings; "lark" / "ebnf": grammar text (llguidance's
    Lark dialect, or GBNF / EBNF converted to it). `start_after`: token ids that must appear in
    the output before the grammar applies (the end of a reasoning block, e.g. `</think>`);
    empty means from the first token. `optional_block`: (open, close) tags of one block the
    output may start with before the grammar (a reasoning block the model may or may not
    write, e.g. `("<think>", "</think>")`); its inside is free text.
    """

    kind: GrammarKind
    spec: str
    start_after: tuple[int, ...] = ()
    optional_block: tuple[str, str] | tuple[()] = ()

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured output kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "start_after", tuple(int(t) for t in self.start_after))
        object.__setattr__(self, "optional_block", tuple(self.optional_block))
        if self.optional_block and (len(self.optional_block) != 2 or not all(self.optional_block)):
            raise ValueError(f"optional_block must be (open tag, close tag), got {self.optional_block!r}")

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (start_after does not change it)."""
        return self.kind, self.spec, *self.optional_block


MAX_LOGPROBS = 20  # top alternatives the compiled steps can report per token (generated or prompt)
MAX_LOGIT_BIAS = 300  # entries of logit_bias per request (OpenAI's own limit)
MAX_STOP_TOKEN_IDS = 32  # stop_token_ids per request (bounds the compiled sampler's banned-token width)
LOGIT_BIAS_RANGE = 100.0  # each bias lies in [-100, 100] (OpenAI)


@dataclass(frozen=True)
class SamplingParams:
    """How one completion is sampled and when it stops (vLLM / OpenAI semantics).

    temperature == 0 means greedy. top_k == 0 (or -1) and top_p == 1 disable those filters.
    `n` completions of one prompt are separate engine requests that share a prefix (`fan_out`).
    max_tokens == 0 scores the prompt without generating (with `prompt_logprobs`).
    `logit_bias` maps token id -> bias in [-100, 100], added to the logits before sampling.
    Ranges that depend on the model (token ids vs vocabulary, lengths vs max_model_len) are
    checked by the engine's `runtime.validation.validate_request`.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0 = sampled token only)
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (vLLM); None = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
            "max_tokens",
            f"must be an integer >= 0, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        _check(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty}",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"has {len(self.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed",
        )
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
        )
        _check(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias", "repeats a token id")
        _check(
            all(-LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE for _, b in self.logit_bias),
            "logit_bias",
            f"values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def fan_out(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """The `n` (default `params.n`) single-completion params of one prompt: the i-th samples
    with seed + i, so a seeded request is reproducible completion by completion. The one
    fan-out rule of the server and the offline `LLM`."""
    n = params.n if n is None else n
    return [params.replace(n=1, seed=None if params.seed is None else params.seed + i) for i in range(n)]


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `.param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)


@dataclass
class TokenLogprob:
    """Log-probability of one generated token plus the top alternatives at that position."""

    token_id: int
    logprob: float | None  # None only for an echoed prompt's first token, which nothing predicts
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens are more likely (prompt logprobs only)


@dataclass
class CompletionOutput:
    """One completion, cumulative: `token_ids` and `text` hold everything generated so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The engine's answer for one request; streamed repeatedly while it runs."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine rejected or failed the request
    # With `prompt_logprobs`: one entry per prompt token, the first None (vLLM); set once the
    # whole prompt has been computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    kv_transfer_params: dict | None = None  # P/D: what a prefill instance offers for the decode side

    # The first completion's fields, for the common n == 1 case: outs[i].text etc.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True)
class RequestDelta:
    """What one engine step added to one request: the one output message from the engine to its
    callers (`LLMEngine.step()` / `abort()`, every transport and `server.testing.FakeEngine`).

    Appends only: `new_token_ids`, `new_text` and `new_logprobs` extend what the earlier deltas of
    the same request carried (text that may still begin a stop string is held back until it is
    safe, so nothing is ever retracted). `prompt_logprobs` comes once, on the delta that finishes
    scoring the prompt. The last delta of a request has its `finish_reason` set ("error" with
    `error` when the engine failed it) and, on a P/D prefill instance, `kv_transfer_params`.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None  # None: the request asked for no logprobs
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def accumulate(previous: RequestOutput | None, delta: RequestDelta, prompt_token_ids: list[int]) -> RequestOutput:
    """The cumulative `RequestOutput` after `delta` (`previous`: the one before it, or None for a
    request's first delta). Builds new lists: outputs handed out earlier stay as they were. The
    one place deltas add up, for callers that want the whole text so far (`LLM.generate`, the
    server's chat parsers)."""
    before = previous.outputs[0] if previous is not None else CompletionOutput(0)
    logprobs = before.logprobs
    if delta.new_logprobs is not None:
        logprobs = (logprobs or []) + delta.new_logprobs
    completion = CompletionOutput(
        0,
        before.token_ids + delta.new_token_ids,
        before.text + delta.new_text,
        logprobs,
        delta.finish_reason,
        delta.stop_reason if delta.finished else None,
    )
    return RequestOutput(
        delta.request_id,
        prompt_token_ids,
        [completion],
        finished=delta.finished,
        num_cached_tokens=delta.num_cached_tokens,
        error=delta.error,
        prompt_logprobs=delta.prompt_logprobs
        if delta.prompt_logprobs is not None
        else (previous.prompt_logprobs if previous is not None else None),
        kv_transfer_params=delta.kv_transfer_params,
    )


@dataclass(frozen=True)
class EngineRequest:
    """What the server hands the engine: tokens in, sampling params, nothing JAX."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    kv_transfer_params: dict | None = None  # P/D (runtime/kv_transfer): do_remote_decode / do_remote_prefill
    # Set only by `runtime.validation.validate_request` on the request it returns: the engine
    # admits such a request without checking it again (the server validated it, once).
    validated: bool = False
