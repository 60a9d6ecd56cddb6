"""LLMEngine: owns all mutable serving state and runs one iteration at a time.

    engine = LLMEngine(EngineConfig(model="/path/to/hf_dir"))
    engine.add_request(EngineRequest("r1", prompt_ids, SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for out in engine.step():   # cumulative RequestOutputs of requests that advanced
            ...

One `step()` is three verbs: `schedule` (admit pulled P/D requests, pick this step's batch),
`run` (prepare inputs -> (restore state checkpoints) -> backbone -> (save state checkpoints) ->
sample, all dispatched asynchronously) and `postprocess` (wait for the previous step's tokens,
resolve and emit them while the device runs this one, then record this step's progress).
`_finish` is the one place the engine ends a request (grammar, stop string, P/D, error, abort);
the token rule (`Request.stop_check`: EOS, stop tokens, length) ends it in the scheduler, which
frees its pages at once, and postprocess reports it. Attention data parallelism
(`build_data_parallel`) and P/D (`build_kv_transfer`, typed `KVTransferHooks`) are chosen here
when the engine is built, from the config; nothing is swapped in afterwards.

Inputs come from the device-resident request table (runtime/steps/table_host.py, table_device.py):
a running request holds a row (block-table row, tokens computed, last token, state slot) from its
placement to its finish or preemption; the host sends a small `TableStep` (rows, token counts,
known token ids, new rows' start and slot, new pages) and the `prepare` executable gathers the
`ForwardBatch` on the device. Attention DP builds its batch on the host (runtime/parallel/data_parallel.py).

Asynchronous scheduling (`async_scheduling`, default on) keeps one step in flight: step n+1 is
scheduled and dispatched before step n's tokens reach the host, with a placeholder for every
token step n samples; step n+1's `prepare` writes step n's device token array into the table's
`last_token` rows and reads the placeholders from there (DP: `runtime.steps.async_step`'s TokenFeed).
A request that step n stops (EOS, stop token, stop string) may already be in step n+1: that
one extra token is dropped (never emitted or cached; its pages are freed at the stop). A length
stop (`max_tokens`) is known without the token, so it costs nothing.
Requests whose next step needs the previous token on the host — a grammar (its bitmask) or
penalties (the token-history matrices) — make the engine wait for the step in flight before it
schedules (a synchronous step); everything else (logprobs, min_tokens bans, seeds) works on the
placeholder, and a state checkpoint saved at a decode step is hashed once its tokens are known.
With `async_scheduling=False` the engine waits for each step's tokens right after dispatching
it and commits them before the next `schedule` (the previous step's outputs are still
detokenized while the device runs).

Failures stay local: a step that raises (in input building, dispatch or on the device) ends
only the requests scheduled in it, each with an output whose `error` is set and whose
finish_reason is "error"; their pages, slots and table rows are freed (a row is reset when it
is placed again, so a failed step leaves nothing wrong behind) and the next `step()` serves the
rest. A failure that consumed the donated caches is fatal (`EngineDeadError`: nothing on the
device can be trusted any more, and the owner must exit), and so are
MAX_CONSECUTIVE_FAILED_STEPS failed steps in a row.

Prompt logprobs (`SamplingParams.prompt_logprobs`) come out of the same steps: a step carrying a
request that wants them runs the scoring backbone, which also scores every prompt row against
the next prompt token. Such requests skip the prefix cache (every position must be computed);
after a preemption the recomputed positions are not scored twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from models.model import Model
from models.ops import KernelOptions
from runtime.buckets import bucket_for, pages_for, seq_bucket
from runtime.engine.construction import prepare_model, size_cache
from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.engine.prompt_logprobs import PromptLogprobRecords, prompt_targets
from runtime.engine_config import EngineConfig
from runtime.kv_transfer.hooks import KVTransferHooks, build_kv_transfer
from runtime.parallel.data_parallel import build_data_parallel, data_parallel_size
from runtime.scheduling.request import Request, RequestStatus
from runtime.scheduling.scheduler import Scheduler, SchedulerOutput
from runtime.steps.async_step import InFlightStep, no_feed_rows
from runtime.steps.executables import StepExecutables, TokenFeed, enable_persistent_cache
from runtime.steps.execution_plan import ExecutionPlan
from runtime.steps.sampler import SamplerOutput
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_host import RequestTableHost
from runtime.structured_output import StructuredOutputManager, bitmask_width, build_compiler
from runtime.types import MAX_LOGPROBS, CompletionOutput, EngineRequest, FinishReason, RequestOutput, TokenLogprob
from runtime.validation import validate_request

log = logging.getLogger("jaxserve.engine")

_NO_TOP_IDS = np.zeros((0, 0), np.int32)


class EngineDeadError(RuntimeError):
    """A step failed after consuming the device caches: the engine cannot serve any more."""


# A step fails for good (EngineDeadError) after this many failed steps in a row: a device that
# fails every step without consuming the caches is as dead as one that lost them.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: Model | None = None,
        progress: bool = False,
        plan: ExecutionPlan | None = None,
        wrap_executables: Callable[[StepExecutables], StepExecutables] | None = None,
    ):
        """Carry out `plan` (default: `plan_execution(config, model config, backend)`): every
        execution choice is made there, none here. The config chooses the modes: attention data
        parallelism (`mesh_shape`'s data axis) and a P/D role (`kv_transfer`). `wrap_executables`
        (multi-host's leader) wraps the compiled, warmed-up executables before the first step."""
        self.config = config
        if config.compile_cache_dir:
            enable_persistent_cache(config.compile_cache_dir)
        self.model, self.plan = prepare_model(config, model, progress, plan)
        cfg = self.model.cfg
        # what actually runs: a Model another engine already unstacked stays unrolled
        self.layer_loop = "unroll" if self.model.unrolled else "scan"
        self.weight_bytes = self.model.weight_bytes()  # parameters on the device(s), scales included
        self.tokenizer = self.model.tokenizer if config.load_tokenizer else None
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        page_size = config.page_size
        self.max_blocks_per_seq = pages_for(self.max_model_len, page_size)
        dp_size = data_parallel_size(config)
        num_pages, num_slots, num_checkpoint_slots = size_cache(config, self.model, self.max_blocks_per_seq, dp_size)
        self.cache_config = config.cache_config(num_pages, self.max_model_len, num_slots, num_checkpoint_slots)
        self.scheduler_config = config.scheduler_config(self.max_model_len)
        self.opts = KernelOptions(
            attention=self.plan.attention_path, gdn=self.plan.gdn_path, interpret=config.interpret, tp=self.model.tp
        )
        caches = self.model.init_caches(
            num_pages, page_size, max(num_slots, 2), config.kv_cache_dtype, bit_storage=self.plan.kv_bit_storage
        )
        self.token_buckets = self.plan.token_buckets
        self._rng = np.random.default_rng(config.seed)  # seeds of requests that set none
        self.dp = None  # attention data parallelism (runtime/parallel/data_parallel.py): per-rank scheduling and caches
        if dp_size > 1:
            parts = build_data_parallel(
                config,
                self.model,
                self.opts,
                caches,
                size=dp_size,
                scheduler_config=self.scheduler_config,
                cache_config=self.cache_config,
                token_buckets=self.token_buckets,
                max_blocks_per_seq=self.max_blocks_per_seq,
                max_model_len=self.max_model_len,
                fuse_greedy=self.plan.fuse_greedy,
            )
            self.scheduler, self.caches, self.seq_buckets = parts.scheduler, parts.caches, parts.seq_buckets
            self.executables, self.dp = parts.executables, parts.dp
            self.request_table = self.table = None  # DP builds host batches
        else:
            self.scheduler = Scheduler(self.scheduler_config, self.cache_config.build_manager())
            self.caches, self.seq_buckets = caches, self.plan.seq_buckets
            self.executables = StepExecutables(
                self.model,
                self.caches,
                self.opts,
                token_buckets=self.token_buckets,
                seq_buckets=self.seq_buckets,
                max_num_seqs=config.max_num_seqs,
                max_blocks_per_seq=self.max_blocks_per_seq,
                max_top_k=config.max_top_k,
                fuse_greedy=self.plan.fuse_greedy,
                max_model_len=self.max_model_len,
                page_size=page_size,
            )
            # the device-resident request table (runtime/steps/table_host.py)
            self.request_table = RequestTableHost(config.max_num_seqs, page_size, self.token_buckets[-1], rng=self._rng)
            self.table = self.executables.new_table()
        # Structured output: the bitmask covers the model's logits and any tokenizer ids beyond them.
        vocab_ids = max(cfg.vocab_size, len(self.tokenizer) if self.tokenizer is not None else 0)
        self.bitmask_width = bitmask_width(vocab_ids) if self.tokenizer is not None else 0
        self._structured: StructuredOutputManager | None = None  # built on first use (the tokenizer view)
        if self.plan.aot_compile:
            masked = self.bitmask_width if self.plan.grammar_samplers or config.aot_compile_all else 0
            self.executables.compile_all(progress=progress, bitmask_width=masked, every_variant=config.aot_compile_all)
            if jax.process_count() == 1:  # multi-host: a lone warm-up step would wait on the followers
                self.caches = self.executables.warm_up(self.model.params, self.caches)
        self._eos_token_ids = tuple(cfg.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        self._prompt_logprobs = PromptLogprobRecords()
        self._requests: dict[str, Request] = {}
        self.num_steps = 0
        self._consecutive_failures = 0
        self._prev: InFlightStep | None = None  # the step whose outputs are not emitted yet
        self.async_scheduling = config.async_scheduling
        self._no_prev_tokens = np.zeros(self.executables.max_num_seqs, np.int32)  # prev_tokens of a step after none
        self.kv_transfer: KVTransferHooks | None = build_kv_transfer(  # P/D roles; None for "both"
            config.kv_transfer,
            self,
            model=self.model,
            caches=self.caches,
            cache_config=self.cache_config,
            opts=self.opts,
        )
        if wrap_executables is not None:
            self.executables = wrap_executables(self.executables)

    @property
    def structured_output(self) -> StructuredOutputManager:
        """Matchers and the step bitmask of grammar-constrained requests (its compiler is shared
        with the server, which validates grammars before a request reaches the engine)."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the tokenizer (load_tokenizer=True)")
            compiler = build_compiler(self.tokenizer, self.model.cfg.vocab_size, tuple(self.model.cfg.eos_token_ids))
            self._structured = StructuredOutputManager(compiler, max_rows=max(self.seq_buckets))
        return self._structured

    # ---- requests ---------------------------------------------------------------------------
    def validate_request(self, request: EngineRequest) -> EngineRequest:
        """The request normalised for this model; `SamplingParamsError` (a ValueError) naming the field."""
        return validate_request(request, vocab_size=self.model.cfg.vocab_size, max_model_len=self.max_model_len)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. ValueError (naming the problem) if it can never be served."""
        if self.kv_transfer is not None:
            request = self.kv_transfer.prepare(request)
        request = self.validate_request(request)
        params = request.params
        req = Request(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            priority=request.priority,
            arrival_time=request.arrival_time or time.monotonic(),
            eos_token_ids=self._eos_token_ids,
        )
        if params.structured_output is not None:  # GrammarError (a ValueError) when invalid
            self.structured_output.add(req.request_id, params.structured_output)
        try:
            if self.kv_transfer is None or not self.kv_transfer.park(req, request.kv_transfer_params):
                self.scheduler.add_request(req)
        except BaseException:
            if self._structured is not None:
                self._structured.remove(req.request_id)
            raise
        self._requests[req.request_id] = req
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        if params.logprobs is not None:
            self._logprobs[req.request_id] = []
        if params.prompt_logprobs is not None:
            self._prompt_logprobs.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is (queued, running, or parked for a P/D pull): its final
        output, or None if it is unknown or has ended already."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if self.kv_transfer is not None:
            self.kv_transfer.abort_parked(request_id)  # a pull under way is cancelled
        return self._finish(req, "abort")

    # ---- what the P/D hooks may ask (runtime.kv_transfer.hooks.EngineRequests) ---------------
    def check_fits(self, req: Request) -> None:
        self.scheduler._check_fits(req)

    def admit(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def has_scheduled(self) -> bool:
        return self.scheduler.has_unfinished()

    def finish_request(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None, *, error: str | None = None
    ) -> RequestOutput:
        return self._finish(req, reason, stop_reason, error=error)

    def adopt_token(self, req: Request, token: int) -> RequestOutput:
        """`token`, sampled elsewhere (P/D's adopt rule), as a step's would be: the token rule, then
        the stop strings, then its output."""
        req.append_output([token])
        end = req.stop_check(self.max_model_len)
        detok = self._detok.get(req.request_id)
        hit = detok.add([token]) if detok is not None else None
        if end is None and hit is not None:
            end = ("stop", hit)
        if end is not None:
            self._finish(req, *end, emit=False)
        return self._output(req, finished=req.is_finished)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._prev is not None
            or (self.kv_transfer is not None and self.kv_transfer.has_pending())
        )

    def stats(self) -> dict:
        stats = {**self.scheduler.stats(), "weight_bytes": self.weight_bytes}
        stats["table_rows_used"] = 0 if self.request_table is None else self.request_table.num_used
        return stats if self.kv_transfer is None else self.kv_transfer.stats(stats)

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run step n; then — while the device runs it — postprocess: wait for step
        n-1's tokens, resolve and emit them, and record step n's progress with placeholders
        (asynchronous scheduling) or wait for its tokens (synchronous).

        A stop found in step n-1's tokens finishes its request after step n was dispatched;
        that one extra token is discarded (the scheduler skips finished requests).
        """
        outputs, out = self.schedule()
        pending, failure = self.run(out)
        return outputs + self.postprocess(out, pending, failure)

    def schedule(self) -> tuple[list[RequestOutput], SchedulerOutput]:
        """-> (outputs of requests the P/D hooks admitted or ended, and of the step in flight if this
        schedule needs its tokens first; this step's batch)."""
        outputs = self.kv_transfer.poll() if self.kv_transfer is not None else []
        if self._prev is not None and self._must_resolve_first(self._prev):
            outputs += self._settle_prev()[0]
        return outputs, self.scheduler.schedule()

    def run(self, out: SchedulerOutput) -> tuple[tuple | None, Exception | None]:
        """Dispatch the step (nothing waits for the device): -> (its pending (sampled, scores), None),
        (None, None) for an empty step, or (None, the failure)."""
        try:
            return (None if out.is_empty else self._dispatch(out)), None
        except Exception as err:
            return None, err

    def postprocess(
        self, out: SchedulerOutput, pending: tuple | None, failure: Exception | None
    ) -> list[RequestOutput]:
        """Settle the step in flight (its tokens, stops and outputs), then record this one's progress;
        a failure ends the failed step's requests (`_fail_step`)."""
        outputs = []
        if self._prev is not None:
            settled, prev_failure = self._settle_prev()
            outputs += settled
            if pending is not None and failure is None:
                failure = prev_failure  # this step ran on the failed step's caches and tokens
        if pending is not None and failure is None:
            try:
                self._prev = self._record(out, pending)
            except Exception as err:
                failure = err
        if failure is not None:
            outputs += self._fail_step(out, failure)
        elif not out.is_empty:
            self._consecutive_failures = 0
        if self.request_table is not None:
            self.request_table.sweep()  # rows of requests ended in this step are free when idle
        return outputs

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        stop_reason: int | str | None = None,
        *,
        error: str | None = None,
        emit: bool = True,
    ) -> RequestOutput | None:
        """End `req`: the scheduler frees its pages and state slot and records the reasons (a
        request it does not hold, parked for a P/D pull, is marked here). With `emit`, its final
        output (`error` set); without, the step's `_emit` reports it."""
        if not req.is_finished and not self.scheduler.finish(req.request_id, reason, stop_reason):
            req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, reason, stop_reason
        if not emit:
            return None
        output = self._output(req, finished=True)
        if error is not None:
            output.error = error
        return output

    def _must_resolve_first(self, prev: InFlightStep) -> bool:
        """Whether the next schedule needs the in-flight step's tokens on the host (see the module doc)."""
        if prev.resolved:
            return False
        for _, req, index in prev.placed:
            if index is None or req.is_finished:
                continue
            p = req.params
            if (
                p.structured_output is not None
                or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0
            ):
                return True
        return False

    def _record(self, out: SchedulerOutput, pending) -> InFlightStep:
        """Step n's progress into the scheduler (placeholders for its tokens); synchronous
        scheduling resolves them at once."""
        sampled, scores = pending
        step = InFlightStep(out, sampled, scores, self.scheduler.update_with_placeholders(out))
        if not self.async_scheduling:
            self._resolve(step)
        return step

    def _settle_prev(self) -> tuple[list[RequestOutput], Exception | None]:
        """Resolve and emit the step in flight: (outputs, None), or — if it failed on the device —
        the error outputs of its requests and the failure."""
        prev, self._prev = self._prev, None
        try:
            self._resolve(prev)
        except Exception as err:
            return self._fail_step(prev.out, err), err
        return self._emit(prev), None

    def _fail_step(self, out: SchedulerOutput, err: Exception) -> list[RequestOutput]:
        """End the requests of a failed step with an error output each; raise EngineDeadError
        if the failure took the device caches with it."""
        log.error(
            "engine step %d failed (%s: %s); failing its %d requests",
            self.num_steps,
            type(err).__name__,
            err,
            len(out.sequences),
            exc_info=err,
        )
        error = f"the engine step failed ({type(err).__name__})"
        outputs = [self._finish(req, "error", error=error) for req in self.scheduler.abandon(out)]
        if self.request_table is not None:
            self.request_table.sweep()
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            raise EngineDeadError(f"step failed after consuming the KV/state caches: {err}") from err
        self._consecutive_failures += 1
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineDeadError(f"{self._consecutive_failures} steps in a row failed, the last with: {err}") from err
        return outputs

    def _table_inputs(self, out: SchedulerOutput) -> tuple[int, tuple, np.ndarray | None]:
        """-> (token bucket T, (table, TableStep, prev_tokens) for the request table's prepare,
        prompt-logprob targets or None). A scoring step takes the largest bucket (one executable)."""
        ex, T_max = self.executables, self.token_buckets[-1]
        T = bucket_for(max(out.num_batched_tokens, len(out.sequences)), self.token_buckets, "token count")
        targets = prompt_targets(out, T_max)
        T = T_max if targets is not None else T
        step, writes = self.request_table.plan(out, T)
        table = self.table
        for write in writes:  # page writes beyond the step's own (placements with long prefix hits)
            table = ex.run_write_table(table, write)
        prev_tokens = self._no_prev_tokens if self._prev is None else self._prev.sampled.tokens
        return T, (table, step, prev_tokens), targets

    def _token_feed(self, out: SchedulerOutput, batch) -> TokenFeed:
        """Attention DP: where `out`'s placeholder rows read their tokens (the in-flight step's device array)."""
        prev, num_token_rows = self._prev, batch.input_ids.shape[0]
        if prev is None or prev.resolved:
            return TokenFeed(self._no_prev_tokens, no_feed_rows(num_token_rows))
        return TokenFeed(prev.sampled.tokens, prev.feed_rows(out, num_token_rows, batch.logits_indices))

    def _dispatch(self, out: SchedulerOutput):
        """Enqueue the step's executables: with the request table, one backbone with prepare fused
        in (a scoring step: prepare, then the scoring backbone); attention DP: a host-built batch
        and its TokenFeed. Then the sampler unless the greedy backbone sampled already."""
        self.num_steps += 1
        ex, params = self.executables, self.model.params
        reqs = [s.request for s in out.sequences]
        if self.dp is not None:
            batch = self.dp.build_batch(out)
            T, targets = batch.input_ids.shape[0], prompt_targets(out, batch.input_ids.shape[0])
        else:
            T, table_args, targets = self._table_inputs(out)
        plain_greedy = targets is None and T in ex.greedy_buckets and all(self._plain_greedy(r) for r in reqs)
        if out.copy_before:
            self.caches = ex.copy_states(self.caches, out.copy_before)
        if self.kv_transfer is not None:
            self.caches = self.kv_transfer.load(self.caches, out)
        scores = None
        if targets is not None:
            if self.dp is None:
                self.table, batch = ex.run_prepare(*table_args)
            self.caches, result, scores = ex.run_scoring_backbone(params, self.caches, batch, targets)
        elif self.dp is not None:
            feed = self._token_feed(out, batch)
            run = ex.run_greedy_backbone if plain_greedy else ex.run_backbone
            self.caches, result = run(params, self.caches, batch, feed)
        else:
            run = ex.run_table_greedy_backbone if plain_greedy else ex.run_table_backbone
            self.caches, self.table, result = run(params, self.caches, *table_args)
        if self.kv_transfer is not None:
            self.kv_transfer.capture(self.caches, out)
        if out.copy_after:
            self.caches = ex.copy_states(self.caches, out.copy_after)
        if plain_greedy:  # the backbone's result: the sampled tokens; otherwise the hidden states
            return SamplerOutput(tokens=result, logprobs=None, top_ids=_NO_TOP_IDS, top_logprobs=None), None
        n_logprobs = MAX_LOGPROBS if any(r.params.logprobs is not None for r in reqs) else 0
        S = seq_bucket(len(reqs), self.seq_buckets)
        # The device runs the backbone now; the grammar masks are filled meanwhile.
        bitmask = None
        if self._structured is not None and len(self._structured):
            bitmask = self._structured.fill([s.request_id if s.sample else None for s in out.sequences], S)
        meta = SamplingMetadata.from_params(
            [r.params for r in reqs],
            [r.num_output_tokens for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.prompt_token_ids for r in reqs],
            pad_to=S,
            rng=self._rng,
            banned_ids=[r.banned_token_ids() for r in reqs],
            row_params=not ex.row_params_in_table,
        )
        all_greedy = all(r.params.temperature <= 0.0 for r in reqs)
        return ex.run_sampler(params, result, meta, n_logprobs, all_greedy, bitmask, self.table), scores

    @staticmethod
    def _plain_greedy(req: Request) -> bool:
        """Argmax of the raw logits is this request's next token: the fused greedy backbone applies."""
        p = req.params
        return (
            p.temperature <= 0.0
            and p.logprobs is None
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0
            and not p.logit_bias
            and p.structured_output is None
            and not req.banned_token_ids()
        )

    def _resolve(self, step: InFlightStep) -> None:
        """Wait for the step's tokens; write them over its placeholders and apply the token stops
        (EOS, stop tokens, a completed grammar)."""
        if step.resolved:
            return
        step.resolve()  # the only wait on the device
        if step.scores is not None:
            self._prompt_logprobs.record(step.out, step.scores)
        grammar_done = []
        if self._structured is not None and len(self._structured):
            grammar_done = [
                req.request_id
                for row, req, index in step.placed
                if index is not None and self._structured.advance(req.request_id, int(step.tokens[row]))
            ]
        self.scheduler.resolve_placeholders(step.placed, step.tokens)
        for rid in grammar_done:  # the grammar is complete: nothing but the end may follow
            req = self._requests.get(rid)
            if req is not None:
                self._finish(req, "stop", emit=False)

    def _emit(self, step: InFlightStep) -> list[RequestOutput]:
        outputs = []
        for row, req, index in step.placed:
            if req.request_id not in self._requests:
                continue
            if index is None:  # scored, nothing sampled
                outputs.append(self._output(req, finished=req.is_finished))
                continue
            token = int(step.tokens[row])
            if req.request_id in self._logprobs:
                lp, top_ids, top_lp = step.logprobs
                n = req.params.logprobs
                self._logprobs[req.request_id].append(
                    TokenLogprob(
                        token, float(lp[row]), [(int(t), float(v)) for t, v in zip(top_ids[row, :n], top_lp[row, :n])]
                    )
                )
            detok = self._detok.get(req.request_id)
            if detok is not None:
                hit = detok.add([token])
                if hit is not None and not req.is_finished:
                    self.scheduler.finish(req.request_id, "stop", hit)
            outputs.append(self._output(req, finished=req.is_finished))
        return outputs

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        if finished and detok is not None:
            detok.flush()
        completion = CompletionOutput(
            index=0,
            token_ids=req.resolved_output_token_ids,
            text=detok.visible_text(finished) if detok else "",
            logprobs=list(self._logprobs[req.request_id]) if req.request_id in self._logprobs else None,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )
        output = RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            [completion],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs.finished(req.request_id),
        )
        if finished and self.kv_transfer is not None:
            output.kv_transfer_params = self.kv_transfer.finished(req)
        if finished:
            if self._structured is not None:
                self._structured.remove(req.request_id)
            self._requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
            self._logprobs.pop(req.request_id, None)
            self._prompt_logprobs.pop(req.request_id)
        return output
