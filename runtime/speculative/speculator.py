"""The engine's side of speculative decoding: drafts before each schedule, the verify step, and
the accepted tokens recorded after it. Built with the engine (`build_speculator`); None when off.

    speculator.propose(scheduler.running)        # each eligible request's `draft_token_ids`
    speculator.verifies(out)                     # this step verifies (else its drafts are dropped)
    caches, table, sampled = speculator.run(params, caches, T, table_args, out)
    speculator.settle(step, scheduler, request_table)   # after the first token is resolved

A request drafts when its next token is what the verify sampler computes: logprobs (each
accepted token's raw logprobs from its own verify row), penalties (repetition, frequency,
presence: each verify row counts the output so far plus the drafts before it, the tokens a plain
step would have counted), logit bias, `min_tokens` bans (while a row's output index is below
min_tokens) and grammars (each verify row masked by the grammar's state after the drafts before
it; drafts past one the grammar rejects dropped; with the MTP or a draft model a grammar request's
drafts are the ones the last masked verify step made for its next position, `device_drafts.next_drafts`) compose; prompt logprobs do not (those requests
decode one token a step; a step carrying one verifies nothing). A step that may draft runs synchronously
(the engine settles the step in flight before drafting: drafts read the tokens so far, and a
verify step is resolved at once, its accepted tokens settled); a step where
`disable_by_batch_size` rules drafting out (`may_draft` false) keeps asynchronous scheduling. Hybrids (GDN: Qwen3.5, Qwen3-Next; KDA: Kimi
Linear; Mamba-2: Nemotron-H) verify without committing the drafts' recurrent state and replay the
accepted prefix into it inside the same compiled step (models/gdn_replay.py, models/hybrid_replay.py).
Window-aware paging composes: the drafts' K/V go to the window pool's pages too, and the window
slides only past the committed (accepted) position (the host's `num_computed_tokens`;
paged_kv/window_pages.py). Attention data parallelism speculates with `ngram`: each rank's drafts
ride in its slice of the flat batch, verified per sequence (runtime/speculative/dp_verify.py;
`disable_by_batch_size` holds per rank, the counters are summed over the ranks and split by rank in
`stats()`). Refused at start-up: KDA and Mamba-2 hybrids under a mesh or attention DP; window-aware
paging, `mtp` and `draft_model` under attention DP; and `ngram` / `draft_model` on the P/D prefill
role (the decode role speculates; `mtp` there builds no speculator: the prefill instance computes the
MTP's state and ships it, from one device; a mesh: the verify executables are sharded like the plain steps,
runtime/speculative/verify.py; `mtp` too, its layer and KV pool split as the target's, models/mtp.py).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from configs.speculative import SpeculativeConfig
from models.mamba2_config import MAMBA
from runtime.scheduled import SchedulerOutput
from runtime.speculative.device_drafts import MTP_DRAFT
from runtime.speculative.dp_verify import DataParallelVerifyExecutables
from runtime.speculative.ngram import propose_ngram
from runtime.speculative.verify import VerifyExecutables, VerifyRows
from runtime.steps.sampler import SamplerOutput
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.types import MAX_LOGPROBS

log = logging.getLogger("jaxserve.speculative")

_NO_TOP_IDS = np.zeros((0, 0), np.int32)


def propose_mtp(req, k: int) -> list[int]:
    """An MTP request's drafts before the step: k placeholders (`MTP_DRAFT`), made on the device in
    the verify step (`runtime.speculative.device_drafts.fill_drafts`); a real token here is kept (tests' oracles)."""
    return [MTP_DRAFT] * k


def can_draft(req) -> bool:
    """The verify step samples this request's tokens exactly as a plain step would: logprobs,
    penalties (each verify row counts the drafts before it), logit bias, `min_tokens` bans (a
    row's output index decides) and grammars (each verify row masked by the grammar's state
    after the drafts before it) compose; prompt logprobs do not draft."""
    return req.params.prompt_logprobs is None


def penalty_ids(reqs, S: int) -> tuple | None:
    """The per-sequence sampling features of a verify step (`verify.verify_sample`: output_ids,
    prompt_ids, banned_ids, min_tokens, logit bias ids and values; -1 padded, widths as the plain
    sampler's: runtime/steps/sampling_metadata.py), None when no request has a penalty, a logit
    bias or a ban."""
    if all(_plain(req) for req in reqs):
        return None
    meta = SamplingMetadata.from_params(
        [r.params for r in reqs],
        [r.num_output_tokens for r in reqs],
        [r.output_token_ids for r in reqs],
        [r.prompt_token_ids for r in reqs],
        pad_to=S,
        banned_ids=[r.banned_token_ids() for r in reqs],
        row_params=False,
    )
    min_tokens = np.zeros(S, np.int32)
    min_tokens[: len(reqs)] = [r.params.min_tokens for r in reqs]
    return (
        meta.output_ids,
        meta.prompt_ids,
        meta.banned_ids,
        min_tokens,
        meta.logit_bias_ids,
        meta.logit_bias_values,
    )


def _plain(req) -> bool:
    p = req.params
    no_penalty = p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
    return no_penalty and not p.logit_bias and not req.banned_token_ids()


def refusal(engine) -> str | None:
    """Why this engine cannot speculate, or None."""
    cfg = engine.model.cfg
    recurrent = cfg.kda or MAMBA in cfg.layer_types
    if recurrent and (engine.model.tp is not None or engine.dp is not None):
        return "KDA and Mamba-2 hybrids under a mesh are not supported yet (their replay runs on one device)"
    method = engine.config.speculative_config.method
    if engine.dp is not None and method != "ngram":  # draft_model: refused when its caches are built
        return f"method {method!r} under attention data parallelism is not supported yet (ngram is)"
    if engine.dp is not None and getattr(engine.executables, "window_paging", False):
        return (
            "window-aware paging under attention data parallelism is not supported yet (set cache.window_paging: false)"
        )
    kv = engine.config.kv_transfer
    if kv is not None and kv.role == "prefill" and method != "mtp":
        return (
            "the prefill role computes prompts only: set it on the decode instance (which speculates; "
            "method mtp on the prefill instance ships the MTP's state for it)"
        )
    if kv is not None and kv.role == "prefill" and engine.model.tp is not None:
        return "a P/D prefill instance ships the MTP's state from one device only (no mesh) yet"
    return None


def build_speculator(engine) -> Speculator | None:
    """The engine's speculator (None when `speculative_config` is off); ValueError naming what
    the engine's configuration cannot combine with it."""
    config: SpeculativeConfig | None = engine.config.speculative_config
    if config is None:
        return None
    why = refusal(engine)
    if why is not None:
        raise ValueError(f"speculative_config: {why}")
    if engine.config.kv_transfer is not None and engine.config.kv_transfer.role == "prefill":
        return None  # method mtp on the prefill role: its MTP state is computed and shipped (construction.computes_mtp)
    # "auto" -> the plan's measured crossover (runtime/steps/execution_plan.py)
    config = dataclasses.replace(config, disable_by_batch_size=engine.plan.spec_disable_by_batch_size)
    mtp = config.method == "mtp"
    if mtp and "mtp" not in engine.caches:
        raise ValueError("speculative_config: method 'mtp' found no MTP caches (an attention DP build)")
    if config.method == "draft_model":
        if "draft" not in engine.caches:
            raise ValueError("speculative_config: method 'draft_model' found no draft caches (a mesh or DP build)")
        mtp = "draft_model"
    if engine.dp is not None:  # the flat rank-major batch (runtime/speculative/dp_verify.py)
        ex = engine.executables
        verify = DataParallelVerifyExecutables(
            ex, engine.caches, engine.config.max_top_k, config.num_speculative_tokens, engine._rng
        )
    else:
        verify = VerifyExecutables(
            engine.executables,
            engine.caches,
            engine.token_buckets,
            engine.config.max_top_k,
            config.num_speculative_tokens,
            mtp=mtp,
        )
    if engine.plan.aot_compile:
        every = engine.config.compile_config().every_variant
        masked = engine.bitmask_width if engine.plan.grammar_samplers or every else 0  # as the plain samplers
        verify.compile_all(every_variant=every, mask_width=masked)
    return Speculator(config, verify, 1 if engine.dp is None else engine.dp.size)


class Speculator:
    def __init__(self, config: SpeculativeConfig, verify: VerifyExecutables, num_ranks: int = 1):
        self.config = config
        self.verify = verify
        self.num_ranks = num_ranks  # attention DP: `disable_by_batch_size` holds per rank
        self.rank_tokens = [[0, 0] for _ in range(num_ranks)]  # per rank: (drafted, accepted) tokens verified
        self.num_draft_tokens = 0  # drafted tokens verified (vLLM's spec_decode_num_draft_tokens)
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # verified sequences that carried drafts
        self.num_crowded_steps = 0  # schedules without drafts for `disable_by_batch_size`
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self._pending: tuple | None = None  # (out, tokens [T], accepted [S], first verify row per sequence, MTP drafts,
        # the next step's MTP drafts or None)
        self._made: dict[str, tuple[int, list[int]]] = {}  # grammar requests: (num_tokens, the MTP's next drafts)
        self._want: set[str] = set()  # grammar requests this schedule verifies for their next drafts
        self.draft_log: list | None = None  # tests: a list -> (context tokens, the MTP's drafts) per drafting sequence
        self._bitmask: np.ndarray | None = None  # the grammar masks of the step `verifies` accepted

    def stats(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_disabled_steps": self.num_crowded_steps,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            **{  # attention DP: each rank's share of the two counts above
                f"dp_rank{r}_spec_decode_num_{name}_tokens": counts[j]
                for r, counts in enumerate(self.rank_tokens if self.num_ranks > 1 else [])
                for j, name in enumerate(("draft", "accepted"))
            },
        }

    # ---- before the schedule ----------------------------------------------------------------
    def crowded(self, decoding: int) -> bool:
        """More requests decode than `disable_by_batch_size` (per rank under attention DP: D x it
        over all ranks): no drafts this step."""
        limit = self.config.disable_by_batch_size
        return limit is not None and decoding > limit * self.num_ranks

    def may_draft(self, running) -> bool:
        """Whether the next schedule may draft: the engine then settles the step in flight first."""
        decoding = [req for req in running if req.num_tokens - req.num_computed_tokens == 1]
        return not self.crowded(len(decoding)) and any(can_draft(req) for req in decoding)

    def verified(self, out) -> bool:
        """Whether `out` ran as a verify step (the engine resolves it at once)."""
        return self._pending is not None and self._pending[0] is out

    def propose(self, running) -> None:
        """Set each running request's drafts (prompt lookup over prompt + output); none at all while
        more requests decode than `disable_by_batch_size` (the adaptive rule: speculation stops
        paying in large batches)."""
        c = self.config
        decoding = [req.num_tokens - req.num_computed_tokens == 1 for req in running]
        crowded = self.crowded(sum(decoding))
        self.num_crowded_steps += bool(crowded)
        self._want = set()
        self._made = {req.request_id: self._made[req.request_id] for req in running if req.request_id in self._made}
        for req, decodes in zip(running, decoding):
            if decodes and not crowded and can_draft(req) and c.method in ("mtp", "draft_model"):
                req.draft_token_ids = propose_mtp(req, c.num_speculative_tokens)
                if req.params.structured_output is not None:  # real tokens: the grammar checks them
                    req.draft_token_ids = self._made_drafts(req, req.draft_token_ids)
                    self._want.add(req.request_id)
            elif decodes and not crowded and can_draft(req):
                tokens = np.asarray(req.all_token_ids)
                req.draft_token_ids = propose_ngram(
                    tokens, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max
                )
            else:
                req.draft_token_ids = []

    def _made_drafts(self, req, drafts: list[int]) -> list[int]:
        """A grammar request's drafts with the placeholders (`MTP_DRAFT`) replaced by the MTP's
        drafts the last verify step made for this position (`device_drafts.next_drafts`); none left
        where there are none (this step then verifies to make them)."""
        num_tokens, made = self._made.pop(req.request_id, (-1, []))
        made = made if num_tokens == req.num_tokens else []
        out = []
        for j, token in enumerate(drafts):
            if token == MTP_DRAFT and j >= len(made):
                break
            out.append(made[j] if token == MTP_DRAFT else token)
        return out

    def verifies(self, out: SchedulerOutput, grammar=None) -> bool:
        """Whether `out` runs as a verify step; if not, any drafts scheduled are dropped (their
        pages stay allocated for the tokens to come). `grammar`: the engine's
        StructuredOutputManager (or None): drafts past the first its grammar rejects are
        dropped, and the verify rows get the masks of the grammar's state after the drafts
        before them."""
        self._bitmask = None
        if grammar is not None and len(grammar):
            for seq in out.sequences:
                if seq.num_draft:
                    drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft :]
                    _drop_drafts(seq, seq.num_draft - grammar.allowed_drafts(seq.request_id, drafts))
        # a grammar request drafting with the MTP verifies with or without drafts: the masked step makes its next ones
        drafted = any(seq.num_draft or seq.request_id in self._want for seq in out.sequences)
        if drafted and all(can_draft(seq.request) for seq in out.sequences):
            if grammar is not None and len(grammar):
                rows = self.verify.mask_rows(out.num_batched_tokens, self.verify.seq_rows(len(out.sequences)))
                self._bitmask = grammar_masks(out, grammar, rows)
                if self._bitmask is None and self._want:  # no grammar active yet: the masked step, all allowed
                    self._bitmask = np.full((rows, grammar.width), -1, np.int32)
            return True
        for seq in out.sequences:
            _drop_drafts(seq, seq.num_draft)
        return False

    # ---- the step ---------------------------------------------------------------------------
    def run(self, params, caches, T: int, table_args: tuple, out: SchedulerOutput):
        """Dispatch the verify step -> (caches, table, SamplerOutput whose tokens [max_num_seqs]
        are each sequence's first new token). Its per-sequence rows (drafts, acceptance, penalty
        features) are the step's sequence bucket S (`VerifyExecutables.seq_rows`), not max_num_seqs."""
        S = self.verify.seq_rows(len(out.sequences), T)
        verify, first = verify_rows(out, T, S)
        reqs = [seq.request for seq in out.sequences]
        all_greedy = all(req.params.temperature <= 0.0 for req in reqs)
        num_logprobs = MAX_LOGPROBS if any(req.params.logprobs is not None for req in reqs) else 0
        bitmask, self._bitmask = self._bitmask, None
        if bitmask is not None:  # the rows of the step's token bucket (filled for its real rows)
            rows_t = self.verify.mask_rows(T, S)
            bitmask = np.pad(bitmask, ((0, rows_t - bitmask.shape[0]), (0, 0)), constant_values=-1)[:rows_t]
        inputs = self.verify.step_inputs(table_args, reqs)
        penalty = penalty_ids(reqs, S)
        caches, table, row_out, accepted, first_out, drafted, made = self.verify.run(
            params, caches, inputs, verify, all_greedy, penalty, num_logprobs, bitmask
        )
        self._pending = (out, row_out, accepted, first[: len(out.sequences)], drafted, made)
        if self.draft_log is not None:
            self._contexts = [tuple(req.all_token_ids) for req in reqs]
        if not num_logprobs:
            first_out = SamplerOutput(tokens=first_out.tokens, logprobs=None, top_ids=_NO_TOP_IDS, top_logprobs=None)
        return caches, table, first_out

    def settle(self, step, scheduler, request_table, grammar=None, grammar_done: list | None = None) -> None:
        """After the step's first tokens are resolved: append each sequence's accepted drafts'
        successors (the scheduler's token rule applies to each), rewind the table mirror by the
        rejected drafts, count, and hand `_emit` the extra tokens (`step.more_tokens`). With a
        `grammar` (StructuredOutputManager) each request's matcher advances over them; one that
        completes ends the tokens there and joins `grammar_done` (already there: none follow)."""
        if self._pending is None or self._pending[0] is not step.out:
            return
        out, row_out, accepted, first, drafted, made = self._pending
        self._pending = None
        if self.draft_log is not None and drafted is not None:
            drafted = np.asarray(drafted)
            self.draft_log += [
                (context, drafted[i, : seq.num_draft].tolist())
                for i, (seq, context) in enumerate(zip(out.sequences, self._contexts))
                if seq.num_draft
            ]
        tokens, accepted = np.asarray(row_out.tokens), np.asarray(accepted)
        logprobs = None
        if row_out.top_ids.shape[1]:
            logprobs = tuple(np.asarray(a) for a in (row_out.logprobs, row_out.top_ids, row_out.top_logprobs))
        placed = {row for row, _, index in step.placed if index is not None}
        ranks = [r for r, o in enumerate(getattr(out, "ranks", None) or [out]) for _ in o.sequences]
        for i, seq in enumerate(out.sequences):
            k = seq.num_draft
            if not k:
                self._keep_made(made, i, seq.request, i in placed)
                continue
            a = int(accepted[i])
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            self.rank_tokens[ranks[i]] = [self.rank_tokens[ranks[i]][0] + k, self.rank_tokens[ranks[i]][1] + a]
            for j in range(a):
                self.accepted_per_position[j] += 1
            req = seq.request
            if request_table is not None and k > a:
                request_table.rewind(req.request_id, k - a)
            if i not in placed or req.is_finished:
                continue
            more = [int(t) for t in tokens[first[i] + 1 : first[i] + a + 1]]
            if grammar is not None and grammar.has(req.request_id):
                more = _grammar_cut(grammar, req.request_id, more, grammar_done)
            step.more_tokens[i] = more[: scheduler.accept_drafts(req, more)]
            if logprobs is not None:  # rows first_i + 1 .. : the accepted tokens' own rows
                rows = slice(first[i] + 1, first[i] + 1 + len(step.more_tokens[i]))
                step.more_logprobs[i] = tuple(a[rows] for a in logprobs)
            self._keep_made(made, i, req, len(step.more_tokens[i]) == a)

    def _keep_made(self, made, i: int, req, placed: bool) -> None:
        """Keep the next drafts a masked step made for grammar request `req` (batch position `i`)
        when it goes on from the position they were made for (every accepted token taken)."""
        if made is None or req.request_id not in self._want or not placed or req.is_finished:
            return
        # draft j's step wrote K/V at most at position num_tokens - 1 + j: past the pages this
        # step allocated it read the null page (other sequences write there too), so it stops there
        pages = len(req.allocation.block_table) if req.allocation is not None else 0
        drafts = np.asarray(made)[i].tolist()
        drafts = drafts[: max(0, min(len(drafts), pages * self.verify.page_size - req.num_tokens + 1))]
        self._made[req.request_id] = (req.num_tokens, drafts)
        if self.draft_log is not None:
            self.draft_log.append((tuple(req.all_token_ids), drafts))


def verify_rows(out: SchedulerOutput, T: int, S: int) -> tuple[VerifyRows, np.ndarray]:
    """The verify rows of a step in token bucket T with S sequence rows -> (VerifyRows, the first
    verify row of each sequence): a sequence with k drafts gets k + 1 rows (its last real token,
    then its drafts), in batch order. Attention DP (`out.ranks`): rank r's tokens start at token
    row r * T / D (runtime/parallel/data_parallel.py's rank-major batch); sequences are numbered
    in the combined order."""
    rows, seqs, offsets, steps, drafts = (np.zeros(T, np.int32) for _ in range(5))
    seqs[:] = -1
    drafts[:] = -1
    num_draft = np.zeros(S, np.int32)
    first = np.zeros(S, np.int32)
    ranks = getattr(out, "ranks", None) or [out]
    i = v = 0
    for rank, rank_out in enumerate(ranks):
        token_row = rank * (T // len(ranks))
        for seq in rank_out.sequences:
            k = seq.num_draft
            token_row += seq.num_new_tokens
            last = token_row - 1 - k  # the row of the sequence's last real token
            first[i], num_draft[i] = v, k
            outputs = seq.request.num_output_tokens
            for j in range(k + 1):
                rows[v], seqs[v], offsets[v], steps[v] = last + j, i, j, outputs + j
                drafts[v] = seq.token_ids[len(seq.token_ids) - k + j] if j < k else -1
                v += 1
            i += 1
    return VerifyRows(rows, seqs, offsets, steps, drafts, num_draft), first


def _drop_drafts(seq, n: int) -> None:
    """Drop the last `n` drafts of a scheduled sequence (their pages stay allocated)."""
    if n > 0:
        seq.token_ids = seq.token_ids[: len(seq.token_ids) - n]
        seq.num_draft -= n


def grammar_masks(out: SchedulerOutput, grammar, num_rows: int) -> np.ndarray | None:
    """[num_rows, W] grammar masks of a verify step's rows (a sequence's k + 1 rows in batch
    order, as `Speculator.run` lays them out), None when no row is constrained; rows of sequences
    that sample nothing allow everything."""
    rows, v = [], 0
    for seq in out.sequences:
        if seq.sample:
            rows.append((seq.request_id, v, seq.token_ids[len(seq.token_ids) - seq.num_draft :]))
        v += seq.num_draft + 1
    return grammar.fill_drafts(rows, num_rows)


def _grammar_cut(grammar, request_id: str, more: list[int], done: list) -> list[int]:
    """The accepted tokens after the first up to the one completing the grammar (advanced over them)."""
    if request_id in done:  # the first token completed it
        return []
    for n, token in enumerate(more, 1):
        if grammar.advance(request_id, token):
            done.append(request_id)
            return more[:n]
    return more
