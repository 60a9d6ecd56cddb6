"""Re-exports the engine config's parts from runtime/engine_config.py, their one home, for the
modules that still import them from here (runtime/engine/llm_engine.py). Delete with that import."""

from runtime.engine_config import CacheConfig, SchedulerConfig, check_pool_holds_one_sequence

__all__ = ["CacheConfig", "SchedulerConfig", "check_pool_holds_one_sequence"]
