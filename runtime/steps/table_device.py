"""The device side of the request table: the table itself and the step's prepare-inputs function.

    table = init_table(max_num_seqs, max_blocks_per_seq)            # RequestTable, rows R + 1
    table, batch = prepare(table, step, prev_tokens, page_size=16)  # step: runtime.steps.table_host.TableStep
    row_sampling(table, num_rows)   # the last prepared step's rows' sampling parameters, for the sampler

`prepare` is vLLM Model Runner V2's prepare-inputs kernel as one small XLA program: it writes
the previous step's sampled tokens (`prev_tokens [max_num_seqs]`, by that step's batch position)
into the `last_token` of the rows that step ran (`step_rows`, kept in the table), applies the
step's write (row resets, then block-table writes), gathers the step's `ForwardBatch`
from the table, and advances `num_computed` of every row in the step. The result equals
`runtime.steps.inputs.build_batch` of the same `SchedulerOutput` (tests/test_request_table.py).

A row's `last_token` is read only where the host sends -1 (a placeholder): the token sampled by
the step just before, which this same call has just written. A stale write into a freed or
reused row is harmless: a (re)placed row feeds host tokens until its own next sample.

Window-aware paging adds `window_block_tables` (the sliding-window layers' pages, same columns):
a page write to column MB + c writes its column c (MB = max_blocks_per_seq), and the batch gets
`window_block_tables` and `window_slot_mapping` from it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from models.batch import ForwardBatch
from runtime.steps.table_host import NEUTRAL_ROW_PARAMS, NUM_ROW_FLOATS, ROW_PARAMS, TableStep, split_write

jax.tree_util.register_dataclass(TableStep, data_fields=["meta", "host_tokens"], meta_fields=[])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RequestTable:
    """Rows 0..R-1 belong to running requests, row R is the null row of padding sequences."""

    block_tables: jax.Array  # [R+1, MB] i32, 0 = null page
    num_computed: jax.Array  # [R+1] i32, tokens in the KV cache / state
    last_token: jax.Array  # [R+1] i32, the row's newest sampled token
    state_slot: jax.Array  # [R+1] i32, 0 = null slot
    step_rows: jax.Array  # [S] i32, the rows of the last prepared step (by batch position)
    row_params: jax.Array  # [R+1, P] i32, sampling parameters as bits (runtime.steps.table_host.ROW_PARAMS)
    window_block_tables: jax.Array | None = None  # [R+1, MB] i32: window-aware paging's second table


def init_table(max_num_seqs: int, max_blocks_per_seq: int, sharding=None, window: bool = False) -> RequestTable:
    rows = max_num_seqs + 1
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    table = RequestTable(
        zeros(rows, max_blocks_per_seq),
        zeros(rows),
        zeros(rows),
        zeros(rows),
        jnp.full((max_num_seqs,), max_num_seqs, jnp.int32),
        jnp.tile(jnp.asarray(NEUTRAL_ROW_PARAMS), (rows, 1)),
        zeros(rows, max_blocks_per_seq) if window else None,
    )
    return table if sharding is None else jax.device_put(table, sharding)


def apply_write(table: RequestTable, write: jax.Array) -> RequestTable:
    """write [(3 + P)S + 3W] (`runtime.steps.table_host.split_write`): row resets (tokens computed,
    state slot, sampling parameters, a cleared block-table row), then page writes."""
    r, start, slot, params, page_rows, page_cols, pages = split_write(write, table.step_rows.shape[0])
    block_tables = table.block_tables.at[r].set(0, mode="drop")
    block_tables = block_tables.at[page_rows, page_cols].set(pages, mode="drop")  # columns >= MB: dropped
    window = table.window_block_tables
    if window is not None:
        MB = block_tables.shape[1]
        window_cols = jnp.where(page_cols >= MB, page_cols - MB, MB)  # the full table's columns -> dropped
        window = window.at[r].set(0, mode="drop").at[page_rows, window_cols].set(pages, mode="drop")
    return dataclasses.replace(
        table,
        block_tables=block_tables,
        window_block_tables=window,
        num_computed=table.num_computed.at[r].set(start, mode="drop"),
        state_slot=table.state_slot.at[r].set(slot, mode="drop"),
        row_params=table.row_params.at[r].set(params.T, mode="drop"),
    )


def row_sampling(table: RequestTable, num_rows: int) -> dict[str, jax.Array]:
    """The sampling parameters of the last prepared step's first `num_rows` batch positions
    (padding: the null row's neutral ones), as `SamplingMetadata`'s per-row fields [num_rows]."""
    bits = table.row_params[table.step_rows[:num_rows]]  # [num_rows, P]
    floats = lax.bitcast_convert_type(bits[:, :NUM_ROW_FLOATS], jnp.float32)
    fields = {name: floats[:, i] for i, name in enumerate(ROW_PARAMS[:NUM_ROW_FLOATS])}
    return {**fields, "top_k": bits[:, NUM_ROW_FLOATS], "seeds": lax.bitcast_convert_type(bits[:, -1], jnp.uint32)}


def prepare(
    table: RequestTable, step: TableStep, prev_tokens: jax.Array, *, page_size: int
) -> tuple[RequestTable, ForwardBatch]:
    """-> (the table after the step, the step's ForwardBatch). prev_tokens [max_num_seqs] i32."""
    S, T = table.step_rows.shape[0], step.host_tokens.shape[0]
    last_token = table.last_token.at[table.step_rows].set(prev_tokens)  # padding -> the null row
    table = apply_write(dataclasses.replace(table, last_token=last_token), step.meta[2 * S :])
    rows, num_new = step.meta[:S], step.meta[S : 2 * S]  # [S]
    live = num_new > 0
    start = table.num_computed[rows]  # [S]
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_new, dtype=jnp.int32)])  # [S+1]
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), S - 1).astype(jnp.int32)  # [T]
    valid = t < cu_q_lens[-1]
    positions = jnp.where(valid, start[seq] + t - cu_q_lens[seq], 0)
    block_tables = table.block_tables[rows]  # [S, MB]
    page = block_tables[seq, positions // page_size]
    ids = jnp.where(step.host_tokens >= 0, step.host_tokens, table.last_token[rows[seq]])
    window_tables = window_slots = None
    if table.window_block_tables is not None:
        window_tables = table.window_block_tables[rows]  # [S, MB]
        window_page = window_tables[seq, positions // page_size]
        window_slots = jnp.where(valid, window_page * page_size + positions % page_size, -1)
    batch = ForwardBatch(
        input_ids=jnp.where(valid, ids, 0),
        positions=positions,
        slot_mapping=jnp.where(valid, page * page_size + positions % page_size, -1),
        cu_q_lens=cu_q_lens,
        kv_lens=jnp.where(live, start + num_new, 0),
        block_tables=block_tables,
        state_slot_ids=table.state_slot[rows],
        has_initial_state=live & (start > 0),
        num_seqs=jnp.sum(live, dtype=jnp.int32),
        logits_indices=jnp.where(live, cu_q_lens[1:] - 1, 0),
        window_block_tables=window_tables,
        window_slot_mapping=window_slots,
    )
    table = dataclasses.replace(table, num_computed=table.num_computed.at[rows].add(num_new), step_rows=rows)
    return table, batch
