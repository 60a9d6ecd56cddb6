"""The host side of the device-resident request table (vLLM Model Runner V2's persistent batch).

Every running request owns one row of a table that lives on the device (`runtime.steps.table_device`:
block-table row, tokens already computed, last token, state slot, sampling parameters). A row is
assigned when the request is first scheduled (or scheduled again after a preemption) and freed
when it finishes or is preempted. Each step the host sends only what changed — a `TableStep` of fixed shapes per
token bucket — and the device gathers the step's `ForwardBatch` from the table itself
(`StepExecutables.run_prepare`):

    meta [2S + write] rows [S]: table row of each batch sequence (padding: the null row R);
                      num_new [S]: tokens it feeds; then the step's write [(3 + P)S + 3W]
                      (`split_write`): rows (re)placed this step — reset_rows, reset_start
                      (tokens computed so far), reset_slot (state slot), [S] each, and
                      reset_params [P, S] (the request's sampling parameters as int32 bits,
                      `ROW_PARAMS`); their block-table row is cleared — and block-table writes
                      page_rows, page_cols, pages [W] each (row R + 1: nothing, dropped)
    host_tokens [T]   the token ids the host knows (prompt, recompute, resolved outputs); -1 where
                      the row's `last_token` (the previous step's sample, still on the device) goes

with S = max_num_seqs, R = max_num_seqs (the table has R + 1 rows, the last one the null row
of padding sequences), T the token bucket, W = `page_write_width(T)` and P = len(ROW_PARAMS).
A step whose page writes exceed W (placements with a long prefix hit) sends the overflow ahead
of it in write chunks of the largest bucket's W (`StepExecutables.run_write_table`, one
executable), the first carrying the resets.

A request's sampling parameters travel once, in the write of its placement, and stay in its row:
the sampler gathers a step's rows from the table (`runtime.steps.table_device.row_sampling`), so a
step sends only what changes per step (`SamplingMetadata` without its per-row scalars: the
token index and, when used, the penalty / ban / bias matrices). A request without a seed gets
one drawn at its placement (the sampler folds in the token index, so every token draws anew).

`RequestTableHost` mirrors what the device holds (per row: the request's allocation, tokens
computed, pages written, state slot) so that it can tell what changed; when its mirror and the
scheduler disagree about a row (a preempted request readmitted, a new allocation) the row is
reset, which also keeps a failed step from leaving a wrong row behind. Plain numpy, no JAX.

Window-aware paging (`window_columns` = max_blocks_per_seq): the window block table's new pages,
and the null page where the request slid past a block, are page writes to column MB + c; the
write width doubles (`page_write_width(..., tables=2)`).

    table = RequestTableHost(max_num_seqs=16, page_size=16, max_num_tokens=512)
    step, writes = table.plan(scheduler_output, token_bucket)   # TableStep, [write chunk] (overflow)
    table.sweep()                                       # free the rows of ended requests
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from runtime.scheduled import PLACEHOLDER_TOKEN, SchedulerOutput
from runtime.types import SamplingParams

# A row's sampling parameters in the table, in this order, as int32 bit patterns: six float32
# fields, then top_k and the seed's uint32 bits (`row_param_bits`).
ROW_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "top_k",
    "seeds",
)
NUM_ROW_FLOATS = 6


@dataclass
class TableStep:
    """One step's update of the device table and what the device gathers the batch from: two
    int32 host arrays, so a step costs two small transfers.

    meta [2S + (3 + P)S + 3W]: rows [S] (padding: the null row R), num_new [S], then the step's
    write (`split_write`); host_tokens [T]: -1 where the row's `last_token` stands."""

    meta: np.ndarray
    host_tokens: np.ndarray


def row_param_bits(params: SamplingParams, seed: int) -> np.ndarray:
    """[P] int32: a request's sampling parameters as its table row holds them, with `seed` (the
    request's own, or one drawn for it) taken modulo 2**32."""
    floats = np.array(
        [
            params.temperature,
            params.top_p,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        ],
        np.float32,
    )
    seed %= 2**32
    ints = np.array([params.top_k, seed], np.uint64).astype(np.uint32)  # top_k >= 0 (SamplingParams)
    return np.concatenate([floats.view(np.int32), ints.view(np.int32)])


# The padding rows' parameters: greedy, every filter and penalty off.
NEUTRAL_ROW_PARAMS = row_param_bits(SamplingParams(temperature=0.0), seed=0)


def write_width(num_seqs: int, page_width: int) -> int:
    """Entries of a write: (3 + P)S row resets + 3W page writes."""
    return (3 + len(ROW_PARAMS)) * num_seqs + 3 * page_width


def split_write(write, num_seqs: int) -> tuple:
    """A write [(3 + P)S + 3W] (numpy or jax) -> (reset_rows [S], reset_start [S], reset_slot [S],
    reset_params [P, S], page_rows [W], page_cols [W], pages [W]). Rows R + 1 mark nothing (dropped)."""
    S, P = num_seqs, len(ROW_PARAMS)
    W = (write.shape[0] - (3 + P) * S) // 3
    sizes = (S, S, S, P * S, W, W, W)
    parts = [write[end - size : end] for size, end in zip(sizes, accumulate(sizes))]
    parts[3] = parts[3].reshape(P, S)
    return tuple(parts)


@dataclass
class _Row:
    request: object  # the Request
    allocation: object  # its SequenceAllocation when placed: a new one means a new placement
    num_computed: int
    num_pages: int
    state_slot: int
    window_low: int = 0  # window paging: columns below this are null on the device


def window_writes(row: int, entry: _Row, table: list[int], num_written: int, offset: int) -> list[tuple[int, int, int]]:
    """A window block table's changes since the device saw `num_written` columns of it: the null
    page where the request slid past a block, its new pages (columns shifted by `offset`)."""
    low = entry.window_low
    while low < len(table) and table[low] == 0:
        low += 1
    nulls = [(row, offset + col, 0) for col in range(entry.window_low, min(low, num_written))]
    entry.window_low = low
    return nulls + [(row, offset + col, table[col]) for col in range(max(num_written, low), len(table))]


def page_write_width(num_tokens: int, max_num_seqs: int, page_size: int, tables: int = 1) -> int:
    """W of token bucket T: enough for every sequence's new pages in a step without placements
    (T // page_size + one boundary page per sequence) plus one more page per sequence, per block
    table (`tables`: 2 with window-aware paging)."""
    return tables * (num_tokens // page_size + 2 * max_num_seqs)


class RequestTableHost:
    def __init__(
        self,
        max_num_seqs: int,
        page_size: int,
        max_num_tokens: int,
        rng: np.random.Generator | None = None,
        window_columns: int | None = None,
    ):
        """max_num_tokens: the largest token bucket (its W is the width of overflow writes).
        rng: draws the seeds of requests that set none (default: OS entropy). window_columns:
        window-aware paging, the column offset of the window block table (max_blocks_per_seq)."""
        self.num_rows, self.page_size = max_num_seqs, page_size
        self._rng = rng if rng is not None else np.random.default_rng()
        self.window_columns = window_columns
        self.tables = 1 if window_columns is None else 2
        self.overflow_width = page_write_width(max_num_tokens, max_num_seqs, page_size, self.tables)
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

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """The device rewound the row's tokens computed (rejected speculative drafts): mirror it."""
        row = self._row_of.get(request_id)
        if row is not None:
            self._rows[row].num_computed -= num_tokens

    def plan(self, out: SchedulerOutput, num_tokens: int) -> tuple[TableStep, list[np.ndarray]]:
        """`out` as a table update in token bucket `num_tokens` -> (step, writes (W' = the
        overflow width) to apply before it: none unless its page writes overflow W; then the
        first carries the resets)."""
        self.sweep()
        S, T = self.num_rows, num_tokens
        width = page_write_width(T, S, self.page_size, self.tables)
        meta = np.zeros(2 * S + write_width(S, width), np.int32)
        rows, num_new, write = meta[:S], meta[S : 2 * S], meta[2 * S :]
        rows[:] = self.null_row
        resets = self._blank(write, width)
        tokens: list[int] = []
        writes: list[tuple[int, int, int]] = []
        for i, seq in enumerate(out.sequences):
            row, entry, placed = self._place(seq)
            if placed:
                resets[:3, i] = row, seq.start_position, seq.state_slot
                params = seq.request.params
                seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
                resets[3:, i] = row_param_bits(params, seed)
            table = seq.block_table
            writes.extend((row, col, table[col]) for col in range(entry.num_pages, len(table)))
            if self.window_columns is not None:
                writes.extend(window_writes(row, entry, seq.window_block_table, entry.num_pages, self.window_columns))
            entry.num_pages = len(table)
            entry.num_computed += seq.num_new_tokens
            rows[i], num_new[i] = row, seq.num_new_tokens
            ids = seq.token_ids
            if PLACEHOLDER_TOKEN in ids[:-1]:
                raise RuntimeError(f"request {seq.request_id!r}: only its last token may wait on the device")
            tokens.extend(ids)
        host_tokens = np.zeros(T, np.int32)
        host_tokens[: len(tokens)] = tokens
        overflow = max(len(writes) - width, 0)
        extra = []
        for start in range(0, overflow, self.overflow_width):
            chunk = np.zeros(write_width(S, self.overflow_width), np.int32)
            chunk_resets = self._blank(chunk, self.overflow_width)
            if start == 0:  # the resets go first: they clear the rows the pages are written to
                chunk_resets[:] = resets
                self._blank(write, width)
            self._fill_pages(chunk, writes[start : min(start + self.overflow_width, overflow)])
            extra.append(chunk)
        self._fill_pages(write, writes[overflow:])
        return TableStep(meta, host_tokens), extra

    def _blank(self, write: np.ndarray, width: int) -> np.ndarray:
        """Mark a write buffer empty (rows R + 1, dropped); -> its resets view [3 + P, S]."""
        S, resets = self.num_rows, (3 + len(ROW_PARAMS)) * self.num_rows
        write[:] = 0
        write[:S] = write[resets : resets + width] = self.null_row + 1
        return write[:resets].reshape(3 + len(ROW_PARAMS), S)

    def _fill_pages(self, write: np.ndarray, writes: list[tuple[int, int, int]]) -> None:
        if writes:
            resets = (3 + len(ROW_PARAMS)) * self.num_rows
            pages = write[resets:].reshape(3, (write.shape[0] - resets) // 3)
            pages[:, : len(writes)] = np.asarray(writes, np.int32).T

    def _place(self, seq) -> tuple[int, _Row, bool]:
        """(row, mirror, whether the row is (re)placed this step) of a scheduled sequence."""
        request = seq.request
        row = self._row_of.get(seq.request_id)
        entry = None if row is None else self._rows[row]
        if (
            entry is not None
            and entry.allocation is request.allocation
            and entry.num_computed == seq.start_position
            and entry.state_slot == seq.state_slot
        ):
            return row, entry, False
        if row is None:
            if not self._free:
                raise RuntimeError(f"request table full ({self.num_rows} rows) placing {seq.request_id!r}")
            row = self._free.pop()
            self._row_of[seq.request_id] = row
        entry = _Row(request, request.allocation, seq.start_position, 0, seq.state_slot)
        self._rows[row] = entry
        return row, entry, True
