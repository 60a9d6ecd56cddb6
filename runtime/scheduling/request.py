"""The engine's per-request state: tokens, progress through prefill/decode, status, resources.

`all_token_ids` is prompt + outputs; `num_computed_tokens` of them have KV (and GDN state).
After a preemption by recompute everything is freed and `num_computed_tokens` drops to the
prefix-cache hit at readmission, so the tokens to prefill are prompt + outputs so far.
Pages and the state slot live in the cache manager's `SequenceAllocation`, referenced here.

Asynchronous scheduling appends a `PLACEHOLDER_TOKEN` for a token still being sampled on the
device (the next step is planned with it and reads the real token on the device); it is
replaced by `resolve_output` as soon as the token reaches the host, always before anything
hashes, emits or penalises it.
Plain Python, no JAX.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from paged_kv.cache_manager import SequenceAllocation
from paged_kv.state_slots import NULL_SLOT
from runtime.scheduled import PLACEHOLDER_TOKEN
from runtime.types import FinishReason, SamplingParams


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
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (generation_config may list several)
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
    draft_token_ids: list[int] = field(default_factory=list)  # speculative decoding: the next step's drafts

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.all_token_ids: list[int] = self.prompt_token_ids + list(self.output_token_ids)

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

    def drop_last_outputs(self, n: int) -> None:
        """Forget the last n output tokens of a finished request (speculation: tokens accepted past
        a stop string)."""
        if n > 0:
            del self.output_token_ids[-n:], self.all_token_ids[-n:]

    def resolve_output(self, index: int, token_id: int) -> None:
        """Replace the placeholder at output position `index` with the sampled token."""
        if self.output_token_ids[index] != PLACEHOLDER_TOKEN:
            raise RuntimeError(f"request {self.request_id!r}: output {index} is not a placeholder")
        self.output_token_ids[index] = token_id
        self.all_token_ids[self.num_prompt_tokens + index] = token_id

    @property
    def resolved_output_token_ids(self) -> list[int]:
        """The output tokens the host knows (without trailing placeholders)."""
        return self.output_token_ids[: self.num_resolved_output_tokens]

    @property
    def num_resolved_output_tokens(self) -> int:
        """How many output tokens the host knows: all but the trailing placeholders (no copy)."""
        ids = self.output_token_ids
        n = len(ids)
        while n and ids[n - 1] == PLACEHOLDER_TOKEN:
            n -= 1
        return n

    @property
    def has_placeholder(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER_TOKEN

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """Tokens that end the request once `min_tokens` are out: stop_token_ids, then EOS."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return self.params.stop_token_ids + eos

    def banned_token_ids(self) -> list[int]:
        """Tokens the next sample must not be: the end tokens, until `min_tokens` are out."""
        return list(self.end_token_ids) if self.num_output_tokens < self.params.min_tokens else []

    def stop_check(self, max_model_len: int) -> tuple[FinishReason, int | None] | None:
        """The finish rule: (reason, stop token) if the request ends here, else None.

        Called after every appended token (and with no output yet, for max_tokens == 0). The
        only other end is a stop *string*, which the detokenizer finds one step later; the
        engine then ends the request through `Scheduler.finish` like this rule does.
        """
        if self.output_token_ids and self.num_output_tokens >= self.params.min_tokens:
            last = self.output_token_ids[-1]
            if last in self.params.stop_token_ids:
                return "stop", last
            if last in self.end_token_ids:
                return "stop", None  # an EOS id: vLLM's stop_reason is null then
        if self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens:
            return "length", None
        if self.num_tokens >= max_model_len:
            return "length", None
        return None
