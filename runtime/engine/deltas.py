"""What one request gained since its previous output: the engine's `RequestDelta`s.

The engine emits appends only (runtime/types.py): the output tokens past those already sent,
the detokenizer's text past what it handed out, the logprobs gathered since, and the prompt
logprobs once, when the prompt is fully scored. Each live request has one `RequestOutputs`, its
output side, which the engine feeds sampled tokens and asks for the next delta. Plain host code.
"""

from __future__ import annotations

from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.scheduling.request import Request
from runtime.types import RequestDelta, TokenLogprob


class RequestOutputs:
    """One request's output side: its detokenizer (None without a tokenizer; it also finds the
    stop strings), the logprobs gathered since its last delta (None: not asked for), and how many
    output tokens its deltas carried so far."""

    def __init__(self, detok: IncrementalDetokenizer | None, logprobs: bool):
        self.detok = detok
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.sent_tokens = 0

    def add_token(self, token: int, logprob: TokenLogprob | None = None) -> str | None:
        """A sampled token (with its logprob, when the request asked for them); -> the stop
        string it completed, if any."""
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        return self.detok.add([token]) if self.detok is not None else None

    def next_delta(self, req: Request, finished: bool, prompt_logprobs=None) -> RequestDelta:
        """`req`'s delta since the previous one (`prompt_logprobs`: the scored prompt, passed once)."""
        if finished and self.detok is not None:
            self.detok.flush()
        sent, resolved = self.sent_tokens, req.num_resolved_output_tokens
        self.sent_tokens = resolved
        logprobs = self.logprobs
        if logprobs is not None:
            self.logprobs = []
        return RequestDelta(
            req.request_id,
            req.output_token_ids[sent:resolved],  # only the new tokens are copied, not the whole output
            self.detok.take_text(finished) if self.detok is not None else "",
            logprobs,
            req.finish_reason if finished else None,
            req.stop_reason if finished else None,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
