"""What one engine step is dispatched with, worked out on the host (`LLMEngine.run` calls these):
the request table's inputs and the token bucket, the placeholder feed of a host-built batch, the
sampler's inputs, and whether the fused greedy backbone applies (`plain_greedy`).

Inputs come from the device-resident request table (runtime/steps/table_host.py, table_device.py):
a running request holds a row (block-table row, tokens computed, last token, state slot) from its
placement to its finish or preemption; the host sends a small `TableStep` (rows, token counts,
known token ids, new rows' start and slot, new pages) and the `prepare` executable gathers the
`ForwardBatch` on the device. Attention DP builds its batch on the host (runtime/parallel/data_parallel.py)
and its placeholders read the in-flight step's tokens through a `TokenFeed`.

Prompt logprobs (`SamplingParams.prompt_logprobs`) come out of the same steps: a step carrying a
request that wants them runs the scoring backbone in the largest token bucket, which also scores
every prompt row against the next prompt token. Such requests skip the prefix cache (every
position must be computed); after a preemption the recomputed positions are not scored twice.
"""

from __future__ import annotations

import numpy as np

from runtime.buckets import bucket_for, seq_bucket
from runtime.engine.prompt_logprobs import prompt_targets
from runtime.scheduled import SchedulerOutput
from runtime.scheduling.request import Request
from runtime.steps.async_step import InFlightStep, no_feed_rows
from runtime.steps.executables import StepExecutables, TokenFeed
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_host import RequestTableHost
from runtime.structured_output import StructuredOutputManager
from runtime.types import MAX_LOGPROBS


def table_inputs(
    out: SchedulerOutput,
    executables: StepExecutables,
    request_table: RequestTableHost,
    table,
    token_buckets: tuple[int, ...],
    prev_tokens,
) -> tuple[int, tuple, np.ndarray | None]:
    """-> (token bucket T, (table, TableStep, prev_tokens) for the request table's prepare,
    prompt-logprob targets or None). A scoring step takes the largest bucket (one executable)."""
    T_max = token_buckets[-1]
    T = bucket_for(max(out.num_batched_tokens, len(out.sequences)), token_buckets, "token count")
    targets = prompt_targets(out, T_max)
    T = T_max if targets is not None else T
    step, writes = request_table.plan(out, T)
    for write in writes:  # page writes beyond the step's own (placements with long prefix hits)
        table = executables.run_write_table(table, write)
    return T, (table, step, prev_tokens), targets


def token_feed(prev: InFlightStep | None, out: SchedulerOutput, batch, no_prev_tokens) -> TokenFeed:
    """Attention DP: where `out`'s placeholder rows read their tokens (the in-flight step's device array)."""
    num_token_rows = batch.input_ids.shape[0]
    if prev is None or prev.resolved:
        return TokenFeed(no_prev_tokens, no_feed_rows(num_token_rows))
    return TokenFeed(prev.sampled.tokens, prev.feed_rows(out, num_token_rows, batch.logits_indices))


def sampler_inputs(
    out: SchedulerOutput,
    seq_buckets: tuple[int, ...],
    structured: StructuredOutputManager | None,
    rng: np.random.Generator,
    row_params: bool,
) -> tuple[SamplingMetadata, int, bool, np.ndarray | None]:
    """-> (sampling metadata padded to the sequence bucket, logprobs to return, all greedy, the
    grammar bitmask or None); called while the device runs the backbone."""
    reqs = [s.request for s in out.sequences]
    n_logprobs = MAX_LOGPROBS if any(r.params.logprobs is not None for r in reqs) else 0
    S = seq_bucket(len(reqs), seq_buckets)
    bitmask = None
    if structured is not None and len(structured):
        bitmask = structured.fill([s.request_id if s.sample else None for s in out.sequences], S)
    meta = SamplingMetadata.from_params(
        [r.params for r in reqs],
        [r.num_output_tokens for r in reqs],
        [r.output_token_ids for r in reqs],
        [r.prompt_token_ids for r in reqs],
        pad_to=S,
        rng=rng,
        banned_ids=[r.banned_token_ids() for r in reqs],
        row_params=row_params,
    )
    return meta, n_logprobs, all(r.params.temperature <= 0.0 for r in reqs), bitmask


def plain_greedy(req: Request) -> bool:
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
