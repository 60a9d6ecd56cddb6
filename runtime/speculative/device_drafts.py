"""Drafts made on the device inside the verify step (`method: mtp` and `draft_model`).

`fill_drafts` runs the MTP layer (models/mtp.py) or the draft model (models/draft_model.py) k
times from each drafting sequence's last token and puts its drafts in place of the host's
placeholders (`MTP_DRAFT`) before the target's forward pass; `next_drafts` makes a grammar
request's drafts for the next step after acceptance, so the host can mask them before that step
(runtime/speculative/speculator.py). `spec_rows` is each sequence's verify rows by offset.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import draft_model
from models.mtp import draft

MTP_DRAFT = np.iinfo(np.int32).max  # the host's placeholder for a draft the MTP makes in the step


def spec_rows(verify, width: int) -> jax.Array:
    """[S, width] i32: each sequence's verify rows by offset (its last real token, then its drafts),
    -1 past them (`ForwardBatch.spec_rows`)."""
    S = verify.num_draft.shape[0]
    seqs = jnp.where(verify.seqs >= 0, verify.seqs, S)  # padding: dropped
    return jnp.full((S, width), -1, jnp.int32).at[seqs, verify.offsets].set(verify.rows, mode="drop")


def fill_drafts(drafter, params, caches, batch, verify, k: int):
    """The MTP (or the draft model: caches["draft"]) drafts each drafting sequence's k tokens from
    its last token (its verify row at offset 0); they replace the placeholder drafts (`MTP_DRAFT`)
    in the verify rows and in the token rows after them. -> (batch, verify, caches, drafts [S, k])."""
    S, key = verify.num_draft.shape[0], "mtp" if "mtp" in caches else "draft"
    head = spec_rows(verify, k + 1)[:, 0]  # [S] the last real token's row, -1: not in the step
    valid = (verify.num_draft > 0) & (head >= 0)
    row = jnp.maximum(head, 0)
    drafts, cache = drafter(
        params,
        caches[key],
        batch.input_ids[row],
        batch.positions[row],
        batch.state_slot_ids[:S],  # the step's S sequence rows of the table's
        valid,
        batch.block_tables[:S],
        k,
    )
    seq = jnp.clip(verify.seqs, 0, S - 1)
    fill = (verify.seqs >= 0) & (verify.offsets < verify.num_draft[seq]) & (verify.drafts == MTP_DRAFT)
    new = jnp.where(fill, drafts[seq, jnp.clip(verify.offsets, 0, k - 1)], verify.drafts)
    T = batch.input_ids.shape[0]
    input_ids = batch.input_ids.at[jnp.where(fill, verify.rows + 1, T)].set(new, mode="drop")
    batch = dataclasses.replace(batch, input_ids=input_ids)
    return batch, dataclasses.replace(verify, drafts=new), {**caches, key: cache}, drafts


def next_drafts(drafter, params, caches, batch, verify, accepted, tokens, k: int):
    """After acceptance: each sequence's k drafts for the step after this one, made from the
    token this step emits after its accepted drafts (the target's token at its row `accepted`,
    one position later) and the carry just kept: the inputs the next step's `fill_drafts` would
    take, so the host can check them against a grammar before it builds that step's masks
    (drafts are proposals: verification keeps any of them exact). The MTP's K/V written here
    (positions from the last accepted one) are the values the next step writes there again.
    -> (caches, drafts [S, k])."""
    S, key = verify.num_draft.shape[0], "mtp" if "mtp" in caches else "draft"
    head = spec_rows(verify, k + 1)[:, 0]  # [S] the last real token's row, -1: not in the step
    at = (verify.seqs >= 0) & (verify.offsets == accepted[jnp.clip(verify.seqs, 0, S - 1)])
    bonus = jnp.zeros(S, jnp.int32).at[jnp.where(at, verify.seqs, S)].set(tokens, mode="drop")  # [S]
    positions = batch.positions[jnp.maximum(head, 0)] + accepted + 1
    drafts, cache = drafter(
        params, caches[key], bonus, positions, batch.state_slot_ids[:S], head >= 0, batch.block_tables[:S], k
    )
    return {**caches, key: cache}, drafts


def drafter_for(ex, mtp):
    """The function that drafts inside the verify step: the MTP layer (`mtp` true), the draft
    model (`mtp == "draft_model"`), or None (host drafts)."""
    if mtp == "draft_model":
        return functools.partial(draft_model.draft, draft_cfg=ex.model.draft.cfg, opts=ex.opts)
    return functools.partial(draft, cfg=ex.model.cfg, opts=ex.opts) if mtp else None
