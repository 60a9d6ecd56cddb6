"""Grammar compilation off the serving path: a thread pool, a cache, a time bound.

`GrammarCompiler.submit(grammar)` starts (or finds) the compilation of a grammar on a small
thread pool and returns its future; `compile(grammar)` waits for it at most `timeout_s`. The
cache is keyed by (grammar, tokenizer) and bounded (least recently used first out); a
grammar that failed stays cached as its error, so a repeated bad request costs nothing. A
compile past the timeout is reported as a `GrammarError` (a 400 for the client); its thread
finishes in the background and the result is cached for the next request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading

from runtime.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarError
from runtime.types import StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 1024


class GrammarCompiler:
    def __init__(
        self,
        backend: GrammarBackend,
        *,
        tokenizer_key: str = "",
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        num_threads: int = 2,
    ):
        self.backend = backend
        self.tokenizer_key = tokenizer_key
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="jaxserve-grammar")
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def submit(self, grammar: StructuredOutput) -> concurrent.futures.Future:
        """The future of `grammar`'s CompiledGrammar (or GrammarError); compiles at most once."""
        key = (self.tokenizer_key, *grammar.key)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self.backend.compile, grammar)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, grammar: StructuredOutput) -> CompiledGrammar:
        """Block until compiled; GrammarError when invalid or slower than `timeout_s`."""
        return self.result(self.submit(grammar), grammar)

    def result(self, future: concurrent.futures.Future, grammar: StructuredOutput) -> CompiledGrammar:
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {grammar.kind} grammar did not compile within {self.timeout_s:g} s") from None
        except GrammarError:
            raise
        except Exception as err:
            raise GrammarError(f"the {grammar.kind} grammar failed to compile: {type(err).__name__}: {err}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
