"""ForwardBatch: the flat, padded, ragged batch one model step consumes (see docs/interfaces.md).

Gathered on the device from the request table (runtime/steps/table_device.py) on the one-rank and
tensor-parallel paths, built on the host by runtime/steps/inputs.py under attention data parallelism;
every field is an array so one bucket of shapes maps to exactly one compiled executable.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset, -1 for padding
    cu_q_lens: jax.Array  # [S+1] int32
    kv_lens: jax.Array  # [S] int32, context length after this step
    block_tables: jax.Array  # [S, max_blocks] int32, 0 = null page
    state_slot_ids: jax.Array  # [S] int32, 0 = null slot
    has_initial_state: jax.Array  # [S] bool
    num_seqs: jax.Array  # [] int32
    logits_indices: jax.Array  # [R] int32, flat token rows whose logits are wanted
    # window-aware paging (paged_kv/window_pages.py): the sliding-window layers' own block tables
    # and KV slots (their page pool); None: those layers use block_tables / slot_mapping too
    window_block_tables: jax.Array | None = None  # [S, max_blocks] int32, 0 = null page (also: slid past)
    window_slot_mapping: jax.Array | None = None  # [T] int32, -1 for padding
    # speculative verify (runtime/speculative/verify.py): per sequence its last real token's row, then
    # its drafted rows (-1 past them: a sequence without drafts has -1 from column 1). Set, the GDN
    # layers commit no state for drafting sequences and stash their inputs (models/gdn_replay.py)
    spec_rows: jax.Array | None = None  # [S, K+1] int32

    @property
    def num_valid_rows(self) -> jax.Array:
        """[] int32: the real tokens, the first rows of the token axis (the rest pad the bucket).
        The forward pass hands it to the ops that can skip padding rows (the native CPU matmul)."""
        return self.cu_q_lens[self.num_seqs]


def single_sequence_batch(token_ids, page_size: int, first_page: int = 1, pad_to: int | None = None) -> ForwardBatch:
    """One whole sequence in consecutive pages starting at `first_page`, logits for every token.

    With `pad_to`, the token axis is padded (ids 0, no KV write) so nearby lengths share a shape.
    """
    T = len(token_ids)
    Tp = max(pad_to or T, T)
    n_blocks = -(-T // page_size)
    pos = np.arange(Tp, dtype=np.int32)
    pages = np.arange(first_page, first_page + n_blocks, dtype=np.int32)
    slots = np.full(Tp, -1, np.int32)
    slots[:T] = pages[pos[:T] // page_size] * page_size + pos[:T] % page_size
    return ForwardBatch(
        input_ids=np.concatenate([np.asarray(token_ids, np.int32), np.zeros(Tp - T, np.int32)]),
        positions=pos,
        slot_mapping=slots,
        cu_q_lens=np.array([0, T], np.int32),
        kv_lens=np.array([T], np.int32),
        block_tables=pages[None, :],
        state_slot_ids=np.array([1], np.int32),
        has_initial_state=np.array([False]),
        num_seqs=np.array(1, np.int32),
        logits_indices=pos,
    )


def decode_batch(full: ForwardBatch, token: int, pos: int) -> ForwardBatch:
    """The one-token decode step at `pos` of the sequence whose whole-length batch is `full`
    (`single_sequence_batch` over every position): its page table, one KV slot, state carried on."""
    return dataclasses.replace(
        full,
        input_ids=np.array([token], np.int32),
        positions=np.array([pos], np.int32),
        slot_mapping=full.slot_mapping[pos : pos + 1],
        cu_q_lens=np.array([0, 1], np.int32),
        kv_lens=np.array([pos + 1], np.int32),
        has_initial_state=np.array([True]),
        logits_indices=np.array([0], np.int32),
    )


def draft_rows_batch(tokens, positions, valid, block_tables, page_size: int) -> ForwardBatch:
    """One query row per sequence for a drafter's step (MTP, draft model): S sequences at
    `positions` [S] over the target's `block_tables`; `valid` [S] bool (others write nothing, and
    a late draft past the last page writes nothing either). Device arrays (jnp)."""
    S = tokens.shape[0]
    pos = jnp.maximum(positions, 0)
    page = block_tables[jnp.arange(S), jnp.minimum(pos // page_size, block_tables.shape[1] - 1)]
    writes = valid & (pos // page_size < block_tables.shape[1])
    return ForwardBatch(
        input_ids=tokens,
        positions=pos,
        slot_mapping=jnp.where(writes, page * page_size + pos % page_size, -1),
        cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32),
        kv_lens=jnp.where(valid, pos + 1, 1),
        block_tables=block_tables,
        state_slot_ids=jnp.zeros(S, jnp.int32),
        has_initial_state=valid,
        num_seqs=jnp.int32(S),
        logits_indices=jnp.arange(S, dtype=jnp.int32),
    )
