"""LLMEngine: owns all mutable serving state and runs one iteration at a time.

    engine = LLMEngine(EngineConfig(model="/path/to/hf_dir"))
    engine.add_request(EngineRequest("r1", prompt_ids, SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for delta in engine.step():   # a RequestDelta per request that advanced (runtime/types.py)
            ...

One `step()` is three verbs: `schedule` (admit pulled P/D requests, pick this step's batch),
`run` (prepare inputs -> (restore state checkpoints) -> backbone -> (save state checkpoints) ->
sample, all dispatched asynchronously) and `postprocess` (wait for the previous step's tokens,
resolve and emit them while the device runs this one, then record this step's progress).
`_finish` ends what the engine ends (grammar, stop strings, P/D, error, abort);
the token rule (`Request.stop_check`: EOS, stop tokens, length) ends it in the scheduler, which
frees its pages at once, and postprocess reports it. Attention data parallelism
(`build_data_parallel`) and P/D (`build_kv_transfer`, typed `KVTransferHooks`) are chosen here
when the engine is built, from the config; nothing is swapped in afterwards.

A step's inputs (the device-resident request table, or attention DP's host-built batch), its
sampler inputs and prompt logprobs: runtime/engine/step_inputs.py.

Asynchronous scheduling (one step in flight, and when the next schedule waits for it) and failures
(local to their step; `EngineDeadError` when the device caches are lost): runtime/engine/postprocess.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from models.model import Model
from runtime.engine.construction import build_step_parts, prepare_model
from runtime.engine.deltas import RequestOutputs
from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.engine.host_tier import build_host_tier
from runtime.engine.postprocess import EngineDeadError, check_step_failure, log_step_failure, needs_host_tokens
from runtime.engine.prompt_logprobs import PromptLogprobRecords, prompt_targets
from runtime.engine.step_inputs import plain_greedy, sampler_inputs, table_inputs, token_feed
from runtime.engine_config import EngineConfig
from runtime.kv_transfer.hooks import KVTransferHooks, build_kv_transfer
from runtime.scheduled import SchedulerOutput
from runtime.scheduling.request import Request, RequestStatus
from runtime.speculative.speculator import build_speculator
from runtime.steps.async_step import InFlightStep
from runtime.steps.executables import StepExecutables, enable_persistent_cache
from runtime.steps.execution_plan import ExecutionPlan
from runtime.steps.sampler import SamplerOutput
from runtime.structured_output import StructuredOutputManager, bitmask_width, build_compiler
from runtime.types import EngineRequest, FinishReason, RequestDelta, TokenLogprob
from runtime.validation import validate_request

__all__ = ["EngineDeadError", "LLMEngine"]  # EngineDeadError: runtime/engine/postprocess.py, re-exported

log = logging.getLogger("jaxserve.engine")

_NO_TOP_IDS = np.zeros((0, 0), np.int32)


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
        compile_ = config.compile_config()
        if compile_.cache_dir:
            enable_persistent_cache(compile_.cache_dir)
        self.model, self.plan = prepare_model(config, model, progress, plan)
        cfg = self.model.cfg
        # what actually runs: a Model another engine already unstacked stays unrolled
        self.layer_loop = "unroll" if self.model.unrolled else "scan"
        self.weight_bytes = self.model.weight_bytes()  # parameters on the device(s), scales included
        self.tokenizer = self.model.tokenizer if config.load_tokenizer else None
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self._rng = np.random.default_rng(config.seed)  # seeds of requests that set none
        parts = build_step_parts(config, self.model, self.plan, max_model_len=self.max_model_len, rng=self._rng)
        self.max_blocks_per_seq, self.cache_config, self.opts = parts.max_blocks_per_seq, parts.cache_config, parts.opts
        self.scheduler_config, self.scheduler = parts.scheduler_config, parts.scheduler
        self.caches, self.executables, self.table = parts.caches, parts.executables, parts.table
        self.token_buckets, self.seq_buckets = self.plan.token_buckets, parts.seq_buckets
        self.request_table = parts.request_table  # None under attention DP, which builds host batches
        self.dp = parts.dp  # attention data parallelism (runtime/parallel/data_parallel.py)
        # Structured output: the bitmask covers the model's logits and any tokenizer ids beyond them.
        vocab_ids = max(cfg.vocab_size, len(self.tokenizer) if self.tokenizer is not None else 0)
        self.bitmask_width = bitmask_width(vocab_ids) if self.tokenizer is not None else 0
        self._structured: StructuredOutputManager | None = None  # built on first use (the tokenizer view)
        if self.plan.aot_compile:
            masked = self.bitmask_width if self.plan.grammar_samplers or compile_.every_variant else 0
            self.executables.compile_all(progress=progress, bitmask_width=masked, every_variant=compile_.every_variant)
            if jax.process_count() == 1:  # multi-host: a lone warm-up step would wait on the followers
                self.caches = self.executables.warm_up(self.model.params, self.caches)
        self._eos_token_ids = tuple(cfg.eos_token_ids)
        self._outputs: dict[str, RequestOutputs] = {}  # each live request's output side (deltas.py)
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
        self.speculator = build_speculator(self)  # None unless speculative_config (runtime/speculative/)
        self.host_tier = build_host_tier(self)  # cache.kv_offloading_size (runtime/engine/host_tier.py)
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
        request = request if request.validated else self.validate_request(request)  # the server's is checked
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
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        self._outputs[req.request_id] = RequestOutputs(detok, logprobs=params.logprobs is not None)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs.add(req)

    def abort(self, request_id: str) -> RequestDelta | None:
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
        self.scheduler.check_fits(req)

    def admit(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def has_scheduled(self) -> bool:
        return self.scheduler.has_unfinished()

    def finish_request(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None, *, error: str | None = None
    ) -> RequestDelta:
        return self._finish(req, reason, stop_reason, error=error)

    def adopt_token(self, req: Request, token: int) -> RequestDelta:
        """`token`, sampled elsewhere (P/D's adopt rule), as a step's would be: the token rule, then
        the stop strings, then its output."""
        req.append_output([token])
        end = req.stop_check(self.max_model_len)
        outputs = self._outputs.get(req.request_id)
        hit = outputs.add_token(token) if outputs is not None else None
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
        for part in (self.speculator, self.host_tier):  # runtime/speculative/, runtime/engine/host_tier.py
            stats.update(part.stats() if part is not None else {})
        return stats if self.kv_transfer is None else self.kv_transfer.stats(stats)

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule and dispatch step n; then — while the device runs it — wait for step n-1's
        tokens, resolve and emit them; finally record step n's progress with placeholders
        (asynchronous scheduling) or wait for its tokens (synchronous).

        A stop found in step n-1's tokens finishes its request after step n was dispatched;
        that one extra token is discarded (the scheduler skips finished requests).
        """
        outputs, out = self.schedule()
        pending, failure = self.run(out)
        return outputs + self.postprocess(out, pending, failure)

    def schedule(self) -> tuple[list[RequestDelta], SchedulerOutput]:
        """-> (outputs of requests the P/D hooks admitted or ended, and of the step in flight if this
        schedule needs its tokens first; this step's batch)."""
        outputs = self.kv_transfer.poll() if self.kv_transfer is not None else []
        if self._prev is not None and needs_host_tokens(self._prev):
            outputs += self._settle_prev()[0]
        if self.speculator is not None:  # drafts read the tokens so far; none above disable_by_batch_size
            if self._prev is not None and not self._prev.resolved and self.speculator.may_draft(self.scheduler.running):
                outputs += self._settle_prev()[0]
            self.speculator.propose(self.scheduler.running)
        return outputs, self.scheduler.schedule()

    def run(self, out: SchedulerOutput) -> tuple[tuple | None, Exception | None]:
        """Dispatch the step (nothing waits for the device): -> (its pending (sampled, scores), None),
        (None, None) for an empty step, or (None, the failure)."""
        try:
            return (None if out.is_empty else self._dispatch(out)), None
        except Exception as err:
            return None, err

    def postprocess(self, out: SchedulerOutput, pending: tuple | None, failure: Exception | None) -> list[RequestDelta]:
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
    ) -> RequestDelta | None:
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

    def _record(self, out: SchedulerOutput, pending) -> InFlightStep:
        """Step n's progress into the scheduler (placeholders for its tokens); synchronous
        scheduling resolves them at once."""
        sampled, scores = pending
        step = InFlightStep(out, sampled, scores, self.scheduler.update_with_placeholders(out))
        if not self.async_scheduling or (self.speculator is not None and self.speculator.verified(out)):
            self._resolve(step)
        return step

    def _settle_prev(self) -> tuple[list[RequestDelta], Exception | None]:
        """Resolve and emit the step in flight: (outputs, None), or — if it failed on the device —
        the error outputs of its requests and the failure."""
        prev, self._prev = self._prev, None
        try:
            self._resolve(prev)
        except Exception as err:
            return self._fail_step(prev.out, err), err
        return self._emit(prev), None

    def _fail_step(self, out: SchedulerOutput, err: Exception) -> list[RequestDelta]:
        """End the requests of a failed step with an error output each; EngineDeadError if the
        engine cannot go on (runtime/engine/postprocess.py)."""
        log_step_failure(err, self.num_steps, len(out.sequences))
        error = f"the engine step failed ({type(err).__name__})"
        outputs = [self._finish(req, "error", error=error) for req in self.scheduler.abandon(out)]
        if self.request_table is not None:
            self.request_table.sweep()
        self._consecutive_failures += 1
        check_step_failure(err, self.caches, self._consecutive_failures)
        return outputs

    def _dispatch(self, out: SchedulerOutput):
        """Enqueue the step's executables: with the request table, one backbone with prepare fused
        in (a scoring step: prepare, then the scoring backbone); attention DP: a host-built batch
        and its TokenFeed. Then the sampler unless the greedy backbone sampled already."""
        self.num_steps += 1
        ex, params = self.executables, self.model.params
        reqs = [s.request for s in out.sequences]
        speculate = self.speculator is not None and self.speculator.verifies(out, self._structured)
        self.caches = self.caches if self.host_tier is None else self.host_tier.run(self.caches)  # before any copy
        if self.dp is not None:
            batch = self.dp.build_batch(out)
            T, targets = batch.input_ids.shape[0], prompt_targets(out, batch.input_ids.shape[0])
        else:
            prev_tokens = self._no_prev_tokens if self._prev is None else self._prev.sampled.tokens
            T, table_args, targets = table_inputs(
                out, ex, self.request_table, self.table, self.token_buckets, prev_tokens
            )
        greedy = targets is None and T in ex.greedy_buckets and all(plain_greedy(r) for r in reqs)
        if out.copy_before:
            self.caches = ex.copy_states(self.caches, out.copy_before)
        if self.kv_transfer is not None:  # P/D: pulled state written before the step reads it
            self.caches = self.kv_transfer.load(self.caches, out)
        if speculate:  # a hybrid's checkpoints: never a drafting sequence's (Scheduler._drafts)
            inputs = batch if self.dp is not None else table_args  # attention DP: the host-built batch
            self.caches, self.table, sampled = self.speculator.run(params, self.caches, T, inputs, out)
            if out.copy_after:
                self.caches = ex.copy_states(self.caches, out.copy_after)
            return sampled, None
        scores = None
        if targets is not None:
            if self.dp is None:
                self.table, batch = ex.run_prepare(*table_args)
            self.caches, result, scores = ex.run_scoring_backbone(params, self.caches, batch, targets)
        elif self.dp is not None:
            feed = token_feed(self._prev, out, batch, self._no_prev_tokens)
            run = ex.run_greedy_backbone if greedy else ex.run_backbone
            self.caches, result = run(params, self.caches, batch, feed)
        else:
            run = ex.run_table_greedy_backbone if greedy else ex.run_table_backbone
            self.caches, self.table, result = run(params, self.caches, *table_args)
        if self.kv_transfer is not None:
            self.kv_transfer.capture(self.caches, out)
        if out.copy_after:
            self.caches = ex.copy_states(self.caches, out.copy_after)
        if greedy:  # the backbone's result: the sampled tokens; otherwise the hidden states
            return SamplerOutput(tokens=result, logprobs=None, top_ids=_NO_TOP_IDS, top_logprobs=None), None
        # The device runs the backbone now; the grammar masks are filled meanwhile.
        meta, n_logprobs, all_greedy, bitmask = sampler_inputs(
            out, self.seq_buckets, self._structured, self._rng, not ex.row_params_in_table
        )
        return ex.run_sampler(params, result, meta, n_logprobs, all_greedy, bitmask, self.table), scores

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
        if self.speculator is not None:  # a verify step's accepted tokens after the first
            self.speculator.settle(step, self.scheduler, self.request_table, self._structured, grammar_done)
        for rid in grammar_done:  # the grammar is complete: nothing but the end may follow
            req = self._requests.get(rid)
            if req is not None:
                self._finish(req, "stop", emit=False)

    def _emit(self, step: InFlightStep) -> list[RequestDelta]:
        outputs = []
        for row, req, index in step.placed:
            if req.request_id not in self._requests:
                continue
            if index is None:  # scored, nothing sampled
                outputs.append(self._output(req, finished=req.is_finished))
                continue
            record = self._outputs.get(req.request_id)
            tokens = step.row_tokens(row) if record is not None else []
            for m, token in enumerate(tokens, 1):
                logprob = None
                if record.logprobs is not None:
                    lp, top_ids, top_lp = step.token_logprobs(row, m - 1)
                    n = req.params.logprobs
                    top = [(int(t), float(v)) for t, v in zip(top_ids[:n], top_lp[:n])]
                    logprob = TokenLogprob(token, float(lp), top)
                hit = record.add_token(token, logprob)
                if hit is not None:
                    if not req.is_finished:
                        self._finish(req, "stop", hit, emit=False)
                    req.drop_last_outputs(len(tokens) - m)  # accepted drafts past the stop string
                    break
            outputs.append(self._output(req, finished=req.is_finished))
        return outputs

    def _output(self, req: Request, finished: bool) -> RequestDelta:
        """What `req` gained since its previous delta (runtime/engine/deltas.py); a finished one is forgotten."""
        rid = req.request_id
        prompt_logprobs = self._prompt_logprobs.finished(rid)
        if prompt_logprobs is not None:
            self._prompt_logprobs.pop(rid)  # sent once
        record = self._outputs.get(rid) or RequestOutputs(None, logprobs=False)
        delta = record.next_delta(req, finished, prompt_logprobs)
        if finished and self.kv_transfer is not None:
            delta.kv_transfer_params = self.kv_transfer.finished(req)
        if finished:
            if self._structured is not None:
                self._structured.remove(req.request_id)
            self._requests.pop(req.request_id, None)
            self._outputs.pop(rid, None)
            self._prompt_logprobs.pop(rid)
        return delta
