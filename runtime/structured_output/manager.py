"""The engine's side of structured output: one matcher per request, one bitmask per step.

`StructuredOutputManager` holds each grammar-constrained request's matcher and a host bitmask
preallocated for the largest sequence bucket (`[max_rows, ceil(V/32)]` int32). Per step:

* `fill(rows, num_rows)` — called while the device runs the step's backbone — writes, in place,
  the allowed-token row of every sampled sequence under an active grammar and all ones for
  every other row, and returns the `[num_rows, W]` view the sampler takes (None when no row in
  the step has an active grammar: the step then runs the unmasked sampler);
* `advance(request_id, token)` — when the step's tokens arrive — feeds the token to the
  matcher and says whether the grammar is complete (the request finishes with "stop").

A grammar with `start_after` (the end of a reasoning block) stays inactive until those token
ids have appeared at the end of the output. Pure host code; the sampler unpacks the bits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from runtime.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_width
from runtime.structured_output.compiler import GrammarCompiler
from runtime.types import StructuredOutput

log = logging.getLogger("jaxserve.structured_output")


@dataclass
class _RequestGrammar:
    matcher: GrammarMatcher
    start_after: tuple[int, ...]
    active: bool
    recent: list[int] = field(default_factory=list)  # tail of the output, to spot start_after


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, max_rows: int):
        self.compiler = compiler
        self.backend: GrammarBackend = compiler.backend
        self.width = bitmask_width(self.backend.vocab_size)
        self.bitmask = np.full((max_rows, self.width), -1, np.int32)  # preallocated, filled in place
        self._requests: dict[str, _RequestGrammar] = {}

    def add(self, request_id: str, grammar: StructuredOutput) -> None:
        """Start tracking a request (compiles, or finds in the cache); GrammarError when invalid."""
        matcher = self.compiler.compile(grammar).new_matcher()
        self._requests[request_id] = _RequestGrammar(matcher, grammar.start_after, active=not grammar.start_after)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def fill(self, rows: list[str | None], num_rows: int) -> np.ndarray | None:
        """rows[i]: the request id sampled in row i (None: a row that is not sampled). Returns the
        `[num_rows, W]` bitmask, or None when no row has an active grammar."""
        constrained = []
        for row, request_id in enumerate(rows):
            state = self._requests.get(request_id) if request_id is not None else None
            if state is not None and state.active:
                constrained.append((state.matcher, row))
        if not constrained:
            return None
        bitmask = self.bitmask[:num_rows]
        bitmask.fill(-1)  # rows without a grammar: every token allowed
        self.backend.fill_bitmask(constrained, bitmask)
        return bitmask

    # ---- speculative decoding (runtime/speculative/) --------------------------------------------
    def allowed_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many leading drafts may be verified: those the grammar accepts (a draft it rejects
        ends the accepted prefix; the rest are dropped), and for a grammar waiting for
        `start_after`, up to the draft that starts it (the row after it is then masked)."""
        state = self._requests.get(request_id)
        if state is None:
            return len(drafts)
        if state.active:
            return state.matcher.valid_prefix(drafts)
        recent = state.recent
        for j, token in enumerate(drafts, 1):
            recent = (recent + [token])[-len(state.start_after) :]
            if tuple(recent) == state.start_after:
                return j
        return len(drafts)

    def fill_drafts(self, rows: list[tuple[str, int, list[int]]], num_rows: int) -> np.ndarray | None:
        """A verify step's bitmask [num_rows, W]: for (request id, first row, drafts allowed by
        `allowed_drafts`), row first + j allows the tokens after drafts[:j]; every other row all
        ones. None when no row is constrained. The matchers are left as they were."""
        work = []
        for request_id, row, drafts in rows:
            state = self._requests.get(request_id)
            if state is None:
                continue
            if state.active:
                work.append((state.matcher, row, drafts))
            elif drafts and tuple((state.recent + list(drafts))[-len(state.start_after) :]) == state.start_after:
                work.append((state.matcher, row + len(drafts), []))  # the grammar starts after the last draft
        if not work:
            return None
        bitmask = np.full((num_rows, self.width), -1, np.int32)
        self.backend.fill_bitmask_drafts(work, bitmask)
        return bitmask

    def advance(self, request_id: str, token_id: int) -> bool:
        """Feed a generated token; True when the request's grammar is complete."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        if not state.active:
            state.recent = (state.recent + [token_id])[-len(state.start_after) :]
            state.active = tuple(state.recent) == state.start_after
            return False
        if not state.matcher.accept_token(token_id):
            log.warning(
                "request %s: token %d rejected by its grammar (%s); ending it",
                request_id,
                token_id,
                getattr(state.matcher, "error", ""),
            )
            return True
        return state.matcher.is_terminated()
