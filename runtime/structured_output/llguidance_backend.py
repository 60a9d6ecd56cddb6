"""The llguidance back-end: JSON schema, regex, choice and Lark / EBNF grammars.

llguidance (Rust, no torch) builds its tokenizer view from our Hugging Face fast tokenizer
(`llguidance.hf.from_tokenizer`), with the vocabulary widened to the model's logits width: ids
past the tokenizer's own entries (unused embedding rows) are never allowed, and the model's
EOS ids are the grammar's end-of-sequence tokens, allowed exactly when the grammar accepts.
JSON is compact (`{"a": 1}`, no free whitespace): a model then cannot pad an object with
thousands of spaces, the failure mode of flexible whitespace under random or weak models.
Compiling a grammar and computing masks both release the GIL.

A grammar with an `optional_block` (a reasoning block the model may open first) becomes a
two-grammar llguidance program: a Lark `start: block? @body` whose block is lazy free text up
to the first close tag, and the request's own grammar as the named sub-grammar `body`.
"""

from __future__ import annotations

import json

import numpy as np

from runtime.structured_output.backend import GrammarError
from runtime.types import StructuredOutput

JSON_DEFAULTS = {"whitespace_flexible": False, "coerce_one_of": True}
BODY_GRAMMAR = "jaxserve_body"


class LLGuidanceMatcher:
    def __init__(self, matcher):
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def valid_prefix(self, token_ids: list[int]) -> int:
        if self.matcher.is_error() or self.matcher.is_stopped():
            return 0
        return int(self.matcher.validate_tokens(list(token_ids)))

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


class LLGuidanceGrammar:
    def __init__(self, matcher):
        self._template = matcher  # never advanced; each request gets a copy

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] = (), num_threads: int = 2):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = max(int(vocab_size), len(hf_tokenizer))
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._hf_tokenizer = hf_tokenizer

    def grammar_text(self, grammar: StructuredOutput) -> str:
        """The llguidance grammar of a `StructuredOutput`; GrammarError for malformed input."""
        body = self._body_text(grammar)
        if not grammar.optional_block:
            return body
        return self._with_optional_block(body, *grammar.optional_block)

    def _with_optional_block(self, body: str, open_tag: str, close_tag: str) -> str:
        # llguidance's builders give a JSON program, except Lark (the grammar text itself)
        grammars = json.loads(body)["grammars"] if body.lstrip().startswith("{") else [{"lark_grammar": body}]
        grammars[0]["name"] = BODY_GRAMMAR
        open_term, close_term = self._literal(open_tag), self._literal(close_tag)
        if close_term == close_tag:  # a special token ends the block: the text before it cannot contain it
            block = f"block: {open_term} /(.|\\n)*/ {close_term} /[ \\t\\n]*/\n"
        else:  # lazy: the block ends at the first close tag
            block = f"block: {open_term} block_text /[ \\t\\n]*/\nblock_text[lazy]: /(.|\\n)*/ {close_term}\n"
        lark = f"start: block? @{BODY_GRAMMAR}\n" + block
        return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})

    def _literal(self, tag: str) -> str:
        """A tag that is one token llguidance keeps apart from text (every added token, e.g.
        Qwen's `<think>`) is named bare in Lark; other tags are matched as text."""
        ids = self._hf_tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]) and tag.startswith("<") and tag.endswith(">"):
            return tag
        return json.dumps(tag)

    def _body_text(self, grammar: StructuredOutput) -> str:
        LLMatcher = self._ll.LLMatcher
        kind, spec = grammar.kind, grammar.spec
        try:
            if kind == "json":
                return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
            if kind == "regex":
                return LLMatcher.grammar_from_regex(spec)
            if kind == "choice":
                choices = json.loads(spec)
                return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
            if kind == "ebnf":
                return self._ll.grammar_from("ebnf", spec)
            return LLMatcher.grammar_from_lark(spec)
        except (ValueError, TypeError) as err:
            raise GrammarError(f"invalid {kind} grammar: {err}") from None

    def compile(self, grammar: StructuredOutput) -> LLGuidanceGrammar:
        matcher = self._ll.LLMatcher(self.tokenizer, self.grammar_text(grammar), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {grammar.kind} grammar: {_first_lines(matcher.get_error())}")
        return LLGuidanceGrammar(matcher)

    def fill_bitmask(self, matchers: list[tuple[LLGuidanceMatcher, int]], bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self._executor, [(m.matcher, row) for m, row in matchers], bitmask)

    def fill_bitmask_drafts(
        self, matchers: list[tuple[LLGuidanceMatcher, int, list[int]]], bitmask: np.ndarray
    ) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        plain = [(m.matcher, row) for m, row, drafts in matchers if not drafts]  # llguidance wants >= 1 draft
        drafted = [(m.matcher, row, list(drafts)) for m, row, drafts in matchers if drafts]
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)


def _first_lines(message: str, limit: int = 600) -> str:
    return message if len(message) <= limit else message[:limit] + " ..."
