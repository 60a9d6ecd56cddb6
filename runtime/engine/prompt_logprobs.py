"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which rows of a step are scored, and the
per-request record the scoring backbone's TokenScores fill.

A step carrying a request that wants them runs the scoring backbone, which scores every prompt
row against the next prompt token (`targets`). Positions scored before a preemption keep their
first value; a request's record is complete once every prompt position but the first is scored.
Plain host code (numpy)."""

from __future__ import annotations

import numpy as np

from runtime.scheduled import SchedulerOutput
from runtime.scheduling.request import Request
from runtime.types import TokenLogprob


def scored_rows(out: SchedulerOutput):
    """(flat row, request, prompt position it predicts) for every token row of the step whose
    request wants prompt logprobs and whose next token is still in the prompt."""
    row = 0
    for s in out.sequences:
        if s.request.params.prompt_logprobs is not None:
            last = min(s.start_position + s.num_new_tokens, s.request.num_prompt_tokens - 1)
            for position in range(s.start_position, last):
                yield row + position - s.start_position, s.request, position + 1
        row += s.num_new_tokens


def prompt_targets(out: SchedulerOutput, num_rows: int) -> np.ndarray | None:
    """targets [T] i32 for the scoring backbone: at each scored row the prompt token that
    follows it, -1 elsewhere; None when no row is scored."""
    targets = np.full(num_rows, -1, np.int32)
    scored = False
    for row, request, predicted in scored_rows(out):
        targets[row], scored = request.prompt_token_ids[predicted], True
    return targets if scored else None


class PromptLogprobRecords:
    """request id -> its prompt logprobs so far (None where a position is not scored yet)."""

    def __init__(self):
        self._records: dict[str, list[TokenLogprob | None]] = {}

    def add(self, request: Request) -> None:
        self._records[request.request_id] = [None] * request.num_prompt_tokens

    def pop(self, request_id: str) -> None:
        self._records.pop(request_id, None)

    def record(self, out: SchedulerOutput, scores) -> None:
        """Fill each scored request's record from the step's TokenScores."""
        logprobs, ranks, top_ids, top_lp = (
            np.asarray(a) for a in (scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)
        )
        for row, request, predicted in scored_rows(out):
            record = self._records.get(request.request_id)
            if record is not None and record[predicted] is None:
                n = request.params.prompt_logprobs
                record[predicted] = TokenLogprob(
                    request.prompt_token_ids[predicted],
                    float(logprobs[row]),
                    [(int(t), float(v)) for t, v in zip(top_ids[row, :n], top_lp[row, :n])],
                    int(ranks[row]),
                )

    def finished(self, request_id: str) -> list[TokenLogprob | None] | None:
        """The prompt logprobs once every prompt position is scored (the first is always None)."""
        record = self._records.get(request_id)
        if record is None or any(entry is None for entry in record[1:]):
            return None
        return list(record)
