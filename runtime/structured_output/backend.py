"""The grammar back-end interface: compile a grammar for one tokenizer, make per-request matchers.

A back-end (llguidance today; xgrammar or outlines-core could join behind the same interface)
turns a `StructuredOutput` into a `CompiledGrammar` once per (grammar, tokenizer), and hands
out one `GrammarMatcher` per request. A matcher follows the tokens a request generates and
writes the set of tokens allowed next as a packed bitmask row: int32 words, bit `t % 32` of
word `t // 32` set when token t is allowed (the layout the compiled sampler unpacks).
Plain Python over the back-end's library; no JAX.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from runtime.types import StructuredOutput


class GrammarError(ValueError):
    """The grammar is invalid (bad schema, regex, grammar text) or took too long to compile."""


class GrammarMatcher(Protocol):
    """The grammar state of one request."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by a generated token; False when the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of the sequence)."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens the grammar would accept from here (nothing is consumed)."""


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """Compiles grammars for one tokenizer whose ids span `vocab_size` (>= the model's logits)."""

    name: str
    vocab_size: int

    def compile(self, grammar: StructuredOutput) -> CompiledGrammar:
        """Raise `GrammarError` naming the problem when the grammar is invalid."""

    def fill_bitmask(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed-token row into `bitmask[row]` ([rows, ceil(V/32)] int32), in place."""

    def fill_bitmask_drafts(self, matchers: list[tuple[GrammarMatcher, int, list[int]]], bitmask: np.ndarray) -> None:
        """Speculative decoding: for (matcher, row, drafts), `bitmask[row + j]` allows the tokens
        after drafts[:j] (j = 0 .. len(drafts); the drafts are valid), the matcher left as it was."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a packed bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32
