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


def tokenwise(fn):
    """fn(params, x [T, H]) -> [T, H'], independent per token; params are never vmapped."""

    @jax.custom_batching.custom_vmap
    def call(params, x):
        return fn(params, x)

    @call.def_vmap
    def rule(axis_size, in_batched, params, x):
        params_batched, x_batched = in_batched
        if any(jax.tree.leaves(params_batched)):
            raise NotImplementedError("tokenwise: the parameters must not be vmapped")
        if not x_batched:
            return call(params, x), False
        out = call(params, x.reshape(-1, *x.shape[2:]))  # [D*T, H]
        return out.reshape(axis_size, x.shape[1], *out.shape[1:]), True

    return call
