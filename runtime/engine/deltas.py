"""What one request gained since its previous output: the engine's `RequestDelta`s.

The engine emits appends only (runtime/types.py): the output tokens past those already sent,
the detokenizer's text past what it handed out, the logprobs gathered since, and the prompt
logprobs once, when the prompt is fully scored (its record is then dropped). Plain host code.
"""

from __future__ import annotations

from runtime.scheduling.request import Request
from runtime.types import RequestDelta


def next_delta(engine, req: Request, finished: bool) -> RequestDelta:
    """`req`'s delta from `engine`'s per-request records (`_detok`, `_logprobs`, `_prompt_logprobs`,
    `_sent_tokens`), which it advances; the caller forgets a finished request."""
    rid = req.request_id
    detok = engine._detok.get(rid)
    if finished and detok is not None:
        detok.flush()
    resolved = req.num_resolved_output_tokens
    sent = engine._sent_tokens.get(rid, 0)
    engine._sent_tokens[rid] = resolved
    logprobs = engine._logprobs.get(rid)
    if logprobs is not None:
        engine._logprobs[rid] = []
    prompt_logprobs = engine._prompt_logprobs.finished(rid)
    if prompt_logprobs is not None:
        engine._prompt_logprobs.pop(rid)  # sent once
    return RequestDelta(
        rid,
        req.output_token_ids[sent:resolved],  # only the new tokens are copied, not the whole output
        detok.take_text(finished) if detok is not None else "",
        logprobs,
        req.finish_reason if finished else None,
        req.stop_reason if finished else None,
        num_cached_tokens=req.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )
