"""Verification of drafted tokens under attention data parallelism (runtime/parallel/data_parallel.py).

Each rank's drafting sequences carry their drafts as extra query rows in that rank's part of the
flat rank-major batch (`build_data_parallel_batch` of the scheduled drafts: a drafting sequence's
k + 1 tokens are a small chunk of its rank's slice, in the same token bucket). The step is
runtime/speculative/verify.py's with the host-built batch in place of the request table's prepare:

    hidden, caches = data_parallel_forward(params, caches, batch)   # every rank at once (vmap)
    rows = verify_sample(...)                  # each verify row with its request's parameters
    accepted = accepted_counts(rows.tokens, verify)
    caches = over_ranks(replay, ...)           # a GDN hybrid: each rank replays its accepted prefix

Verify rows are global token rows of the flat batch and sequences are numbered in the combined
order of `DataParallelOutput.sequences` (`speculator.verify_rows`), so sampling, acceptance and
the emitted tokens are the one-rank functions over D x max_num_seqs sequences. Only the GDN side
is per rank: a verify pass's `spec_rows` are each rank's own rows by rank-local batch position
(`rank_spec_rows`), and `models.gdn_replay.replay` runs under the same vmap as the forward pass
with each rank's accepted counts (`rank_major`). The per-row sampling parameters travel from the
host (`row_params`: DP has no request table). KV pages of rejected drafts are overwritten by the
next step; the host's tokens computed never counted them (`Scheduler.accept_drafts`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from models.gdn_replay import replay
from runtime.scheduled import PLACEHOLDER_TOKEN
from runtime.speculative.device_drafts import spec_rows
from runtime.speculative.verify import (
    VerifyExecutables,
    VerifyRows,
    accepted_counts,
    emitted,
    verify_sample,
)
from runtime.steps import specs
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_host import ROW_PARAMS

_ROW_DTYPES = {"top_k": jnp.int32, "seeds": jnp.uint32}  # every other row parameter: f32


def rank_positions(num_seqs, S: int):
    """-> (combined [D*S]: the combined sequence index of each rank-local batch position r*S + i,
    valid [D*S]: whether that position holds a sequence). num_seqs [D]: each rank's count."""
    D = num_seqs.shape[0]
    position = jnp.arange(D * S, dtype=jnp.int32)
    rank, i = position // S, position % S
    starts = jnp.cumsum(num_seqs) - num_seqs  # [D] each rank's first combined index
    return starts[rank] + i, i < num_seqs[rank]


def rank_major(per_seq, num_seqs, S: int):
    """[D*S] values by combined sequence index -> [D, S] by rank-local batch position (0 padding)."""
    combined, valid = rank_positions(num_seqs, S)
    taken = per_seq[jnp.clip(combined, 0, per_seq.shape[0] - 1)]
    return jnp.where(valid, taken, 0).reshape(num_seqs.shape[0], S)


def rank_spec_rows(verify: VerifyRows, num_seqs, width: int, T: int):
    """`ForwardBatch.spec_rows` of the flat batch: [D*S, width] i32, each rank-local batch
    position's verify rows as rows of its own rank's T tokens (-1 past them)."""
    S = verify.num_draft.shape[0] // num_seqs.shape[0]
    combined, valid = rank_positions(num_seqs, S)
    rows = spec_rows(verify, width)[jnp.clip(combined, 0, verify.num_draft.shape[0] - 1)]  # global rows
    rank = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None] // S
    return jnp.where(valid[:, None] & (rows >= 0), rows - rank * T, -1)


def seq_row_fields(row_params: dict, verify: VerifyRows) -> dict:
    """Each verify row's sampling parameters [T] from per-sequence ones [S + 1] (the last: neutral,
    for padding rows)."""
    null = next(iter(row_params.values())).shape[0] - 1
    index = jnp.where(verify.seqs >= 0, verify.seqs, null)
    return {name: values[index] for name, values in row_params.items()}


def row_params(reqs, S: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The per-sequence sampling parameters (`ROW_PARAMS`) of a verify step [S + 1], the last and
    the padding neutral; a request without a seed gets a fresh one, as the plain DP sampler's."""
    n = len(reqs)
    meta = SamplingMetadata.from_params(
        [r.params for r in reqs], [0] * n, [[]] * n, [[]] * n, pad_to=S + 1, rng=rng, row_params=True
    )
    return {name: getattr(meta, name) for name in ROW_PARAMS}


def dp_verify_backbone(
    params,
    caches,
    batch,
    row_params: dict,
    verify: VerifyRows,
    penalty_ids=None,
    bitmask=None,
    *,
    all_greedy,
    forward,
    over_ranks,
    max_top_k,
    softcap,
    gdn_replay=None,
    num_speculative_tokens=0,
    num_logprobs=0,
):
    """The flat DP batch's forward pass + per-row sampling + acceptance -> (caches, None (no
    request table), rows: SamplerOutput [D*T], accepted [D*S], first: SamplerOutput [D*S], None),
    by combined sequence index as `verify.verify_backbone`'s."""
    D = batch.num_seqs.shape[0]
    S, T = verify.num_draft.shape[0] // D, batch.input_ids.shape[0] // D
    batch = dataclasses.replace(batch, logits_indices=verify.rows)  # global rows: hidden [D*T, H]
    if gdn_replay is not None:
        batch = dataclasses.replace(
            batch, spec_rows=rank_spec_rows(verify, batch.num_seqs, num_speculative_tokens + 1, T)
        )
    hidden, caches = forward(params, caches, batch)
    stashes = caches.pop("replay", None) if gdn_replay is not None else None
    rows = verify_sample(
        params,
        hidden,
        seq_row_fields(row_params, verify),
        verify,
        penalty_ids,
        bitmask,
        all_greedy=all_greedy,
        max_top_k=max_top_k,
        softcap=softcap,
        num_logprobs=num_logprobs,
        num_speculative_tokens=num_speculative_tokens,
    )
    accepted = accepted_counts(rows.tokens, verify)
    if stashes is not None:  # each rank replays its own sequences' accepted prefixes into its slots
        state = {"conv": caches["conv"], "rec": caches["rec"]}
        commit = lambda c, b, s, a: gdn_replay(c, s, b, a)
        state = over_ranks(commit, state, batch, stashes, rank_major(accepted, batch.num_seqs, S))
        caches = {**caches, **state}
    rows, first = emitted(rows, verify, accepted)
    return caches, None, rows, lax.stop_gradient(accepted), first, None, None


class DataParallelVerifyExecutables(VerifyExecutables):
    """`dp_verify_backbone` compiled per flat token bucket (D x the per-rank buckets), greedy or
    sampled, plain, full or masked as the one-rank verify executables; inputs: the flat batch
    and the per-sequence sampling parameters (`step_inputs`)."""

    def __init__(self, executables, caches, max_top_k: int, num_speculative_tokens: int, rng: np.random.Generator):
        self.rng = rng
        self._batch_spec = executables.batch_spec
        super().__init__(executables, caches, executables.token_buckets, max_top_k, num_speculative_tokens)
        self.seq_buckets = (self.max_num_seqs,)  # the flat rank-major batch's sequence rows, all of them

    def _backbone(self, ex, max_top_k: int, num_speculative_tokens: int, mtp):
        return functools.partial(
            dp_verify_backbone,
            forward=ex.forward,
            over_ranks=ex.over_ranks,
            max_top_k=max_top_k,
            softcap=ex.model.cfg.final_logit_softcapping,
            gdn_replay=functools.partial(replay, opts=ex.opts) if ex.model.cfg.is_hybrid else None,
            num_speculative_tokens=num_speculative_tokens,
        )

    def step_inputs(self, batch, reqs) -> tuple:
        """(the flat batch, per-sequence sampling parameters); every token is known on the host (a
        step that drafts runs after the step in flight is settled)."""
        if (np.asarray(batch.input_ids) == PLACEHOLDER_TOKEN).any():
            raise RuntimeError("a verify step under attention DP feeds a placeholder token")
        return batch, row_params(reqs, self.max_num_seqs, self.rng)

    def _inputs_spec(self, T: int) -> tuple:
        rows = (self.max_num_seqs + 1,)
        params = {n: specs.host_spec(rows, _ROW_DTYPES.get(n, jnp.float32), self._replicated) for n in ROW_PARAMS}
        return self._batch_spec(T), params

    @staticmethod
    def _token_count(inputs: tuple) -> int:
        return inputs[0].input_ids.shape[0]
