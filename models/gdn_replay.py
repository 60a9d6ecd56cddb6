"""GDN state under speculative decoding: verify without committing, then replay the accepted prefix.

A verify step (runtime/speculative/verify.py) feeds each drafting sequence's last token and its k
drafts as k + 1 query rows. The GDN layers must not leave the rejected drafts in the recurrent
and conv state, and must not keep K + 1 copies of it either (vLLM's ReplaySSM design):

- During the verify pass (`ForwardBatch.spec_rows` set) a GDN layer computes its outputs for
  every row from the committed state, reading the sequences' slots into a scratch of one state
  per sequence (`verify_conv`, `verify_rule`); sequences without drafts (prefill chunks, plain
  decode rows) commit as usual, drafting sequences commit nothing. The layer stashes the per-token
  inputs of each drafting sequence's k + 1 rows (`stash_rows`): the raw conv inputs and the
  recurrence's k, v, g, beta after the conv.
- After acceptance (`accepted[i]` drafts of sequence i), `replay` commits the first
  accepted + 1 tokens of every drafting sequence in one masked pass over all GDN layers: the conv
  state becomes the last W-1 raw inputs of (old state ++ accepted inputs) (a copy, exact), the
  recurrent state the old state advanced by those tokens (the CPU "native" back-end's own C++
  recurrence, so the arithmetic is a decode step's; elsewhere the per-token step of
  `pallas_kernels.gdn.recurrent_step`, masked past each sequence's count, batched over sequences
  and layer groups).

    stash = stash_rows(batch, mixed, k, v, g, beta)             # in the layer, [S, K+1, ...]
    caches = replay(caches, stashes, batch, accepted, opts)      # after sampling, same compiled step
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from models import ops
from models.batch import ForwardBatch
from pallas_kernels import gdn


def drafting(batch: ForwardBatch) -> jax.Array:
    """[S] bool: the real sequences that verify drafts (their state is committed by `replay`)."""
    S = batch.state_slot_ids.shape[0]
    real = jnp.arange(S) < jnp.reshape(batch.num_seqs, (-1,))[0]
    return real & (batch.spec_rows[:, 1] >= 0)


def commit_rows(pool, scratch, slots, batch: ForwardBatch):
    """Write the scratch states of the real sequences without drafts back to their slots."""
    S = slots.shape[0]
    real = jnp.arange(S) < jnp.reshape(batch.num_seqs, (-1,))[0]
    target = jnp.where(real & ~drafting(batch), slots, pool.shape[0])  # out of range: dropped
    return pool.at[target].set(scratch, mode="drop")


def verify_state(run, args: tuple, pool, batch: ForwardBatch, slots):
    """A verify pass of any ragged state op `run(*args, pool, cu_q_lens, slot_ids, has_initial,
    num_seqs) -> (out, pool)` (the KDA and SSD scans, the Mamba-2 conv) over a scratch of one state
    per sequence -> (out, pool with only the non-drafting sequences updated)."""
    S = slots.shape[0]
    ids = jnp.arange(S, dtype=jnp.int32)
    out, scratch = run(*args, pool[slots], batch.cu_q_lens, ids, batch.has_initial_state, batch.num_seqs)
    return out, commit_rows(pool, scratch, slots, batch)


def verify_conv(mixed, conv_w, conv_state, batch: ForwardBatch, slots, opts):
    """The causal conv of a verify pass: (y [T, C], conv_state with only non-drafting sequences updated)."""
    S = slots.shape[0]
    scratch = conv_state[slots]  # [S, W-1, C]: one state per sequence, not per row
    y, scratch = ops.causal_conv1d(
        mixed, conv_w, scratch, batch.cu_q_lens, jnp.arange(S, dtype=jnp.int32), batch.has_initial_state,
        batch.num_seqs, opts,
    )  # fmt: skip
    return y, commit_rows(conv_state, scratch, slots, batch)


def verify_rule(q, k, v, g, beta, rec_state, batch: ForwardBatch, slots, opts):
    """The gated delta rule of a verify pass: (o [T, H, V], rec_state with only non-drafting sequences updated)."""
    S = slots.shape[0]
    scratch = rec_state[slots]  # [S, H, K, V]
    ids = jnp.arange(S, dtype=jnp.int32)
    o, scratch = ops.gated_delta_rule(
        q, k, v, g, beta, scratch, batch.cu_q_lens, ids, batch.has_initial_state, batch.num_seqs, opts
    )
    return o, commit_rows(rec_state, scratch, slots, batch)


def stash_rows(batch: ForwardBatch, mixed, k, v, g, beta) -> dict:
    """Each sequence's verify rows (its last real token, then its drafts) of the per-token inputs:
    {x: [S, K+1, C] raw conv inputs, k: [S, K+1, Hk, dk], v: [S, K+1, H, dv], g, beta: [S, K+1, H]}."""
    rows = jnp.clip(batch.spec_rows, 0, mixed.shape[0] - 1)  # [S, K+1]; rows past a sequence's drafts unused
    return {"x": mixed[rows], "k": k[rows], "v": v[rows], "g": g[rows], "beta": beta[rows]}


def replay_conv(old, x, counts):
    """old [M, W-1, C] conv states, x [M, K+1, C] raw inputs, counts [M] (1..K+1) -> the last W-1
    raw inputs after `counts` more, in old's dtype (`causal_conv1d`'s state rule)."""
    w1 = old.shape[1]
    history = jnp.concatenate([old.astype(jnp.float32), x.astype(jnp.float32)], axis=1)  # [M, W-1+K+1, C]
    take = jax.vmap(lambda h, n: lax.dynamic_slice_in_dim(h, n, w1, axis=0))
    return take(history, counts).astype(old.dtype)


def replay_recurrent(old, k, v, g, beta, counts):
    """old [M, H, K, V] states, per-token k [M, K+1, Hk, dk], v [M, K+1, H, dv], g / beta
    [M, K+1, H], counts [M] -> each state advanced by its first `counts` tokens: the reference's
    per-token step in f32, the steps past a count skipped, rounded to old's dtype after each token
    as decode steps one token at a time store it (a bf16 pool: the state decoding would commit)."""
    h = v.shape[2]
    kx = jnp.repeat(k, h // k.shape[2], axis=2).astype(jnp.float32)  # value head h reads key head h // (H // Hk)
    f32 = lambda a: a.astype(jnp.float32)
    step = jax.vmap(gdn.recurrent_step)
    state = f32(old)
    for j in range(k.shape[1]):
        advanced, _ = step(state, kx[:, j], kx[:, j], f32(v[:, j]), f32(g[:, j]), f32(beta[:, j]))
        state = jnp.where((j < counts)[:, None, None, None], advanced.astype(old.dtype).astype(jnp.float32), state)
    return state.astype(old.dtype)


def _replay_native(pool, slots, has_initial, stash, counts, live):
    """The same update through the CPU back-end's C++ recurrence: the committed tokens laid out as
    a ragged batch of `live` sequences (drafting ones first), written straight into their slots."""
    M, K1 = counts.shape[0], stash["k"].shape[1]
    order = jnp.argsort(~live, stable=True)  # live sequences first
    lengths = jnp.where(live[order], counts[order], 0)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths).astype(jnp.int32)])
    flat = jnp.arange(M * K1, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], flat, side="right"), M - 1)
    src = order[seq], jnp.clip(flat - cu[seq], 0, K1 - 1)
    k, v, g, beta = (stash[name][src] for name in ("k", "v", "g", "beta"))
    n = jnp.sum(live).astype(jnp.int32)
    _, pool = gdn.gated_delta_rule(
        k, k, v, g, beta, pool, cu, slots[order], has_initial[order], n, impl="native"
    )  # fmt: skip
    return pool


def replay(caches: dict, stashes: tuple, batch: ForwardBatch, accepted, opts, recurrent=None) -> dict:
    """Commit every drafting sequence's first accepted + 1 tokens into its state slots, for every
    recurrent layer (`stashes`: per position in the layer group, the stashed rows stacked over
    groups [G, S, K+1, ...], or None). accepted [S] i32. `recurrent(old [M, ...], stash, counts)
    -> new`: another mixer's state update (KDA: models/kda_replay.py, Mamba-2:
    models/mamba2_replay.py); None: GDN's. The conv state is every mixer's last W-1 raw inputs. -> caches."""
    conv, rec = list(caches["conv"]), list(caches["rec"])
    live_s = drafting(batch)  # [S]
    counts_s = accepted.astype(jnp.int32) + 1
    native = opts.impl("gdn") == "native"
    for j, stash in enumerate(stashes):
        if stash is None:
            continue
        G, S = stash["x"].shape[:2]
        N = rec[j].shape[0] // G
        slots = (batch.state_slot_ids[None, :] + N * jnp.arange(G)[:, None]).reshape(-1)  # [G*S]
        flat = jax.tree.map(lambda a: a.reshape((G * S,) + a.shape[2:]), stash)
        live = jnp.tile(live_s, G)
        counts = jnp.tile(counts_s, G)
        has_initial = jnp.tile(batch.has_initial_state, G)
        target = jnp.where(live, slots, rec[j].shape[0])  # others: dropped
        old_conv = jnp.where(has_initial[:, None, None], conv[j][slots], 0).astype(conv[j].dtype)
        conv[j] = conv[j].at[target].set(replay_conv(old_conv, flat["x"], counts), mode="drop")
        if recurrent is None and native and gdn.cpu_native.available() and rec[j].dtype == jnp.float32:
            rec[j] = _replay_native(rec[j], slots, has_initial, flat, counts, live)
            continue
        old = jnp.where(has_initial[:, None, None, None], rec[j][slots], 0).astype(rec[j].dtype)
        if recurrent is None:
            new = replay_recurrent(old, flat["k"], flat["v"], flat["g"], flat["beta"], counts)
        else:
            new = recurrent(old, flat, counts)
        rec[j] = rec[j].at[target].set(new, mode="drop")
    return {**caches, "conv": tuple(conv), "rec": tuple(rec)}
