"""Pieces shared by the ragged paged attention reference and its Pallas kernels.

Input checks, the finite mask value, and the *work list* the kernels iterate over: the ragged
batch cut into query blocks of `block_q` tokens, each block inside one sequence, padded
sequences contributing no blocks.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import KVPages

# Finite "minus infinity": exp(MASK_VALUE - m) underflows to 0 and never yields inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_inputs(q, kv: KVPages, kv_lens, block_tables, cu_q_lens, num_seqs) -> None:
    """Raises ValueError unless the shapes follow docs/interfaces.md."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got {q.shape}")
    _, num_q_heads, head_dim = q.shape
    if kv.k.shape != kv.v.shape or kv.k.ndim != 4:
        raise ValueError(f"k/v pages must both be [P, Hkv, ps, D], got {kv.k.shape}, {kv.v.shape}")
    if kv.head_dim != head_dim:
        raise ValueError(f"q head dim {head_dim} != page head dim {kv.head_dim}")
    if num_q_heads % kv.num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={kv.num_kv_heads}")
    if kv.quantized and (kv.k_scale.shape != kv.k.shape[:2] or kv.v_scale.shape != kv.k.shape[:2]):
        raise ValueError(f"FP8 scales must be [P, Hkv] = {kv.k.shape[:2]}")
    num_seqs_padded = kv_lens.shape[0]
    if kv_lens.ndim != 1 or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs_padded:
        raise ValueError(f"kv_lens [S] and block_tables [S, MB] disagree: {kv_lens.shape}, {block_tables.shape}")
    if cu_q_lens.shape != (num_seqs_padded + 1,):
        raise ValueError(f"cu_q_lens must be [S+1] = [{num_seqs_padded + 1}], got {cu_q_lens.shape}")
    if jnp.size(num_seqs) != 1:
        raise ValueError(f"num_seqs must have shape [] or [1], got {jnp.shape(num_seqs)}")


def true_num_seqs(num_seqs) -> jax.Array:
    return jnp.reshape(jnp.asarray(num_seqs, jnp.int32), ())


def query_lengths(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """[S] int32 query lengths; zero for padded sequences (index >= num_seqs)."""
    lengths = cu_q_lens[1:] - cu_q_lens[:-1]
    return jnp.where(jnp.arange(lengths.shape[0]) < num_seqs, lengths, 0).astype(jnp.int32)


def build_work_list(cu_q_lens: jax.Array, num_seqs: jax.Array, block_q: int, num_work: int):
    """Cuts the ragged batch into query blocks.

    Returns (work_seq [num_work], work_q_start [num_work], num_valid_work [1]), all int32:
    work item w < num_valid_work covers flat tokens
    `work_q_start[w] : min(work_q_start[w] + block_q, cu_q_lens[work_seq[w] + 1])`.
    `num_work >= cdiv(T, block_q) + S` always suffices.
    """
    q_lens = query_lengths(cu_q_lens, num_seqs)
    blocks_per_seq = (q_lens + block_q - 1) // block_q  # [S]
    blocks_end = jnp.cumsum(blocks_per_seq)  # [S]
    work = jnp.arange(num_work, dtype=jnp.int32)
    seq = jnp.searchsorted(blocks_end, work, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, q_lens.shape[0] - 1)
    block_in_seq = work - (blocks_end[seq] - blocks_per_seq[seq])
    q_start = cu_q_lens[seq] + block_in_seq * block_q
    num_valid = blocks_end[-1:].astype(jnp.int32)
    return seq, q_start.astype(jnp.int32), num_valid


class WorkItem(typing.NamedTuple):
    """A work item's query block as a kernel sees it (scalars read from the prefetched refs)."""

    seq: jax.Array  # the sequence it belongs to
    q_start: jax.Array  # flat index of its first query token
    q_len: jax.Array  # the sequence's query length this step
    kv_len: jax.Array  # the sequence's context length including this step's tokens
    first_row: jax.Array  # index of its first query within the sequence's queries
    first_pos: jax.Array  # position of its first query
    last_pos: jax.Array  # position of its last real query


def work_item(work, work_seq_ref, work_start_ref, cu_q_lens_ref, kv_lens_ref, block_q: int) -> WorkItem:
    """Inside a Pallas kernel: work item `work` of `build_work_list`'s list, located in its sequence."""
    seq = work_seq_ref[work]
    q_start = work_start_ref[work]
    seq_start = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - seq_start
    kv_len = kv_lens_ref[seq]
    first_row = q_start - seq_start
    first_pos = kv_len - q_len + first_row
    last_pos = kv_len - q_len + jnp.minimum(first_row + block_q, q_len) - 1
    return WorkItem(seq, q_start, q_len, kv_len, first_row, first_pos, last_pos)
