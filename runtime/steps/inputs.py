"""SchedulerOutput -> the flat, padded host arrays of one step (a `ForwardBatch`).

The host batch builder: attention data parallelism builds each rank's slice with it
(runtime/parallel/data_parallel.py), and it is the specification the request table's device `prepare`
is tested against (tests/test_request_table.py). The one-rank and tensor-parallel engine
gathers its batch on the device instead (runtime/steps/table_device.py).

Token count is padded to a token bucket; per-sequence metadata always has `max_num_seqs` rows
(tpu-inference's layout: the backbone compiles once per token bucket, and the true number of
sequences travels as data). Padding tokens write nowhere (slot -1); padding sequences are empty
and point at the null page and null slot.
"""

from __future__ import annotations

import numpy as np

from models.batch import ForwardBatch
from runtime.buckets import bucket_for
from runtime.scheduled import SchedulerOutput


def build_batch(
    out: SchedulerOutput, *, token_buckets: tuple[int, ...], max_num_seqs: int, max_blocks_per_seq: int, page_size: int
) -> ForwardBatch:
    seqs = out.sequences
    num_tokens = sum(s.num_new_tokens for s in seqs)
    T = bucket_for(max(num_tokens, len(seqs)), token_buckets)
    S = max_num_seqs
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    cu_q_lens = np.zeros(S + 1, np.int32)
    kv_lens = np.zeros(S, np.int32)
    block_tables = np.zeros((S, max_blocks_per_seq), np.int32)
    state_slots = np.zeros(S, np.int32)
    has_initial = np.zeros(S, bool)
    logits_indices = np.zeros(S, np.int32)
    window = bool(seqs) and seqs[0].window_block_table is not None  # window-aware paging
    window_tables = np.zeros((S, max_blocks_per_seq), np.int32) if window else None
    window_slots = np.full(T, -1, np.int32) if window else None
    t = 0
    for i, s in enumerate(seqs):
        n = s.num_new_tokens
        pos = np.arange(s.start_position, s.start_position + n, dtype=np.int32)
        table = np.asarray(s.block_table, np.int32)
        input_ids[t : t + n] = s.token_ids
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = table[pos // page_size] * page_size + pos % page_size
        cu_q_lens[i + 1] = t + n
        kv_lens[i] = s.start_position + n
        block_tables[i, : len(table)] = table
        state_slots[i] = s.state_slot
        has_initial[i] = s.has_initial_state
        logits_indices[i] = t + n - 1
        if window:
            window_table = np.asarray(s.window_block_table, np.int32)
            window_tables[i, : len(window_table)] = window_table
            window_slots[t : t + n] = window_table[pos // page_size] * page_size + pos % page_size
        t += n
    cu_q_lens[len(seqs) + 1 :] = t
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        block_tables=block_tables,
        state_slot_ids=state_slots,
        has_initial_state=has_initial,
        num_seqs=np.array(len(seqs), np.int32),
        logits_indices=logits_indices,
        window_block_tables=window_tables,
        window_slot_mapping=window_slots,
    )
