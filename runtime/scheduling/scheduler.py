"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

    cache = CacheConfig(page_size=16, num_pages=512).build_manager()
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), cache)
    scheduler.add_request(Request("r1", prompt_ids, params))   # ValueError if it can never fit
    while scheduler.has_unfinished():
        out = scheduler.schedule()                 # SchedulerOutput
        sampled = run_step(out)                    # {request_id: [token]} for seqs with .sample
        finished = scheduler.update_from_output(out, sampled)
    scheduler.abort(request_id)                    # any time; frees pages and slot

`schedule` and `update_from_output` (or `update_with_placeholders`) strictly alternate.

Asynchronous scheduling (the engine's default) plans step n+1 before step n's tokens reach the
host: `update_with_placeholders(out)` records step n's progress right after its dispatch and
appends a `PLACEHOLDER_TOKEN` for each sampled token, so the next `schedule` feeds it like any
decode token (the engine gathers the real one on the device); only the length rules
(`max_tokens`, `max_model_len`) can end a request then. `resolve_placeholders` writes the real
tokens once they arrive and applies the token stops (EOS, stop tokens); a request stopped
there may already be in the next step, whose token for it is then dropped (`update_*` skip
finished requests). A length finish made on a placeholder is provisional: if the real token is
a stop token the reason becomes "stop", as the synchronous order would have said. Each step, under a budget of
`max_num_batched_tokens` tokens and `max_num_seqs` running requests:

1. running requests in policy order: a decode feeds 1 token, a request still prefilling
   feeds its next chunk. When pages run out, the running request last in policy order (not
   yet scheduled this step; possibly the one asking) is preempted: everything is freed and it
   waits again, later prefilling prompt + outputs so far (recompute, from what the prefix cache
   still holds) or, with a host tier that chose to swap it out, resuming at exactly its progress
   (paged_kv/preempt_swap.py; counted: `preemption_recomputed_tokens`).
2. if nobody was preempted, waiting requests in policy order are admitted with a prefix-cache
   lookup, a first prefill chunk, pages and (hybrids) a state slot; the first that does not
   fit stops admission (no overtaking).

Requests that want prompt logprobs skip the prefix-cache lookup (vLLM's rule): every prompt
position must go through a step to be scored. A step that failed on the device is dropped with
`abandon` (its requests are ended by the caller) so the next `schedule` can run.

Prefill chunks are capped by the remaining budget and `long_prefill_token_threshold`. On
hybrid models with prefix caching, the cache's `CheckpointPolicy` cuts chunks at the
boundaries it saves (e.g. the deepest boundary an identical prompt could reuse), and a step
ending on such a boundary saves the running state into a checkpoint slot (`copy_after`).
Slot copies run on device: every `copy_before` pair before the step's forward pass, every
`copy_after` pair after it.
Plain Python, no JAX.
"""

from __future__ import annotations

import bisect

from paged_kv.cache_manager import CacheManager, PrefixHit
from paged_kv.window_pages import window_pages_per_sequence
from runtime.engine_config import SchedulerConfig
from runtime.scheduled import PLACEHOLDER_TOKEN, ScheduledSequence, SchedulerOutput
from runtime.scheduling.policies import get_policy
from runtime.scheduling.request import Request, RequestStatus
from runtime.types import FinishReason


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager):
        self.config = config
        self.cache = cache
        self.policy = get_policy(config.policy)
        self.waiting: list[Request] = []  # sorted by policy key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens preempted requests had to compute again
        self._preempted_at: dict[str, int] = {}  # preempted, waiting request -> tokens it had computed
        self._next_sequence_number = 0
        self._in_flight: SchedulerOutput | None = None

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if its id is taken or it can never fit the cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} must be new (waiting, nothing computed)")
        self.check_fits(request)
        request.sequence_number = self._next_sequence_number
        self._next_sequence_number += 1
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self.policy.key)

    def check_fits(self, request: Request) -> None:
        num_prompt, max_len = request.num_prompt_tokens, self.config.max_model_len
        if num_prompt == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if num_prompt > max_len or (num_prompt == max_len and request.params.max_tokens != 0):
            raise ValueError(
                f"request {request.request_id!r}: prompt of {num_prompt} tokens leaves no room for output "
                f"within max_model_len={max_len}"
            )
        max_total = min(request.max_total_tokens or max_len, max_len)
        pages = self.cache.pages_needed(max_total - 1)  # the last sampled token is never fed
        if pages > self.cache.num_allocatable_pages:
            raise ValueError(
                f"request {request.request_id!r}: up to {max_total} tokens need {pages} KV pages of "
                f"{self.cache.page_size} tokens, but the pool has only {self.cache.num_allocatable_pages}; "
                f"lower max_tokens or give the cache more pages"
            )
        window = self.cache.window
        if window is not None:
            chunk = min(max_total, self.config.max_num_batched_tokens)
            need = min(pages, window_pages_per_sequence(window.window, self.cache.page_size, chunk))
            if need > window.num_allocatable:
                raise ValueError(
                    f"request {request.request_id!r}: its window needs up to {need} window KV pages, "
                    f"but the window pool has only {window.num_allocatable}; give the window pool more pages"
                )

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> bool:
        """End a request wherever it is and free its resources; False if it is unknown/done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.cache.free(request_id)
            request.allocation = None
        else:
            self.waiting.remove(request)
            self.cache.drop_swap(request_id)  # a swap record of a preempted request
            self._preempted_at.pop(request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        return True

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("update_from_output() must consume the previous SchedulerOutput first")
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        for request in sorted(self.running, key=self.policy.key):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._chunk_size(request, request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            if self._grow_or_preempt(request, num_new + len(drafts), scheduled, out):
                scheduled.add(request.request_id)
                saves = len(out.copy_after)
                seq = self._schedule_chunk(request, num_new, out)
                if len(out.copy_after) > saves:  # a hybrid saves its state after this token: no drafts
                    drafts = []  # (accepted ones would move the state past the checkpoint's boundary)
                if drafts:  # speculative decoding (runtime/speculative/): verified in this step
                    seq.token_ids, seq.num_draft = seq.token_ids + drafts, len(drafts)
                out.sequences.append(seq)
                budget -= num_new + len(drafts)

        while not out.preempted_request_ids and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            admitted = self._admit(request, budget)
            if admitted is None:
                break
            admission, num_computed, num_new, external = admitted
            self.waiting.pop(0)
            request.allocation = admission.allocation
            request.num_computed_tokens = num_computed
            self.num_recomputed_tokens += max(0, self._preempted_at.pop(request.request_id, 0) - num_computed)
            if external:
                out.external_loads.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.copy_before.extend(admission.copy_before)
            out.sequences.append(self._schedule_chunk(request, num_new, out))
            budget -= num_new

        if out.sequences:
            self._in_flight = out
        return out

    def _admit(self, request: Request, budget: int):
        """-> (admission, tokens computed, tokens this step, external tokens) or None (it waits). A
        request swapped out at preemption resumes at its exact progress (paged_kv/preempt_swap.py);
        otherwise a prefix-cache lookup (none for prompt logprobs) and a first chunk."""
        tokens = request.all_token_ids
        resume = self.cache.resume_point(request.request_id)
        if resume is not None:
            num_new = self._chunk_size(request, resume[0], budget, resume[1])
            admission = self.cache.swap_in(request.request_id, tokens, resume[0] + num_new)
            if admission is not None:
                return admission, resume[0], num_new, 0
            if self.cache.resume_point(request.request_id) is not None:
                return None  # its record waits for room; otherwise it was dropped: recompute
        hit = (
            PrefixHit()
            if request.params.prompt_logprobs is not None
            else self.cache.lookup_prefix(tokens, request.cache_extra_keys)
        )
        external = self._external_tokens(request, hit)
        if external:
            hit = PrefixHit()
        num_new = self._chunk_size(request, hit.num_tokens + external, budget, hit.kv_num_tokens)
        admission = self.cache.allocate(
            request.request_id, tokens, hit.num_tokens + external + num_new, hit, request.cache_extra_keys, external
        )
        if admission is None:
            return None
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = hit.num_tokens
        return admission, hit.num_tokens + external, num_new, external

    @staticmethod
    def _external_tokens(request: Request, hit: PrefixHit) -> int:
        """P/D: prompt tokens a first admission takes from a prefill instance instead of computing
        (0 when the local prefix cache covers as much, or after a preemption: then recompute)."""
        if request.status is not RequestStatus.WAITING or request.num_external_tokens <= hit.num_tokens:
            return 0
        return request.num_external_tokens

    def _chunk_size(self, request: Request, num_computed: int, budget: int, divergence: int | None = None) -> int:
        remaining = request.num_tokens - num_computed
        num_new = min(remaining, budget)
        if remaining > 1 and self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        if remaining > 1 and self.cache.checkpoints_enabled:
            if divergence is None:
                divergence = request.allocation.divergence
            end = self.cache.checkpoint_policy.chunk_end(
                num_computed, num_computed + num_new, request.num_tokens, self.cache.page_size, divergence
            )
            num_new = end - num_computed
        return num_new

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafted tokens a decoding request feeds after its last token: within the budget,
        and never past the tokens it may still produce (the last one is never fed)."""
        if not request.draft_token_ids or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        max_total = min(request.max_total_tokens or self.config.max_model_len, self.config.max_model_len)
        room = min(budget - 1, max_total - 1 - request.num_tokens)
        return request.draft_token_ids[: max(room, 0)]

    def accept_drafts(self, request: Request, tokens: list[int]) -> int:
        """Speculative decoding, after a verify step resolved the request's first token: each
        token in `tokens` follows an accepted draft, whose KV is now computed. Appends them one by
        one under the token rule; -> how many were appended (a stop ends it early)."""
        for n, token in enumerate(tokens, 1):
            request.num_computed_tokens += 1
            request.append_output([int(token)])
            self.cache.commit(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if self._stop(request, []):
                return n
        return len(tokens)

    def _grow_or_preempt(self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Pages for `request`'s next chunk, preempting others (or itself) until they fit."""
        while not self.cache.grow(request.request_id, request.num_computed_tokens + num_new):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = self.policy.victim(candidates)
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Back to waiting: its state swapped to host (a tiered cache, by cost) or freed (recompute)."""
        self.cache.preempt(request.request_id, request.all_token_ids, request.num_computed_tokens)
        self._preempted_at[request.request_id] = request.num_computed_tokens
        self.running.remove(request)
        request.allocation = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self.policy.key)

    def _schedule_chunk(self, request: Request, num_new: int, out: SchedulerOutput) -> ScheduledSequence:
        start, tokens = request.num_computed_tokens, request.all_token_ids
        end = start + num_new
        is_prefill = request.num_tokens - start > 1
        policy = self.cache.checkpoint_policy
        where = dict(
            prefill=is_prefill,
            num_tokens=request.num_tokens,
            page_size=self.cache.page_size,
            divergence=request.allocation.divergence,
        )
        if self.cache.checkpoints_enabled and policy.saves(end, **where):
            copy = self.cache.reserve_checkpoint(
                request.request_id,
                tokens,
                end,
                rolling=policy.is_rolling(end, **where),
                last_token_known=tokens[end - 1] != PLACEHOLDER_TOKEN,
            )
            if copy is not None:
                out.copy_after.append(copy)
        return ScheduledSequence(
            request=request,
            token_ids=tokens[start:end],
            start_position=start,
            block_table=list(request.block_table),
            window_block_table=None if self.cache.window is None else list(request.allocation.window_block_table),
            state_slot=request.state_slot,
            has_initial_state=start > 0,
            sample=end == request.num_tokens,
        )

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance progress by the step's tokens, append sampled tokens, apply token-level stops.

        `sampled` holds the new token(s) of each sequence with `.sample` set. Requests aborted
        since `schedule` are skipped. Returns the requests that finished in this update.
        """
        finished = []
        for _, seq in self._advance(output):
            request = seq.request
            if seq.request_id not in sampled:
                raise ValueError(f"no sampled token for request {seq.request_id!r}, whose step ended its prefill")
            if request.params.max_tokens == 0:  # scoring only: the prompt is computed, nothing is generated
                self._stop(request, finished)
                continue
            for token in sampled[seq.request_id]:
                request.append_output([int(token)])
                if self._stop(request, finished):
                    break
        return finished

    def update_with_placeholders(self, output: SchedulerOutput) -> list[tuple[int, Request, int | None]]:
        """Asynchronous scheduling: advance progress by the step's tokens while its sampled tokens
        are still on the device, appending a placeholder for each. Returns (row, request, output
        index of its placeholder) per sampling row — index None for a scoring-only request
        (max_tokens 0), which ends here — for `resolve_placeholders`."""
        placed = []
        for row, seq in self._advance(output):
            request, index = seq.request, None
            if request.params.max_tokens != 0:
                request.append_output([PLACEHOLDER_TOKEN])
                index = request.num_output_tokens - 1
            placed.append((row, request, index))
            self._stop(request, [])  # the length rules only: the token is not known yet
        return placed

    def resolve_placeholders(self, placed: list[tuple[int, Request, int | None]], tokens) -> list[Request]:
        """Write each placeholder's real token (`tokens[row]`) and apply the token stops; returns
        the requests that finished here. A request already ended for length gets "stop" if its
        last token is a stop token (the order a synchronous step would have judged them in)."""
        finished = []
        for row, request, index in placed:
            if index is None:
                continue
            request.resolve_output(index, int(tokens[row]))
            if request.status is not RequestStatus.FINISHED:
                self._stop(request, finished)
            elif request.finish_reason == "length":
                request.finish_reason, request.stop_reason = request.stop_check(self.config.max_model_len)
        return finished

    def _advance(self, output: SchedulerOutput):
        """Record the step's progress (KV/state computed, prefix-cache commits) for every request
        still running as scheduled; yields (row, sequence) for those whose step samples."""
        self._take_in_flight(output)
        for row, seq in enumerate(output.sequences):
            request = seq.request
            if self.requests.get(seq.request_id) is not request or request.status is not RequestStatus.RUNNING:
                continue
            assert request.num_computed_tokens == seq.start_position, (request, seq.start_position)
            request.num_computed_tokens += seq.num_new_tokens - seq.num_draft
            self.cache.commit(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if seq.sample:
                yield row, seq

    def _stop(self, request: Request, finished: list[Request]) -> bool:
        """Apply the finish rule to `request` (ending it, appended to `finished`); True if it ended."""
        stop = request.stop_check(self.config.max_model_len)
        if stop is not None:
            self.finish(request.request_id, *stop)
            finished.append(request)
        return stop is not None

    def abandon(self, output: SchedulerOutput) -> list[Request]:
        """Drop a step whose execution failed: no progress is recorded, and its requests that
        are still running are returned for the caller to end (`finish(..., "error")`)."""
        if self._in_flight is output:
            self._in_flight = None
        return [
            s.request
            for s in output.sequences
            if self.requests.get(s.request_id) is s.request and s.request.status is RequestStatus.RUNNING
        ]

    def _take_in_flight(self, output: SchedulerOutput) -> None:
        if output is not self._in_flight and output.sequences:
            raise RuntimeError("this SchedulerOutput is not the one awaiting its update")
        self._in_flight = None

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            **self.cache.stats(),
            "max_checkpoint_slots": self.cache.num_checkpoint_slots or 0,  # the checkpoint budget (0: none/shared)
            "num_preemptions": self.num_preemptions,
            "preemption_recomputed_tokens": self.num_recomputed_tokens,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
        }

    def check_invariants(self) -> None:
        """The cache's accounting plus: running <=> allocated, waiting holds nothing."""
        self.cache.check_invariants()
        running_ids = {r.request_id for r in self.running}
        assert running_ids == set(self.cache.allocations), (running_ids, set(self.cache.allocations))
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.allocation is self.cache.allocations[request.request_id]
            assert len(request.block_table) >= self.cache.pages_needed(request.num_computed_tokens)
        keys = [self.policy.key(r) for r in self.waiting]
        assert keys == sorted(keys), "waiting queue out of policy order"
        for request in self.running:
            assert self.cache.resume_point(request.request_id) is None, "a running request keeps a swap record"
        assert {r.request_id for r in self.waiting if r.status is RequestStatus.PREEMPTED} >= set(self._preempted_at)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.allocation is None and request.request_id not in self.cache.allocations
        assert len(self.requests) == len(self.running) + len(self.waiting)
