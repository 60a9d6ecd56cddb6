"""jaxserve runtime: the engine loop (`engine/`), compiled steps and the sampler (`steps/`), scheduling
(`scheduling/`), parallelism (`parallel/`), P/D (`kv_transfer/`), grammars (`structured_output/`),
`jaxserve plan` (`aot/`), and the offline `LLM` API; docs/architecture.md is the map.

`LLM` and `LLMEngine` import JAX; `runtime.types` (what the server uses) does not.
"""


def __getattr__(name):  # lazy: `from runtime.types import ...` must not pull in JAX
    if name == "LLM":
        from runtime.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from runtime.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput", "EngineRequest"):
        from runtime import types

        return getattr(types, name)
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "EngineRequest", "LLMEngine", "RequestOutput", "SamplingParams"]
