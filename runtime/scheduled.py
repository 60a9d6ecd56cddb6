"""The data that crosses from scheduling to the compiled steps: one step's plan.

`runtime.scheduling.Scheduler.schedule()` returns a `SchedulerOutput`; the steps
(`runtime.steps`), the engine and the KV-transfer hooks read it. It lives below both so the steps
never import the scheduler. Plain Python, no JAX.

`PLACEHOLDER_TOKEN` stands for an output token sampled on the device and not yet seen by the host
(asynchronous scheduling): the next step feeds it like any token and the device substitutes the
real one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PLACEHOLDER_TOKEN = -1  # an output token sampled on the device, not yet seen by the host


@dataclass
class ScheduledSequence:
    """One row of the step: feed `token_ids` at positions start_position, start_position+1, ..."""

    request: Any  # the scheduler's `runtime.scheduling.request.Request`
    token_ids: list[int]
    start_position: int  # tokens already in the KV cache / state
    block_table: list[int]
    state_slot: int  # 0 (null) on pure-attention models
    has_initial_state: bool  # start_position > 0: continue from the slot (hybrids)
    sample: bool  # this chunk reaches the last known token: sample the next one
    window_block_table: list[int] | None = None  # window-aware paging: the sliding-window layers' pages
    num_draft: int = 0  # speculative decoding: the last num_draft token_ids are drafts, not yet computed

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's plan: its rows, who was preempted, the state-slot copies around the forward pass."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    copy_before: list[tuple[int, int]] = field(default_factory=list)  # (src_slot, dst_slot)
    copy_after: list[tuple[int, int]] = field(default_factory=list)  # (src_slot, dst_slot)
    external_loads: list[Any] = field(default_factory=list)  # P/D: Requests admitted with pulled KV/state to write

    @property
    def num_batched_tokens(self) -> int:
        return sum(seq.num_new_tokens for seq in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
