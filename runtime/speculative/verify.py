"""Verification of drafted tokens inside one compiled step, and its executables.

A decode sequence with k drafted tokens rides in the ragged batch as k + 1 query rows (its last
token, then the drafts), like a small prefill chunk. `verify_backbone` is the table backbone
(prepare fused in) with the model's hidden state kept at every verify row (`VerifyRows`, one per
row whose next token is sampled: [T] in the step's token bucket, so no new shape), the step's
sampler applied to each (the request's own parameters from the request table, the random key of
the output index it samples), and acceptance:

    accepted[i] = the number of leading drafts of sequence i equal to the target's token before them

For a deterministic draft (n-gram: q is one-hot on the draft x) this is exactly rejection
sampling: x is accepted with probability p(x), and a rejected position emits the target's sample,
which, given it is not x, is distributed as p with x removed and renormalised; the row after the
last accepted draft emits the bonus token. Greedy rows are argmax, so greedy output is unchanged.
The table's `num_computed` of each row is rewound by its rejected drafts here, on the device (the
KV written for them is overwritten by the next step); the host mirror is rewound by the caller.
On a hybrid (GDN, KDA, Mamba-2) the batch carries `spec_rows` (`spec_rows`): the recurrent layers commit no state for
drafting sequences and stash their inputs, and once `accepted` is known the accepted prefix is
replayed into the committed state in the same compiled step (models/gdn_replay.py, models/hybrid_replay.py).

Per-sequence work (the MTP's / draft model's k draft steps, acceptance, penalty features, the
hybrid replay) runs over the step's sequence bucket S (`seq_rows`: the plain steps' smallest
`seq_buckets` entry holding its sequences), not max_num_seqs; the table and the forward pass keep
max_num_seqs rows, `first` comes out padded to them. Keys: (T, S, all_greedy, widths, num_logprobs,
mask_width), at start-up every S <= the bucket of min(T, max_num_seqs) (`seq_buckets_for`); attention DP: one S.

    exes = VerifyExecutables(step_executables, caches, token_buckets)   # compiled per bucket, greedy or not
    inputs = (table, step, prev_tokens)
    rows = speculator.verify_rows(out, T, exes.seq_rows(len(out.sequences)))[0]
    caches, table, tokens, accepted, first, drafted, made = exes.run(params, caches, inputs, rows, all_greedy)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.hybrid_replay import replay_for
from models.mtp import keep_accepted
from models.transformer import compute_logits
from runtime.buckets import BucketMiss, bucket_for
from runtime.speculative.device_drafts import drafter_for, fill_drafts, next_drafts, spec_rows
from runtime.steps import specs
from runtime.steps.sampler import sample
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_device import prepare, row_sampling
from runtime.types import MAX_LOGPROBS

log = logging.getLogger("jaxserve.speculative")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyRows:
    """Where a step's tokens are sampled. [T] i32 each (padding: seqs -1), num_draft [S] i32.

    rows: the token row whose hidden state is read; seqs: its sequence's batch position;
    offsets: its index j within the sequence's k + 1 rows; steps: the output index it samples
    (the row's random key); drafts: the drafted token it checks (-1: none, the last row of a
    sequence); num_draft: drafted tokens per batch position."""

    rows: jax.Array
    seqs: jax.Array
    offsets: jax.Array
    steps: jax.Array
    drafts: jax.Array
    num_draft: jax.Array


def accepted_counts(tokens: jax.Array, verify: VerifyRows) -> jax.Array:
    """[S] i32: per sequence, the leading drafts equal to the target's token at the row before
    them (the first row whose token differs from its draft, or that has none, stops it)."""
    S = verify.num_draft.shape[0]
    stop = (tokens != verify.drafts) | (verify.drafts < 0)
    big = jnp.iinfo(jnp.int32).max
    segment = jnp.where(verify.seqs >= 0, verify.seqs, S)  # padding: out of range, dropped
    first = jax.ops.segment_min(jnp.where(stop, verify.offsets, big), segment, num_segments=S)
    return jnp.minimum(first, verify.num_draft).astype(jnp.int32)


def earlier_drafts(verify: VerifyRows, k: int) -> jax.Array:
    """[T, k] i32: each verify row's sequence's drafts before it (row j of a sequence: its drafts
    0 .. j-1, -1 after; a sequence's rows are consecutive), the tokens a penalty counts on top of
    the output so far: a row is emitted only when every draft before it was accepted."""
    T = verify.rows.shape[0]
    m = jnp.arange(k, dtype=jnp.int32)[None, :]  # [1, k]
    src = jnp.arange(T, dtype=jnp.int32)[:, None] - verify.offsets[:, None] + m  # [T, k]
    taken = verify.drafts[jnp.clip(src, 0, T - 1)]
    return jnp.where((m < verify.offsets[:, None]) & (verify.seqs[:, None] >= 0), taken, -1)


def table_row_fields(table, verify: VerifyRows) -> dict:
    """Each verify row's sampling parameters ([T] fields of `SamplingMetadata`) from the request
    table after the step's prepare (padding rows: the null row's neutral ones)."""
    T, S = verify.rows.shape[0], verify.num_draft.shape[0]
    null_row = table.row_params.shape[0] - 1  # its parameters are neutral (greedy, no filter)
    table_rows = jnp.where(verify.seqs >= 0, table.step_rows[jnp.clip(verify.seqs, 0, S - 1)], null_row)  # [T]
    return row_sampling(dataclasses.replace(table, step_rows=table_rows), T)


def verify_sample(
    params,
    hidden,
    fields: dict,
    verify: VerifyRows,
    penalty_ids=None,
    bitmask=None,
    *,
    all_greedy,
    max_top_k,
    softcap,
    num_logprobs=0,
    num_speculative_tokens=0,
):
    """SamplerOutput [T]: the target's token at every verify row, each with its request's
    parameters (`fields`: [T] each, `table_row_fields`) (and raw logprobs when `num_logprobs`). `penalty_ids`: None, or the per-sequence
    features (output_ids [S, Wo], prompt_ids [S, Wp], banned_ids [S, Wb], min_tokens [S],
    logit_bias_ids [S, Wl], logit_bias_values [S, Wl]; ids -1 padded): a row's penalties count
    its sequence's output plus the drafts before it (`earlier_drafts`), as a plain step after
    those tokens would; its banned ids apply while its output index is below min_tokens; its
    logit bias is its sequence's.
    `bitmask`: None, or [R, W] i32 grammar masks of the first R <= T rows (row v: the tokens its
    sequence's grammar allows after the drafts before it; the rows past R allow everything)."""
    T, S = verify.rows.shape[0], verify.num_draft.shape[0]
    empty = jnp.zeros((T, 0), jnp.int32)
    output_ids = prompt_ids = banned_ids = bias_ids = empty
    bias_values = jnp.zeros((T, 0), jnp.float32)
    if penalty_ids is not None:
        out_s, prompt_s, banned_s, min_tokens, bias_ids_s, bias_values_s = penalty_ids
        seq = jnp.clip(verify.seqs, 0, S - 1)
        output_ids = jnp.concatenate(
            [out_s[seq], earlier_drafts(verify, num_speculative_tokens)], axis=1
        )  # [T, Wo + k]
        prompt_ids = prompt_s[seq]  # [T, Wp]
        banned_ids = jnp.where((verify.steps < min_tokens[seq])[:, None], banned_s[seq], -1)  # [T, Wb]
        bias_ids, bias_values = bias_ids_s[seq], bias_values_s[seq]  # [T, Wl]
    meta = SamplingMetadata(
        **fields,
        steps=verify.steps,
        output_ids=output_ids,
        prompt_ids=prompt_ids,
        banned_ids=banned_ids,
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
    )
    logits = compute_logits(params, hidden, softcap)  # [T, V]
    if bitmask is not None and bitmask.shape[0] < T:
        bitmask = jnp.concatenate([bitmask, jnp.full((T - bitmask.shape[0], bitmask.shape[1]), -1, jnp.int32)])
    return sample(logits, meta, bitmask, max_top_k=max_top_k, all_greedy=all_greedy, num_logprobs=num_logprobs)


def verify_backbone(
    params,
    caches,
    table,
    step,
    prev_tokens,
    verify: VerifyRows,
    penalty_ids=None,
    bitmask=None,
    *,
    all_greedy,
    forward,
    page_size,
    max_top_k,
    softcap,
    gdn_replay=None,
    num_speculative_tokens=0,
    num_logprobs=0,
    drafter=None,
):
    """prepare + forward + per-row sampling + acceptance -> (caches, table with the rejected
    drafts rewound, rows: SamplerOutput [T] (sequence i emits tokens[first_i : first_i +
    accepted_i + 1], the accepted drafts and then the target's token, each with its raw logprobs
    when `num_logprobs`), accepted [S], first: SamplerOutput [S] of each sequence's first token).
    A hybrid (`gdn_replay`: `models.hybrid_replay.replay_for(cfg)` with the kernel options bound): the
    forward pass commits no GDN state for drafting sequences; the accepted prefix is replayed
    into it after acceptance."""
    table, batch = prepare(table, step, prev_tokens, page_size=page_size)
    S, S_max = verify.num_draft.shape[0], batch.state_slot_ids.shape[0]  # the step's sequence bucket, the table's rows
    drafted = None
    if drafter is not None:  # MTP or a draft model: the drafts made here, on the device
        batch, verify, caches, drafted = fill_drafts(drafter, params, caches, batch, verify, num_speculative_tokens)
    batch = dataclasses.replace(batch, logits_indices=verify.rows)
    if gdn_replay is not None:  # the forward pass's per-sequence rows: the table's (the rows past S: none)
        rows_s = spec_rows(verify, num_speculative_tokens + 1)
        batch = dataclasses.replace(batch, spec_rows=_pad_rows(rows_s, S_max, -1))
    hidden, caches = forward(params, caches, batch)  # [T, H]
    stashes = caches.pop("replay", None) if gdn_replay is not None else None
    rows = verify_sample(
        params,
        hidden,
        table_row_fields(table, verify),
        verify,
        penalty_ids,
        bitmask,
        all_greedy=all_greedy,
        max_top_k=max_top_k,
        softcap=softcap,
        num_logprobs=num_logprobs,
        num_speculative_tokens=num_speculative_tokens,
    )
    tokens = rows.tokens
    accepted = accepted_counts(tokens, verify)
    if stashes is not None:  # the replay over the step's S sequence rows only
        caches = gdn_replay(caches, jax.tree.map(lambda a: a[:, :S], stashes), first_rows(batch, S), accepted)
    if "mtp" in caches:  # the carry: the hidden state at the last accepted row
        mtp = keep_accepted(caches["mtp"], hidden, verify.seqs, verify.offsets, accepted, batch.state_slot_ids)
        caches = {**caches, "mtp": mtp}
    made = None  # a grammar-masked step's drafts for the next step (`next_drafts`)
    if drafter is not None and bitmask is not None:
        caches, made = next_drafts(drafter, params, caches, batch, verify, accepted, tokens, num_speculative_tokens)
    rewind = verify.num_draft - accepted  # [S]; padding positions: 0 (the null row)
    table = dataclasses.replace(table, num_computed=table.num_computed.at[table.step_rows[:S]].add(-rewind))
    rows, first = emitted(rows, verify, accepted)
    first = jax.tree.map(lambda a: _pad_rows(a, S_max, 0), first)  # [S_max]: the next step's prev_tokens
    # first: each sequence's first new token; drafted: the MTP's drafts [S, k] (None for host drafts);
    # made: the next step's [S, k] (None unless a grammar-masked MTP / draft-model step)
    return caches, table, rows, lax.stop_gradient(accepted), first, drafted, made


def _pad_rows(a, n: int, fill):  # [S, ...] -> [n, ...] (n >= S), `fill` past S
    return jnp.concatenate([a, jnp.full((n - a.shape[0], *a.shape[1:]), fill, a.dtype)]) if n > a.shape[0] else a


def first_rows(batch, S: int):
    """The batch with its per-sequence fields cut to the first S batch positions (the step's
    sequences: `verify.num_draft`'s rows), as the drafter and the replay read them."""
    cut = {f: getattr(batch, f)[:S] for f in ("state_slot_ids", "has_initial_state", "block_tables", "spec_rows")}
    return dataclasses.replace(batch, **{f: a for f, a in cut.items() if a is not None})


def emitted(rows, verify: VerifyRows, accepted):
    """-> (rows: the sampled rows with each sequence's emitted tokens, first: SamplerOutput [S] of
    each sequence's first new token). A sequence emits its accepted drafts, then the target's
    token (equal to the first where they match, so this only makes the acceptance rule the one
    place that decides what is output)."""
    S = verify.num_draft.shape[0]
    keep = (verify.seqs >= 0) & (verify.offsets < accepted[jnp.clip(verify.seqs, 0, S - 1)])
    tokens = jnp.where(keep, verify.drafts, rows.tokens)
    heads = jnp.where((verify.seqs >= 0) & (verify.offsets == 0), verify.seqs, S)  # padding: dropped
    rows = dataclasses.replace(rows, tokens=tokens)  # an accepted draft is the row's sample: its logprob holds
    first = jax.tree.map(lambda a: jnp.zeros((S, *a.shape[1:]), a.dtype).at[heads].set(a, mode="drop"), rows)
    return rows, first


def _caches_first(fn):
    """`fn` returning (caches, *rest) as (caches, rest): the shape the pinned outputs take."""

    @functools.wraps(fn)
    def split(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out[0], tuple(out[1:])

    return split


class VerifyExecutables:
    """`verify_backbone` compiled per token bucket, greedy or sampled, plain or "full" (penalty
    token ids at the engine's bounded widths and MAX_LOGPROBS alternatives: a step with a request
    asking for logprobs or penalties); under a mesh sharded as the plain steps."""

    def __init__(
        self, executables, caches, token_buckets: tuple[int, ...], max_top_k: int, num_speculative_tokens=0, mtp=False
    ):
        """`num_speculative_tokens`: the most drafts per sequence (k); a GDN hybrid's replay stashes k + 1 rows.
        `mtp`: the model's MTP layer drafts inside the step (`fill_drafts`); "draft_model": the draft
        model (`ex.model.draft`, models/draft_model.py) does."""
        ex = executables
        self.max_num_seqs, self.max_blocks_per_seq, self.page_size = (
            ex.max_num_seqs,
            ex.max_blocks_per_seq,
            ex.page_size,
        )
        self.window_paging = getattr(ex, "window_paging", False)
        self.full_widths = getattr(ex, "full_widths", None)  # None: penalty widths as the step needs
        self.token_buckets = tuple(token_buckets)
        # the step's sequence rows: the plain steps' sequence buckets (never past the table's rows)
        self.seq_buckets = (*(s for s in getattr(ex, "seq_buckets", ()) if s < self.max_num_seqs), self.max_num_seqs)
        fn = self._backbone(ex, max_top_k, num_speculative_tokens, mtp)
        # Under a mesh (opts.tp) as the plain steps (runtime/steps/executables.py): parameters and
        # caches in their shardings, host inputs replicated, outputs pinned (caches keep their layout).
        rep = self._replicated = ex._replicated
        # (caches, the rest): one replicated sharding covers every other output, however many
        pinned = {} if rep is None else {"out_shardings": (ex._cache_shardings, rep)}
        self._jitted = jax.jit(
            _caches_first(fn), donate_argnums=1, static_argnames=("all_greedy", "num_logprobs"), **pinned
        )
        self._params_spec = jax.tree.map(ex._specs, ex.model.params)
        self._cache_spec = ex._cache_specs
        self.executables: dict[tuple, object] = {}
        self.num_speculative_tokens = num_speculative_tokens
        # sealed: plain variants; _full_sealed: the full ones; _mask_sealed: the grammar-masked ones
        self.sealed = self._full_sealed = self._mask_sealed = False

    def _backbone(self, ex, max_top_k: int, num_speculative_tokens: int, mtp):
        """The step function compiled: `verify_backbone` with this engine's statics bound."""
        return functools.partial(
            verify_backbone,
            forward=ex.forward,
            page_size=ex.page_size,
            max_top_k=max_top_k,
            softcap=ex.model.cfg.final_logit_softcapping,
            gdn_replay=functools.partial(replay_for(ex.model.cfg), opts=ex.opts) if ex.model.cfg.is_hybrid else None,
            num_speculative_tokens=num_speculative_tokens,
            drafter=drafter_for(ex, mtp),
        )

    def step_inputs(self, table_args: tuple, reqs) -> tuple:
        """The step's inputs after (params, caches): the request table's (table, TableStep, prev_tokens)."""
        return table_args

    def _inputs_spec(self, T: int) -> tuple:
        S, rep, window = self.max_num_seqs, self._replicated, self.window_paging
        table = specs.table_spec(S, self.max_blocks_per_seq, rep, window)  # window paging: its second block table
        step = specs.table_step_spec(T, S, self.page_size, rep, 2 if window else 1)
        return table, step, specs.host_spec((S,), jnp.int32, rep)

    @staticmethod
    def _token_count(inputs: tuple) -> int:
        return inputs[1].host_tokens.shape[0]

    def seq_rows(self, num_seqs: int, T: int | None = None) -> int:
        """The sequence bucket S of a step with `num_seqs` sequences in token bucket T: the smallest
        of `seq_buckets_for(T)` that holds them (T None: of all, an upper bound on the rows)."""
        return bucket_for(num_seqs, self.seq_buckets if T is None else self.seq_buckets_for(T), "verify sequences")

    def seq_buckets_for(self, T: int) -> tuple[int, ...]:
        """The sequence buckets compiled for token bucket T: at most the bucket of min(T, max_num_seqs)
        (a sequence has a token row at least), at least that of P // (k + 1) + 1, P the next smaller
        token bucket (a step in T has > P tokens, a decoding sequence <= k + 1: a decode-only step
        gets its own smallest bucket; one with fewer sequences carries a prefill chunk, rounds up)."""
        P = max((t for t in self.token_buckets if t < T), default=0)
        low = bucket_for(min(P // (self.num_speculative_tokens + 1) + 1, self.max_num_seqs), self.seq_buckets)
        top = bucket_for(min(T, self.max_num_seqs), self.seq_buckets)
        return tuple(s for s in self.seq_buckets if low <= s <= top)

    def mask_rows(self, T: int, S: int | None = None) -> int:
        """Grammar bitmask rows in token bucket T, S sequence rows (None: max_num_seqs): k + 1 each."""
        return min(T, (S or self.max_num_seqs) * (self.num_speculative_tokens + 1))

    def _args_spec(self, T: int, S: int, widths: tuple[int, int, int, int] | None, mask_width: int = 0) -> tuple:
        i32, rep = jnp.int32, self._replicated
        row = specs.host_spec((T,), i32, rep)
        verify = VerifyRows(row, row, row, row, row, specs.host_spec((S,), i32, rep))
        penalty = None
        if widths is not None:  # (output_ids, prompt_ids, banned_ids, min_tokens, bias ids, bias values)
            wo, wp, wb, wl = widths
            ids = [specs.host_spec((S, w), i32, rep) for w in (wo, wp, wb)]
            bias = [specs.host_spec((S, wl), i32, rep), specs.host_spec((S, wl), jnp.float32, rep)]
            penalty = (*ids, specs.host_spec((S,), i32, rep), *bias)
        mask = specs.host_spec((self.mask_rows(T, S), mask_width), i32, rep) if mask_width else None
        return self._params_spec, self._cache_spec, *self._inputs_spec(T), verify, penalty, mask

    def compile(
        self, T: int, S: int, all_greedy: bool, widths: tuple | None = None, num_logprobs: int = 0, mask_width=0
    ):
        key = (T, S, all_greedy, widths, num_logprobs, mask_width)
        full = widths is not None or num_logprobs
        if self.sealed and (self._full_sealed or not full) and (self._mask_sealed or not mask_width):
            raise RuntimeError(f"verify{list(key)} was not compiled at start-up")
        exe = (
            self._jitted.trace(
                *self._args_spec(T, S, widths, mask_width), all_greedy=all_greedy, num_logprobs=num_logprobs
            )
            .lower()
            .compile()
        )
        self.executables[key] = exe
        return exe

    def full_variant(self) -> tuple[tuple[int, int, int, int] | None, int]:
        """(feature widths: output, prompt, banned, logit bias; logprobs) of the bounded full
        variant (None widths: unbounded engine)."""
        w = self.full_widths
        return (None if w is None else (w.output_ids, w.prompt_ids, w.banned_ids, w.logit_bias)), MAX_LOGPROBS

    def compile_all(self, every_variant: bool = False, mask_width: int = 0) -> None:
        """Every (T, S) pair of `seq_buckets_for`, greedy and sampled, with `every_variant` (bounded
        widths) the full variants too, with `mask_width` the grammar-masked ones (full and masked:
        with both), then sealed (no compile after start-up)."""
        t0 = time.perf_counter()
        widths, n = self.full_variant()
        full = every_variant and widths is not None
        for T in self.token_buckets:
            for S, greedy in ((S, greedy) for S in self.seq_buckets_for(T) for greedy in (True, False)):
                self.compile(T, S, greedy)
                if full:
                    self.compile(T, S, greedy, widths, n)
                if mask_width:
                    self.compile(T, S, greedy, mask_width=mask_width)
                if mask_width and full:
                    self.compile(T, S, greedy, widths, n, mask_width)
        self.sealed, self._full_sealed, self._mask_sealed = True, full, bool(mask_width)
        log.info("compiled %d verify executables in %.1fs", len(self.executables), time.perf_counter() - t0)

    def run(
        self,
        params,
        caches,
        inputs: tuple,
        verify: VerifyRows,
        all_greedy: bool,
        penalty=None,
        num_logprobs=0,
        bitmask=None,
    ):
        """`inputs`: `step_inputs`'s. `penalty`: None or the per-sequence features of `verify_sample`
        (host arrays); with bounded widths a step using them or logprobs runs the full variant
        (padded here). `bitmask`: None or the grammar masks [mask_rows(T, S), W] (a masked variant).
        The sequence bucket S is `verify.num_draft`'s length (`seq_rows`; penalty rows: S too)."""
        T, S = self._token_count(inputs), verify.num_draft.shape[0]
        if T not in self.token_buckets:
            raise BucketMiss(f"token count {T} has no verify bucket {self.token_buckets}")
        if S not in self.seq_buckets:
            raise BucketMiss(f"{S} sequence rows: no verify sequence bucket {self.seq_buckets}")
        widths, full_n = self.full_variant()
        if widths is not None and (penalty is not None or num_logprobs):
            if penalty is None:
                z = np.zeros((S, 0), np.int32)
                penalty = (z, z, z, np.zeros(S, np.int32), z, np.zeros((S, 0), np.float32))
            out_ids, prompt_ids, banned, min_tokens, bias_ids, bias_values = penalty
            wo, wp, wb, wl = widths
            pad = lambda a, w, fill=-1: np.pad(a, ((0, 0), (0, w - a.shape[1])), constant_values=fill)
            penalty = (
                pad(out_ids, wo),
                pad(prompt_ids, wp),
                pad(banned, wb),
                min_tokens,
                pad(bias_ids, wl),
                pad(bias_values, wl, 0.0),
            )
            num_logprobs = full_n
        mask_width = 0 if bitmask is None else bitmask.shape[1]
        widths = None if penalty is None else tuple(penalty[i].shape[1] for i in (0, 1, 2, 4))
        key = (T, S, all_greedy, widths, num_logprobs, mask_width)
        exe = self.executables.get(key)
        if exe is None:
            log.info("compiling verify%s (not compiled ahead of time)", list(key))
            exe = self.compile(*key)
        caches, rest = exe(params, caches, *inputs, verify, penalty, bitmask)
        return (caches, *rest)
