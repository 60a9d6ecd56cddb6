"""Attention data parallelism's scheduler: one `Scheduler` per DP rank (plain Python, no JAX).

    dp = DataParallelScheduler(scheduler_config, cache_config, size=2)
    dp.add_request(request)          # placed on a rank, where it stays
    out = dp.schedule()              # DataParallelOutput: every rank's SchedulerOutput + combined view
    dp.update_from_output(out, sampled)

Placement (tpu-inference's rule): the rank with the most prefix-cache hit tokens for the
request, then the fewest outstanding tokens, then the lowest index. Each rank schedules alone,
so a rank out of pages preempts or queues only its own requests. The device side (the step's
batch, caches and executables) is runtime/parallel/data_parallel.py.
"""

from __future__ import annotations

import dataclasses

from runtime.engine_config import CacheConfig, SchedulerConfig
from runtime.scheduled import SchedulerOutput
from runtime.scheduling.request import Request
from runtime.scheduling.scheduler import Scheduler
from runtime.types import FinishReason


# ---- scheduling ---------------------------------------------------------------------------------
@dataclasses.dataclass
class DataParallelOutput(SchedulerOutput):
    """One step of every rank. `sequences` is the ranks' sequences concatenated in rank order (the
    row order of the step's sampled tokens); `copy_before` / `copy_after` hold (rank, src, dst)
    triples of rank-local slots."""

    ranks: list[SchedulerOutput] = dataclasses.field(default_factory=list)

    @classmethod
    def combine(cls, ranks: list[SchedulerOutput]) -> DataParallelOutput:
        out = cls(ranks=ranks)
        for rank, o in enumerate(ranks):
            out.sequences += o.sequences
            out.preempted_request_ids += o.preempted_request_ids
            out.copy_before += [(rank, src, dst) for src, dst in o.copy_before]
            out.copy_after += [(rank, src, dst) for src, dst in o.copy_after]
            out.external_loads += o.external_loads
        return out


def outstanding_tokens(request: Request, max_model_len: int) -> int:
    """Tokens `request` still has to feed: the rest of its prompt (or recompute) plus the outputs
    it may still generate."""
    total = min(request.max_total_tokens or max_model_len, max_model_len)
    return max(total - request.num_computed_tokens, 0)


class DataParallelScheduler:
    """One `Scheduler` per DP rank behind the `Scheduler` interface the engine drives."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, size: int):
        if size < 1:
            raise ValueError(f"data parallel size must be >= 1, got {size}")
        self.config = config
        self.ranks = [Scheduler(config, cache_config.build_manager()) for _ in range(size)]
        self.rank_of: dict[str, int] = {}
        self._placed_rank: dict[str, int] = {}  # request id -> rank, of the step whose placeholders are out
        self.tokens_last_step = 0
        self.max_tokens_per_step = 0
        self.num_scheduled_steps = 0
        self.num_scheduled_tokens = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    # ---- requests ------------------------------------------------------------------------------
    def place(self, request: Request) -> int:
        """The rank with the most prefix-cache hit tokens for `request`, then the fewest
        outstanding tokens, then the lowest index."""

        def load(rank: int) -> tuple[int, int, int]:
            scheduler = self.ranks[rank]
            hit = scheduler.cache.hit_tokens(request.all_token_ids, request.cache_extra_keys)  # host tier too
            queued = sum(outstanding_tokens(r, self.config.max_model_len) for r in scheduler.requests.values())
            return -hit, queued, rank

        return min(range(self.size), key=load)

    def add_request(self, request: Request) -> None:
        """Queue `request` on its rank; ValueError if its id is taken, it can never fit one rank's
        pages, or it wants what DP does not serve (prompt logprobs)."""
        if request.params.prompt_logprobs is not None:
            raise ValueError(
                f"request {request.request_id!r}: prompt_logprobs is not supported with attention "
                f"data parallelism (data parallel size {self.size}); serve it with data: 1"
            )
        self._drop_finished(request.request_id)
        if request.request_id in self.rank_of:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        rank = self.place(request)
        self.ranks[rank].add_request(request)
        self.rank_of[request.request_id] = rank

    def _drop_finished(self, request_id: str) -> None:
        rank = self.rank_of.get(request_id)
        if rank is not None and request_id not in self.ranks[rank].requests:
            del self.rank_of[request_id]

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> bool:
        rank = self.rank_of.pop(request_id, None)
        return rank is not None and self.ranks[rank].finish(request_id, reason, stop_reason)

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, "abort")

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.ranks)

    @property
    def requests(self) -> dict[str, Request]:
        return {rid: r for s in self.ranks for rid, r in s.requests.items()}

    @property
    def running(self) -> list[Request]:
        """Every rank's running requests, in rank order (speculative decoding drafts for them)."""
        return [r for s in self.ranks for r in s.running]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> DataParallelOutput:
        out = DataParallelOutput.combine([s.schedule() for s in self.ranks])
        tokens = out.num_batched_tokens
        if tokens:
            self.tokens_last_step = tokens
            self.max_tokens_per_step = max(self.max_tokens_per_step, tokens)
            self.num_scheduled_steps += 1
            self.num_scheduled_tokens += tokens
        return out

    def update_from_output(self, output: DataParallelOutput, sampled: dict[str, list[int]]) -> list[Request]:
        finished = [r for s, o in zip(self.ranks, output.ranks) for r in s.update_from_output(o, sampled)]
        for request in finished:
            self.rank_of.pop(request.request_id, None)
        return finished

    def update_with_placeholders(self, output: DataParallelOutput) -> list[tuple[int, Request, int | None]]:
        """Asynchronous scheduling, per rank; rows are rows of the combined step (rank order)."""
        placed, offset, self._placed_rank = [], 0, {}
        for rank, (s, o) in enumerate(zip(self.ranks, output.ranks)):
            for row, request, index in s.update_with_placeholders(o):
                placed.append((offset + row, request, index))
                self._placed_rank[request.request_id] = rank
                if request.is_finished:  # its length ended it here: the placement goes now (else it stays)
                    self.rank_of.pop(request.request_id, None)
            offset += len(o.sequences)
        return placed

    def resolve_placeholders(self, placed: list[tuple[int, Request, int | None]], tokens) -> list[Request]:
        """Each placeholder resolved by its own rank's scheduler (which frees what a stop frees)."""
        by_rank: list[list] = [[] for _ in self.ranks]
        for entry in placed:
            by_rank[self._placed_rank.get(entry[1].request_id, 0)].append(entry)
        finished = [r for s, entries in zip(self.ranks, by_rank) for r in s.resolve_placeholders(entries, tokens)]
        for request in finished:
            self.rank_of.pop(request.request_id, None)
        return finished

    def accept_drafts(self, request: Request, tokens: list[int]) -> int:
        """Speculative decoding: `request`'s rank appends its accepted drafts' successors
        (`Scheduler.accept_drafts`); a stop among them frees the request on its rank."""
        n = self.ranks[self.rank_of[request.request_id]].accept_drafts(request, tokens)
        if request.is_finished:
            self.rank_of.pop(request.request_id, None)
        return n

    def abandon(self, output: DataParallelOutput) -> list[Request]:
        return [r for s, o in zip(self.ranks, output.ranks) for r in s.abandon(o)]

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """The ranks' counts summed (hit rate over all ranks), each rank's running / free pages,
        and tokens per step (the batch of every rank together)."""
        per_rank = [s.stats() for s in self.ranks]
        summed = {k: sum(r[k] for r in per_rank) for k in per_rank[0] if k != "prefix_cache_hit_rate"}
        queried = summed["prefix_cache_queried_tokens"]
        summed["prefix_cache_hit_rate"] = summed["prefix_cache_hit_tokens"] / queried if queried else 0.0
        for rank, r in enumerate(per_rank):
            summed[f"dp_rank{rank}_num_running"] = r["num_running"]
            summed[f"dp_rank{rank}_pages_free"] = r["pages_free"]
            if "host_cache_hits" in r:  # each rank's own host tier (cache.kv_offloading_size / data)
                summed[f"dp_rank{rank}_host_cache_hits"] = r["host_cache_hits"]
        return {
            **summed,
            "dp_size": self.size,
            "tokens_last_step": self.tokens_last_step,
            "max_tokens_per_step": self.max_tokens_per_step,
            "mean_tokens_per_step": self.num_scheduled_tokens / max(self.num_scheduled_steps, 1),
        }

    def check_invariants(self) -> None:
        for rank, scheduler in enumerate(self.ranks):
            scheduler.check_invariants()
            for rid in scheduler.requests:
                assert self.rank_of.get(rid) == rank, (rid, rank, self.rank_of.get(rid))
