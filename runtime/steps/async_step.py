"""One dispatched step whose tokens the host has not consumed yet, and the token feed of the next.

Asynchronous scheduling keeps one step in flight: step n+1 is scheduled, built and dispatched
while step n runs, each of its rows that continues a request of step n feeding a placeholder
(`runtime.scheduled.PLACEHOLDER_TOKEN`) that the device replaces with step n's sampled token,
never a host read: the request table's `prepare` writes step n's token array (`sampled.tokens`)
into the rows step n ran and reads a placeholder row's `last_token` (runtime/steps/table_device.py);
attention DP's host-built batch gathers it through a `runtime.steps.executables.TokenFeed` whose rows
`feed_rows` computes. Only then does the host wait for step n's tokens, resolve the
placeholders and emit.

    step = InFlightStep(out, sampled, scores, placed)   # placed: Scheduler.update_with_placeholders
    rows = step.feed_rows(next_out, T, batch.logits_indices)  # attention DP: [T] i32 for its TokenFeed
    step.resolve()                                       # host copy of the tokens (waits once)

Plain host code: numpy only (the device arrays are held, never computed on, here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.scheduled import PLACEHOLDER_TOKEN, SchedulerOutput

if TYPE_CHECKING:
    from runtime.steps.sampler import SamplerOutput


@dataclass
class InFlightStep:
    out: SchedulerOutput
    sampled: SamplerOutput  # device arrays; tokens [max_num_seqs]
    scores: object | None  # TokenScores of a scoring step (prompt logprobs), else None
    placed: list[tuple[int, Any, int | None]]  # (row, Request, output index of its placeholder)
    tokens: np.ndarray | None = None  # host copy, once resolved
    logprobs: tuple | None = None  # (logprobs [S], top_ids [S, n], top_logprobs [S, n]) host copies
    _rows: dict[str, int] = field(default_factory=dict)
    more_tokens: dict[int, list[int]] = field(default_factory=dict)  # row -> tokens after its first (speculation)
    more_logprobs: dict[int, tuple] = field(default_factory=dict)  # row -> (logprobs, top_ids, top_logprobs) of those

    def token_logprobs(self, row: int, m: int) -> tuple:
        """(logprob, top_ids [n], top_logprobs [n]) of the row's m-th token (0: its sampled one)."""
        source = self.logprobs if m == 0 else self.more_logprobs[row]
        index = row if m == 0 else m - 1
        return tuple(a[index] for a in source)

    def row_tokens(self, row: int) -> list[int]:
        """The tokens the step produced for `row`: its sampled token, then any accepted with it."""
        return [int(self.tokens[row]), *self.more_tokens.get(row, ())]

    def __post_init__(self):
        self._rows = {request.request_id: row for row, request, index in self.placed if index is not None}

    @property
    def resolved(self) -> bool:
        return self.tokens is not None

    def feed_rows(self, out: SchedulerOutput, num_token_rows: int, last_rows: np.ndarray) -> np.ndarray:
        """rows [T] i32 of the next step `out`: for each token row holding a placeholder of this
        step, the row of this step's token array that holds its real token; -1 elsewhere.
        last_rows [>= S]: the token row of each sequence's last token (the batch's
        `logits_indices`, which also hold under attention DP's rank-major layout)."""
        rows = np.full(num_token_rows, -1, np.int32)
        for i, seq in enumerate(out.sequences):
            if seq.token_ids[-1] != PLACEHOLDER_TOKEN:
                continue
            if PLACEHOLDER_TOKEN in seq.token_ids[:-1] or seq.request_id not in self._rows:
                raise RuntimeError(f"request {seq.request_id!r} feeds a placeholder the step in flight does not fill")
            rows[int(last_rows[i])] = self._rows[seq.request_id]
        return rows

    def resolve(self) -> None:
        """Bring the step's tokens (and logprobs) to the host: the one wait on the device."""
        if self.resolved:
            return
        self.tokens = np.asarray(self.sampled.tokens)
        if self.sampled.top_ids.shape[1]:
            self.logprobs = tuple(
                np.asarray(a) for a in (self.sampled.logprobs, self.sampled.top_ids, self.sampled.top_logprobs)
            )


def no_feed_rows(num_token_rows: int) -> np.ndarray:
    """rows [T] of a step that feeds nothing from the device."""
    return np.full(num_token_rows, -1, np.int32)
