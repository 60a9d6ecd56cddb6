"""The engine's per-request state: tokens, progress through prefill/decode, status, resources.

`all_token_ids` is prompt + outputs; `num_computed_tokens` of them have KV (and GDN state).
After a preemption by recompute everything is freed and `num_computed_tokens` drops to the
prefix-cache hit at readmission, so the tokens to prefill are prompt + outputs so far.
Pages and the state slot live in the cache manager's `SequenceAllocation`, referenced here.
Plain Python, no JAX.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from paged_kv.cache_manager import SequenceAllocation
from paged_kv.state_slots import NULL_SLOT
from runtime.types import EngineRequest, FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_id: int | None = None
    cache_extra_keys: tuple = ()  # mixed into block hashes (e.g. adapter id, cache salt)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    allocation: SequenceAllocation | None = None
    sequence_number: int = -1  # add order, set by the scheduler
    num_external_tokens: int = 0  # P/D: prompt tokens whose KV/state arrive from a prefill instance

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.all_token_ids: list[int] = self.prompt_token_ids + list(self.output_token_ids)

    @classmethod
    def from_engine_request(cls, request: EngineRequest, eos_token_id: int | None = None) -> "Request":
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=request.params,
            priority=request.priority,
            arrival_time=request.arrival_time,
            eos_token_id=eos_token_id,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """1 for a decode; more while (re)prefilling."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int | None:
        """prompt + max_tokens, or None when only max_model_len bounds the request."""
        if self.params.max_tokens is None:
            return None
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def block_table(self) -> list[int]:
        return self.allocation.block_table if self.allocation else []

    @property
    def state_slot(self) -> int:
        return self.allocation.state_slot if self.allocation else NULL_SLOT

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def stop_check(self, max_model_len: int) -> tuple[FinishReason, int | None] | None:
        """(reason, stop token) if the last output token ends the request, else None.

        Covers token-level stops only; stop strings need the detokenizer and are the engine's.
        """
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                return "stop", last
            if not self.params.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id:
                return "stop", last
        if self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens:
            return "length", None
        if self.num_tokens >= max_model_len:
            return "length", None
        return None
