"""`speculative_config.method: draft_model`: a smaller model sharing the tokenizer drafts k tokens.

The draft model is loaded as the target is (`models.model.load_model`), laid out as the target's
execution plan says, and its parameters ride in the target's under `params["draft"]`. Its caches
(`caches["draft"]`): its own paged KV pools, one per attention layer, indexed by the SAME page ids
as the target's (the block table is shared: no second allocator, prefix hits share its pages too).

    absorb  every forward pass (`forward_with_draft`, the steps' forward): the draft model runs over
            the same ragged batch (prefill chunks, decode rows, verify rows) and writes its K/V at the
            batch's slots; its output is dropped.
    draft   inside the verify step (runtime/speculative/verify.py `fill_drafts`): k greedy steps per
            drafting sequence, one query row each, from its last token; K/V written at positions
            pos .. pos + k - 1 (a rejected draft's rows are overwritten later, as the target's).

Drafts are attention-only models for now (a recurrent draft would need its own state slots and a
replay); the target may be dense or a GDN hybrid (the target side replays GDN state). Under P/D the
decode instance computes the draft's K/V of the pulled tokens itself (runtime/kv_transfer/spec_layout.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from models.batch import ForwardBatch, draft_rows_batch
from models.config import ATTENTION, ModelConfig, parse_config
from models.model import load_model
from models.safetensors_io import read_json
from models.transformer import compute_logits, forward

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def draft_refusal(target: ModelConfig, draft: ModelConfig, target_path, draft_path) -> str | None:
    """Why this draft cannot draft for this target, or None."""
    if draft.vocab_size != target.vocab_size:
        return (
            f"the draft model's vocab_size ({draft.vocab_size}, {draft_path}) differs from the target's "
            f"({target.vocab_size}): a draft must share the target's tokenizer"
        )
    kinds = sorted(set(draft.layer_types) - {ATTENTION})
    if kinds or draft.mla is not None:
        what = "MLA" if draft.mla is not None else "/".join(kinds)
        return f"the draft model ({draft.architecture}) must be attention-only: {what} drafts are not supported yet"
    if any(draft.sliding_window(i) is not None for i in range(draft.num_layers)):
        return f"the draft model ({draft.architecture}) has sliding-window layers: not supported yet"
    for name in TOKENIZER_FILES:  # the same tokenizer where both directories ship one
        a, b = Path(target_path) / name, Path(draft_path) / name
        if a.is_file() and b.is_file() and _vocab(a) != _vocab(b):
            return f"the draft model's tokenizer ({b}) differs from the target's ({a})"
    return None


def load_draft(path, target, dtype: str):
    """The draft `Model` at `path` for the `Model` `target`; ValueError (named) where it cannot draft,
    checked on its config.json before its weights are read."""
    path = Path(path)
    if (path / "config.json").is_file():
        cfg = parse_config(read_json(path / "config.json"), read_json(path / "generation_config.json", required=False))
        why = draft_refusal(target.cfg, cfg, target.path, path)
        if why is not None:
            raise ValueError(f"speculative_config: {why}")
    draft = load_model(path, dtype=dtype, progress=False)
    why = draft_refusal(target.cfg, draft.cfg, target.path, draft.path)
    if why is not None:
        raise ValueError(f"speculative_config: {why}")
    return draft


def _vocab(path: Path):
    if path.suffix != ".json":
        return path.read_bytes()
    data = json.loads(path.read_text())
    return data.get("model", {}).get("vocab", data), data.get("added_tokens")


def draft_params_like(draft, plan) -> dict:
    """The draft's parameters laid out as the target's execution plan lays out the target's."""
    if plan.layer_loop == "unroll":
        draft.unstack_layers()
    if plan.weight_layout == "out_in":
        draft.hold_out_in()
    elif plan.weight_layout == "packed":
        draft.hold_packed()
    return draft.params


def init_draft_caches(draft, num_pages: int, page_size: int, kv_dtype: str, bit_storage: bool) -> dict:
    """The draft's KV pools: `num_pages` per layer (the target's page count: the same ids)."""
    return draft.init_caches(num_pages, page_size, 1, kv_dtype, bit_storage=bit_storage)


def forward_with_draft(params, caches, batch: ForwardBatch, *, cfg: ModelConfig, opts, draft_cfg: ModelConfig, **kw):
    """The target's forward pass, and the draft model's over the same batch (its K/V absorbed)."""
    draft_cache = caches.get("draft")
    rest = {k: v for k, v in caches.items() if k != "draft"}
    hidden, rest = forward(params, rest, batch, cfg=cfg, opts=opts, **kw)
    if draft_cache is None:
        return hidden, rest
    return hidden, {**rest, "draft": absorb(params["draft"], draft_cache, batch, draft_cfg, opts)}


def absorb(draft_params, draft_cache: dict, batch: ForwardBatch, draft_cfg: ModelConfig, opts) -> dict:
    """The draft model's K/V for every row of `batch` (its hidden states are not used)."""
    plain = dataclasses.replace(batch, spec_rows=None, logits_indices=batch.logits_indices[:1])
    _, draft_cache = forward(draft_params, draft_cache, plain, cfg=draft_cfg, opts=opts)
    return draft_cache


def draft_step(draft_params, draft_cache: dict, tokens, positions, valid, block_tables, draft_cfg, opts):
    """One draft-model step for S sequences, one query each at `positions` [S] (K/V written there;
    `valid` [S] bool, others write nothing) -> (logits [S, V], the cache)."""
    batch = draft_rows_batch(tokens, positions, valid, block_tables, draft_cache["kv"][0].page_size)
    hidden, draft_cache = forward(draft_params, draft_cache, batch, cfg=draft_cfg, opts=opts)
    return compute_logits(draft_params, hidden, draft_cfg.final_logit_softcapping), draft_cache


def draft(params, draft_cache: dict, tokens, positions, slots, valid, block_tables, k: int, draft_cfg, opts):
    """k greedy drafts per sequence: tokens [S] its last token (at `positions` [S]); step j feeds
    the previous draft at position + j. `slots`: unused (no state). -> (drafts [S, k] i32, the cache)."""
    del slots
    drafts = []
    for j in range(k):
        logits, draft_cache = draft_step(
            params["draft"], draft_cache, tokens, positions + j, valid, block_tables, draft_cfg, opts
        )
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), draft_cache
