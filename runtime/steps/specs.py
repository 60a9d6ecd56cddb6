"""The abstract arguments of the step programs: shapes, dtypes and (under a mesh) the replicated
sharding of every host-side input, so an executable is compiled without a real array."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.batch import ForwardBatch
from runtime.steps.programs import TokenFeed
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_device import RequestTable, init_table
from runtime.steps.table_host import TableStep, page_write_width, write_width


def abstract_spec(x) -> jax.ShapeDtypeStruct:
    """An array's (or a spec's) shape and dtype, no sharding."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def sharded_spec(x) -> jax.ShapeDtypeStruct:
    """An array's (or a spec's) shape, dtype and sharding."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding)


def host_spec(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def batch_spec(T: int, max_num_seqs: int, max_blocks_per_seq: int, sharding=None, window: bool = False) -> ForwardBatch:
    """A host-built ForwardBatch of token bucket T (`window`: with window-aware paging's tables)."""
    S, MB, i32 = max_num_seqs, max_blocks_per_seq, jnp.int32
    spec = functools.partial(host_spec, sharding=sharding)
    return ForwardBatch(
        input_ids=spec((T,), i32),
        positions=spec((T,), i32),
        slot_mapping=spec((T,), i32),
        cu_q_lens=spec((S + 1,), i32),
        kv_lens=spec((S,), i32),
        block_tables=spec((S, MB), i32),
        state_slot_ids=spec((S,), i32),
        has_initial_state=spec((S,), jnp.bool_),
        num_seqs=spec((), i32),
        logits_indices=spec((S,), i32),
        window_block_tables=spec((S, MB), i32) if window else None,
        window_slot_mapping=spec((T,), i32) if window else None,
    )


def feed_spec(T: int, max_num_seqs: int, sharding=None) -> TokenFeed:
    return TokenFeed(
        prev_tokens=host_spec((max_num_seqs,), jnp.int32, sharding), rows=host_spec((T,), jnp.int32, sharding)
    )


def table_spec(max_num_seqs: int, max_blocks_per_seq: int, sharding=None, window: bool = False) -> RequestTable:
    """The request table's specs, no array made (a compile-only client cannot hold one)."""
    shapes = jax.eval_shape(functools.partial(init_table, max_num_seqs, max_blocks_per_seq, window=window))
    return jax.tree.map(lambda s: host_spec(s.shape, s.dtype, sharding), shapes)


def table_write_width(T: int, max_num_seqs: int, page_size: int, tables: int = 1) -> int:
    """A write's entries (runtime/steps/table_host.py) in token bucket T."""
    return write_width(max_num_seqs, page_write_width(T, max_num_seqs, page_size, tables))


def table_step_spec(T: int, max_num_seqs: int, page_size: int, sharding=None, tables: int = 1) -> TableStep:
    meta = 2 * max_num_seqs + table_write_width(T, max_num_seqs, page_size, tables)
    return TableStep(meta=host_spec((meta,), jnp.int32, sharding), host_tokens=host_spec((T,), jnp.int32, sharding))


def meta_spec(S: int, widths=(0, 0, 0, 0), *, row_params: bool, sharding=None) -> SamplingMetadata:
    """SamplingMetadata of sequence bucket S; widths: (output_ids, prompt_ids, banned, logit_bias).
    Without `row_params` the per-row parameters are read from the request table (fields None)."""
    out_width, prompt_width, banned, bias = widths
    f32, i32 = jnp.float32, jnp.int32
    spec = functools.partial(host_spec, sharding=sharding)
    row = lambda dt: spec((S,), dt) if row_params else None
    return SamplingMetadata(
        temperature=row(f32),
        top_k=row(i32),
        top_p=row(f32),
        min_p=row(f32),
        presence_penalty=row(f32),
        frequency_penalty=row(f32),
        repetition_penalty=row(f32),
        seeds=row(jnp.uint32),
        steps=spec((S,), i32),
        output_ids=spec((S, out_width), i32),
        prompt_ids=spec((S, prompt_width), i32),
        banned_ids=spec((S, banned), i32),
        logit_bias_ids=spec((S, bias), i32),
        logit_bias_values=spec((S, bias), f32),
    )
