"""The host side of the device-resident request table (vLLM Model Runner V2's persistent batch).

Every running request owns one row of a table that lives on the device (`runtime.table_prepare`:
block-table row, tokens already computed, last token, state slot). A row is assigned when the
request is first scheduled (or scheduled again after a preemption) and freed when it finishes
or is preempted. Each step the host sends only what changed — a `TableStep` of fixed shapes per
token bucket — and the device gathers the step's `ForwardBatch` from the table itself
(`StepExecutables.run_prepare`):

    rows [S]          table row of each batch sequence; padding -> the null row (R)
    num_new [S]       tokens the sequence feeds this step (0 for padding)
    host_tokens [T]   the token ids the host knows (prompt, recompute, resolved outputs); -1 where
                      the row's `last_token` (the previous step's sample, still on the device) goes
    write             a `TableWrite`: rows (re)placed this step (row, tokens computed so far,
                      state slot; their block-table row is cleared) and block-table writes
                      (row, column, page) padded to W with row R + 1 (dropped)

with S = max_num_seqs, R = max_num_seqs (the table has R + 1 rows, the last one the null row
of padding sequences), T the token bucket and W = `page_write_width(T)`. A step whose page
writes exceed W (placements with a long prefix hit) sends the overflow ahead of it in
`TableWrite` chunks of the largest bucket's W (`StepExecutables.run_write_table`, one
executable), the first carrying the resets.

`RequestTableHost` mirrors what the device holds (per row: the request's allocation, tokens
computed, pages written, state slot) so that it can tell what changed; when its mirror and the
scheduler disagree about a row (a preempted request readmitted, a new allocation) the row is
reset, which also keeps a failed step from leaving a wrong row behind. Plain numpy, no JAX.

    table = RequestTableHost(max_num_seqs=16, page_size=16, max_num_tokens=512)
    step, writes = table.plan(scheduler_output, token_bucket)   # TableStep, [TableWrite] (overflow)
    table.sweep()                                       # free the rows of ended requests
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.request import PLACEHOLDER_TOKEN
from runtime.scheduler import SchedulerOutput


@dataclass
class TableWrite:
    """Row placements and block-table writes (numpy; fixed shapes [S] and [W])."""

    reset_rows: np.ndarray  # [S] i32: rows (re)placed, R + 1 for none (dropped)
    reset_start: np.ndarray  # [S] i32: their tokens already computed (prefix hit, P/D load)
    reset_slot: np.ndarray  # [S] i32: their state slot
    page_rows: np.ndarray  # [W] i32, R + 1 for padding (dropped)
    page_cols: np.ndarray  # [W] i32
    pages: np.ndarray  # [W] i32


@dataclass
class TableStep:
    """One step's update of the device table and what the device gathers the batch from."""

    rows: np.ndarray  # [S] i32, NULL row (R) for padding sequences
    num_new: np.ndarray  # [S] i32
    host_tokens: np.ndarray  # [T] i32, -1: the row's last_token
    write: TableWrite


@dataclass
class _Row:
    request: object  # the Request
    allocation: object  # its SequenceAllocation when placed: a new one means a new placement
    num_computed: int
    num_pages: int
    state_slot: int


def page_write_width(num_tokens: int, max_num_seqs: int, page_size: int) -> int:
    """W of token bucket T: enough for every sequence's new pages in a step without placements
    (T // page_size + one boundary page per sequence) plus one more page per sequence."""
    return num_tokens // page_size + 2 * max_num_seqs


class RequestTableHost:
    def __init__(self, max_num_seqs: int, page_size: int, max_num_tokens: int):
        """max_num_tokens: the largest token bucket (its W is the width of overflow writes)."""
        self.num_rows, self.page_size = max_num_seqs, page_size
        self.overflow_width = page_write_width(max_num_tokens, max_num_seqs, page_size)
        self.null_row = max_num_seqs
        self._rows: list[_Row | None] = [None] * max_num_seqs
        self._row_of: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def num_used(self) -> int:
        return len(self._row_of)

    def sweep(self) -> None:
        """Free the rows whose request no longer holds the allocation it was placed with
        (finished, aborted, failed or preempted)."""
        for request_id, row in list(self._row_of.items()):
            entry = self._rows[row]
            if entry.request.allocation is not entry.allocation:
                self._release(request_id, row)

    def _release(self, request_id: str, row: int) -> None:
        del self._row_of[request_id]
        self._rows[row] = None
        self._free.append(row)

    def plan(self, out: SchedulerOutput, num_tokens: int) -> tuple[TableStep, list[TableWrite]]:
        """`out` as a table update in token bucket `num_tokens` -> (step, writes to apply before
        it: empty unless its page writes overflow W; then the first one carries the resets)."""
        self.sweep()
        S, T, drop = self.num_rows, num_tokens, self.null_row + 1
        rows = np.full(S, self.null_row, np.int32)
        num_new = np.zeros(S, np.int32)
        resets = np.zeros((3, S), np.int32)
        resets[0] = drop
        tokens: list[int] = []
        writes: list[tuple[int, int, int]] = []
        for i, seq in enumerate(out.sequences):
            row, entry, placed = self._place(seq)
            if placed:
                resets[:, i] = row, seq.start_position, seq.state_slot
            table = seq.block_table
            writes.extend((row, col, table[col]) for col in range(entry.num_pages, len(table)))
            entry.num_pages = len(table)
            entry.num_computed += seq.num_new_tokens
            rows[i], num_new[i] = row, seq.num_new_tokens
            ids = seq.token_ids
            if PLACEHOLDER_TOKEN in ids[:-1]:
                raise RuntimeError(f"request {seq.request_id!r}: only its last token may wait on the device")
            tokens.extend(ids)
        host_tokens = np.zeros(T, np.int32)
        host_tokens[: len(tokens)] = tokens
        width = page_write_width(T, S, self.page_size)
        overflow = max(len(writes) - width, 0)
        extra = [self._write(resets if start == 0 else None, writes[start : min(start + self.overflow_width, overflow)],
                             self.overflow_width) for start in range(0, overflow, self.overflow_width)]
        step_write = self._write(None if extra else resets, writes[overflow:], width)
        return TableStep(rows, num_new, host_tokens, step_write), extra

    def _write(self, resets: np.ndarray | None, writes: list[tuple[int, int, int]], width: int) -> TableWrite:
        drop = self.null_row + 1
        if resets is None:
            resets = np.zeros((3, self.num_rows), np.int32)
            resets[0] = drop
        pages = np.zeros((3, width), np.int32)
        pages[0] = drop
        if writes:
            pages[:, : len(writes)] = np.asarray(writes, np.int32).T
        return TableWrite(*resets, *pages)

    def _place(self, seq) -> tuple[int, _Row, bool]:
        """(row, mirror, whether the row is (re)placed this step) of a scheduled sequence."""
        request = seq.request
        row = self._row_of.get(seq.request_id)
        entry = None if row is None else self._rows[row]
        if (entry is not None and entry.allocation is request.allocation
                and entry.num_computed == seq.start_position and entry.state_slot == seq.state_slot):
            return row, entry, False
        if row is None:
            if not self._free:
                raise RuntimeError(f"request table full ({self.num_rows} rows) placing {seq.request_id!r}")
            row = self._free.pop()
            self._row_of[seq.request_id] = row
        entry = _Row(request, request.allocation, seq.start_position, 0, seq.state_slot)
        self._rows[row] = entry
        return row, entry, True
