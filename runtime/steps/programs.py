"""The step programs: pure functions that `runtime.steps.executables` jits and compiles per bucket.

    backbone(params, caches, batch, feed) -> (caches, hidden [max_num_seqs, H])          caches donated
    greedy_backbone(params, caches, batch, feed) -> (caches, tokens [max_num_seqs])
    table_backbone(params, caches, table, step, prev_tokens, *, greedy) -> (caches, table, hidden | tokens)
    scoring_backbone(params, caches, batch, targets [T]) -> (caches, hidden, TokenScores [T])
    sample_rows(params, hidden, meta, bitmask, table, *, num_rows, ...) -> SamplerOutput
    copy_states(caches, src, dst, n) -> caches                                            caches donated

(`prepare` and `apply_write`, the request table's own programs, live in runtime/steps/table_device.py;
`jit_program` jits any of them by name.)
Nothing here closes over an object: what a program needs beyond its arrays is a keyword argument
that the table binds with `functools.partial` (`forward`: the model's forward pass with its config
and kernel options bound, `(params, caches, batch) -> (hidden, caches)`; attention DP binds its
per-rank vmap of it, runtime/parallel/data_parallel.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from models.batch import ForwardBatch
from models.transformer import compute_logits
from runtime.steps.sampler import sample, score_hidden_rows
from runtime.steps.table_device import apply_write, prepare, row_sampling

__all__ = [
    "Statics",
    "TokenFeed",
    "backbone",
    "copy_states",
    "feed_tokens",
    "greedy_backbone",
    "jit_program",
    "pad_tokens",
    "sample_rows",
    "scoring_backbone",
    "table_backbone",
]


@dataclasses.dataclass(frozen=True)
class TokenFeed:
    """prev_tokens [max_num_seqs] i32 (device: the previous step's sampled tokens), rows [T] i32:
    the prev_tokens row each token row takes, -1 where the host's input id stands."""

    prev_tokens: jax.Array
    rows: jax.Array


jax.tree_util.register_dataclass(TokenFeed, data_fields=["prev_tokens", "rows"], meta_fields=[])


def feed_tokens(batch: ForwardBatch, feed: TokenFeed | None) -> ForwardBatch:
    """The batch with every fed row's input id taken from the previous step's tokens (a gather)."""
    if feed is None:
        return batch
    fed = jnp.where(feed.rows >= 0, feed.prev_tokens[jnp.maximum(feed.rows, 0)], batch.input_ids)
    return dataclasses.replace(batch, input_ids=fed)


def pad_tokens(tokens: jax.Array, rows: int) -> jax.Array:
    """tokens [n] -> [rows]: cut or zero-padded (rows past the live sequences are padding anyway)."""
    n = tokens.shape[0]
    return tokens[:rows] if n >= rows else jnp.pad(tokens, (0, rows - n))


def backbone(params, caches, batch: ForwardBatch, feed: TokenFeed | None = None, *, forward):
    hidden, caches = forward(params, caches, feed_tokens(batch, feed))
    return caches, hidden


def greedy_backbone(
    params, caches, batch: ForwardBatch, feed: TokenFeed | None = None, *, forward, max_num_seqs: int, softcap=None
):
    """The backbone with the argmax of the first min(T, max_num_seqs) rows' logits fused in."""
    caches, hidden = backbone(params, caches, batch, feed, forward=forward)
    rows = min(batch.input_ids.shape[0], max_num_seqs)
    tokens = jnp.argmax(compute_logits(params, hidden[:rows], softcap), axis=-1).astype(jnp.int32)
    return caches, pad_tokens(tokens, max_num_seqs)


def table_backbone(
    params, caches, table, step, prev_tokens, *, greedy: bool, forward, max_num_seqs: int, page_size: int, softcap=None
):
    """prepare fused into the (greedy) backbone: one dispatch a step instead of two."""
    table, batch = prepare(table, step, prev_tokens, page_size=page_size)
    if greedy:
        caches, out = greedy_backbone(
            params, caches, batch, forward=forward, max_num_seqs=max_num_seqs, softcap=softcap
        )
    else:
        caches, out = backbone(params, caches, batch, forward=forward)
    return caches, table, out


def scoring_backbone(params, caches, batch: ForwardBatch, targets, *, forward, softcap=None):
    """The backbone that also keeps every token row's hidden state and scores its target."""
    S, T = batch.logits_indices.shape[0], batch.input_ids.shape[0]
    rows = jnp.concatenate([batch.logits_indices, jnp.arange(T, dtype=jnp.int32)])  # [S + T]
    hidden, caches = forward(params, caches, dataclasses.replace(batch, logits_indices=rows))
    return caches, hidden[:S], score_hidden_rows(params, hidden[S:], targets, softcap=softcap)


def sample_rows(
    params,
    hidden,
    meta,
    bitmask,
    table,
    *,
    num_rows,
    num_logprobs,
    all_greedy,
    max_top_k: int,
    max_num_seqs: int,
    softcap=None,
):
    """The sampler over the first `num_rows` hidden rows; tokens padded to max_num_seqs (one feed shape)."""
    if not meta.has_row_params:  # the request table holds them: gather the step's rows
        meta = dataclasses.replace(meta, **row_sampling(table, num_rows))
    logits = compute_logits(params, hidden[:num_rows], softcap)
    out = sample(logits, meta, bitmask, max_top_k=max_top_k, num_logprobs=num_logprobs, all_greedy=all_greedy)
    return dataclasses.replace(out, tokens=pad_tokens(out.tokens, max_num_seqs))


def copy_states(caches, src, dst, n, *, num_groups: int):
    """Copy GDN state slots src[i] -> dst[i] for the first n pairs (src, dst [max_num_seqs] i32).

    Only the n real pairs are copied, one slot at a time in place: as a gather + scatter of all
    max_num_seqs (padded) pairs it moved 16 x 512 KiB per GDN layer for one checkpoint (the tiny
    hybrid: ~6-8 ms per layer of a prefill step)."""

    def copy(a):
        if a is None:
            return None
        per_layer = a.reshape(num_groups, a.shape[0] // num_groups, *a.shape[1:])

        def one(i, x):
            slot = lax.dynamic_slice_in_dim(x, src[i], 1, axis=1)
            return lax.dynamic_update_slice_in_dim(x, slot, dst[i], axis=1)

        return lax.fori_loop(0, n, one, per_layer).reshape(a.shape)

    out = {"kv": caches["kv"], "conv": tuple(map(copy, caches["conv"])), "rec": tuple(map(copy, caches["rec"]))}
    if "draft" in caches:  # a draft model's KV pools (models/draft_model.py): pages, not slots
        out["draft"] = caches["draft"]
    if "mtp" in caches:  # the MTP carry travels with the state (models/mtp.py)
        hidden = caches["mtp"]["hidden"]
        one = lambda i, x: lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(x, src[i], 1), dst[i], axis=0)
        out["mtp"] = {**caches["mtp"], "hidden": lax.fori_loop(0, n, one, hidden)}
    return out


@dataclasses.dataclass(frozen=True)
class Statics:
    """What the programs take besides their arrays (bound with functools.partial)."""

    forward: object  # (params, caches, batch) -> (hidden, caches): the model's config and kernel options bound
    max_num_seqs: int
    page_size: int
    max_top_k: int
    num_groups: int  # layer groups of the GDN state caches (copy_states)
    softcap: float | None = None  # the model's final_logit_softcapping (compute_logits)


def jit_program(name: str, statics: Statics, cache_shardings=None, replicated=None):
    """The jitted program `name` with its statics bound, caches donated; under a mesh (shardings
    given) the outputs are pinned: caches keep their input layout, everything else is replicated."""
    fwd, S, rep, caches, cap = statics.forward, statics.max_num_seqs, replicated, cache_shardings, statics.softcap
    fn, donate, out = {
        "backbone": (functools.partial(backbone, forward=fwd), 1, (caches, rep)),
        "greedy_backbone": (
            functools.partial(greedy_backbone, forward=fwd, max_num_seqs=S, softcap=cap),
            1,
            (caches, rep),
        ),
        "table_backbone": (
            functools.partial(table_backbone, forward=fwd, max_num_seqs=S, page_size=statics.page_size, softcap=cap),
            1,
            (caches, rep, rep),
        ),
        "scoring_backbone": (functools.partial(scoring_backbone, forward=fwd, softcap=cap), 1, (caches, rep, rep)),
        "sampler": (
            functools.partial(sample_rows, max_top_k=statics.max_top_k, max_num_seqs=S, softcap=cap),
            (),
            rep,
        ),
        "prepare": (functools.partial(prepare, page_size=statics.page_size), (), rep),
        "write_table": (apply_write, (), rep),
        "copy_states": (functools.partial(copy_states, num_groups=statics.num_groups), 0, caches),
    }[name]
    static = {"table_backbone": ("greedy",), "sampler": ("num_rows", "num_logprobs", "all_greedy")}.get(name, ())
    pinned = {} if rep is None else {"out_shardings": out}
    return jax.jit(fn, donate_argnums=donate, static_argnames=static, **pinned)
