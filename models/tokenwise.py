"""`tokenwise`: run a per-token layer over every batch row's tokens at once under `jax.vmap`.

Attention data parallelism (runtime/parallel/data_parallel.py) runs the single-rank forward pass under
`jax.vmap` over the DP ranks. Attention and GDN need that (each rank's sequences, pages and
slots are its own), but a layer that treats every token independently does not, and some of
its ops have no batching rule: `lax.ragged_dot` (the MoE experts' grouped matmul) cannot be
vmapped with unbatched expert weights. Under vmap, `tokenwise(fn)` folds the mapped axis into
the token axis and calls `fn` once over all ranks' tokens ([D, T, H] -> [D*T, H] -> fn -> back);
without vmap it is `fn` itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tokenwise(fn):
    """fn(params, x [T, H], valid_rows) -> [T, H'], independent per token; params are never vmapped.
    `valid_rows` ([] int32, `ForwardBatch.num_valid_rows`): x's leading real rows. Folded ranks
    interleave real and padding rows, so there fn gets every row as valid."""

    @jax.custom_batching.custom_vmap
    def call(params, x, valid_rows):
        return fn(params, x, valid_rows)

    @call.def_vmap
    def rule(axis_size, in_batched, params, x, valid_rows):
        params_batched, x_batched, _ = in_batched
        if any(jax.tree.leaves(params_batched)):
            raise NotImplementedError("tokenwise: the parameters must not be vmapped")
        if not x_batched:
            return call(params, x, jnp.int32(x.shape[0])), False
        folded = x.reshape(-1, *x.shape[2:])  # [D*T, H]
        out = call(params, folded, jnp.int32(folded.shape[0]))
        return out.reshape(axis_size, x.shape[1], *out.shape[1:]), True

    return call
