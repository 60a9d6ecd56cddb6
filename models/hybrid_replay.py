"""KDA and Mamba-2 state under speculative decoding: the accepted prefix replayed, as GDN's is.

models/gdn_replay.py's design carries over unchanged to the other recurrent mixers, whose state
lives in the same slots (conv: the last W-1 raw inputs; recurrent: one fp32 state per layer):

- In a verify pass (`ForwardBatch.spec_rows` set) the layer runs its conv and its scan through
  `gdn_replay.verify_state` (the op over a scratch of one state per sequence: outputs for every
  row from the committed state; sequences without drafts commit as usual, drafting ones nothing)
  and stashes each drafting sequence's k + 1 rows of per-token inputs; no state copies.
- After acceptance, `gdn_replay.replay` commits the first accepted + 1 tokens of every drafting
  sequence in one masked pass over the layers: the conv state as GDN's (a copy), the recurrent
  state through the mixer's own decode step here, masked past each sequence's count, batched over
  sequences and layer groups, rounded to the pool's dtype after each token as decode steps store it.

KDA (Kimi Linear, models/kda_layer.py): the gated delta rule with a per-channel decay; its stash is
GDN's (`gdn_replay.stash_rows`: raw conv inputs, k, v, g [H, K] per token, beta) and its step
`kda.kda_recurrent_step`. Mamba-2 (Nemotron-H, models/mamba2.py): S = exp(dt A) S + dt x B^T; its
stash (`ssm_stash_rows`) holds the raw conv inputs, x after the conv, dt after HF's processing,
B, and the layer's A, and its step is `ssd.ssd_recurrent_step`.

    caches = replay_for(cfg)(caches, stashes, batch, accepted, opts)   # after sampling, in the step
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import gdn_replay
from models.batch import ForwardBatch
from models.config import ModelConfig
from pallas_kernels import kda, ssd


def _advance(old, counts, num_rows: int, step):
    """old [M, ...] states advanced by `step(state_f32, j) -> state_f32` for rows j < counts [M],
    rounded to old's dtype after each row."""
    state = old.astype(jnp.float32)
    keep = (1,) * (old.ndim - 1)
    for j in range(num_rows):
        advanced = step(state, j).astype(old.dtype).astype(jnp.float32)
        state = jnp.where((j < counts).reshape((-1,) + keep), advanced, state)
    return state.astype(old.dtype)


def kda_state(old, stash: dict, counts):
    """old [M, H, K, V] KDA states, stash {k [M, K+1, Hk, K], v [M, K+1, H, V], g [M, K+1, H, K],
    beta [M, K+1, H]}, counts [M] -> each advanced by its first `counts` tokens (the decode step)."""
    h = stash["v"].shape[2]
    f32 = {name: stash[name].astype(jnp.float32) for name in ("k", "v", "g", "beta")}
    k = jnp.repeat(f32["k"], h // f32["k"].shape[2], axis=2)  # value head h reads key head h // (H // Hk)
    step = jax.vmap(kda.kda_recurrent_step)

    def one(state, j):
        return step(state, k[:, j], k[:, j], f32["v"][:, j], f32["g"][:, j], f32["beta"][:, j])[0]

    return _advance(old, counts, k.shape[1], one)


def ssm_stash_rows(batch: ForwardBatch, raw, xs, dt, b, a) -> dict:
    """A Mamba-2 layer's verify rows per sequence: {x: [S, K+1, conv_dim] raw conv inputs,
    xs: [S, K+1, H, P] the scan's x, dt: [S, K+1, H] processed (`ssd.ssd_dt`), b: [S, K+1, G, N],
    A: [S, H] the layer's -exp(A_log)}."""
    rows = jnp.clip(batch.spec_rows, 0, raw.shape[0] - 1)
    S = rows.shape[0]
    return {"x": raw[rows], "xs": xs[rows], "dt": dt[rows], "b": b[rows], "A": jnp.broadcast_to(a, (S,) + a.shape)}


def ssm_state(old, stash: dict, counts):
    """old [M, H, P, N] SSM states, stash as `ssm_stash_rows` gives it (flattened to M sequences),
    counts [M] -> each advanced by its first `counts` tokens (`ssd_recurrent_step`, the decode step)."""
    h = stash["xs"].shape[2]
    xs, dt = stash["xs"].astype(jnp.float32), stash["dt"].astype(jnp.float32)
    b = jnp.repeat(stash["b"].astype(jnp.float32), h // stash["b"].shape[2], axis=2)  # head h reads group h // (H // G)
    a = stash["A"].astype(jnp.float32)
    zero = jnp.zeros_like(a)
    step = jax.vmap(ssd.ssd_recurrent_step)

    def one(state, j):
        return step(state, xs[:, j], dt[:, j], a, b[:, j], b[:, j], zero)[0]

    return _advance(old, counts, xs.shape[1], one)


def replay_for(cfg: ModelConfig):
    """The model's replay: (caches, stashes, batch, accepted, opts) -> caches (`gdn_replay.replay`)."""
    if cfg.kda:
        return functools.partial(gdn_replay.replay, recurrent=kda_state)
    if cfg.mamba is not None:
        return functools.partial(gdn_replay.replay, recurrent=ssm_state)
    return gdn_replay.replay
