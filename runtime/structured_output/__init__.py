"""Structured output: grammar back-ends, a compile cache, per-request matchers and step bitmasks.

No JAX here (the server validates grammars with the same compiler); the compiled sampler
unpacks the bitmask (`runtime.steps.sampler.apply_token_bitmask`).
"""

from runtime.structured_output.backend import GrammarBackend, GrammarError, GrammarMatcher, bitmask_width
from runtime.structured_output.compiler import GrammarCompiler
from runtime.structured_output.manager import StructuredOutputManager


def build_compiler(
    hf_tokenizer,
    vocab_size: int,
    eos_token_ids: tuple[int, ...] = (),
    *,
    backend: str = "llguidance",
    timeout_s: float | None = None,
) -> GrammarCompiler:
    """A compiler for one tokenizer whose grammars cover `vocab_size` logits (the model's)."""
    if backend != "llguidance":
        raise ValueError(f"unknown structured output backend {backend!r}; available: llguidance")
    from runtime.structured_output.llguidance_backend import LLGuidanceBackend

    grammar_backend = LLGuidanceBackend(hf_tokenizer, vocab_size, tuple(eos_token_ids))
    key = f"{type(hf_tokenizer).__name__}:{getattr(hf_tokenizer, 'name_or_path', '')}:{len(hf_tokenizer)}:{vocab_size}"
    kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
    return GrammarCompiler(grammar_backend, tokenizer_key=key, **kwargs)


__all__ = [
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "StructuredOutputManager",
    "bitmask_width",
    "build_compiler",
]
