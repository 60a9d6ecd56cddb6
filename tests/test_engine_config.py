"""One config path (issue 14 item 4): YAML, CLI flags and `LLM(...)` reach the engine through
`build_engine_config`, with one set of defaults. Expected values are written out by hand."""

import dataclasses

import pytest

from configs.schema import ConfigError, LaunchConfig, config_from_dict, load_config
from runtime.engine_config import ENGINE_FIELD_KEYS, EngineConfig, build_engine_config

# The documented defaults (configs/schema.py), which once disagreed between three modules.
DEFAULTS = {
    "dtype": "float32",
    "max_num_batched_tokens": 512,
    "max_num_seqs": 64,
    "aot_compile": True,
    "page_size": 16,
    "kv_cache_dtype": "auto",
    "memory_fraction": 0.9,
    "layer_loop": "auto",
    "fuse_greedy": None,
    "hybrid_checkpoint_policy": "auto",
    "enable_prefix_caching": True,
}


def _picked(config) -> dict:
    return {field: getattr(config, field) for field in DEFAULTS}


def test_one_set_of_defaults_everywhere():
    from runtime.config import SchedulerConfig

    assert _picked(EngineConfig(model="m")) == DEFAULTS
    assert build_engine_config(LaunchConfig(), "m") == EngineConfig(model="m")
    assert build_engine_config(config_from_dict({}), "m") == EngineConfig(model="m")
    scheduler = SchedulerConfig()
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (512, 64)


def test_every_mapped_launch_key_exists_and_reaches_the_engine():
    launch = load_config(None)  # the shipped cpu-demo.yaml
    engine = build_engine_config(launch, "m")
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.num_pages, engine.max_model_len) == (
        8,
        256,
        512,
        2048,
    )
    assert engine.compile_cache_dir is not None and "~" not in engine.compile_cache_dir  # expanded
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(ENGINE_FIELD_KEYS) <= fields
    changed = build_engine_config(
        load_config(
            None,
            {
                "kernels.layer_loop": "scan",
                "cache.hybrid_checkpoint_budget": None,
                "scheduler.token_buckets": [64, 256],
            },
        ),
        "m",
    )
    assert (changed.layer_loop, changed.hybrid_checkpoint_budget, changed.token_buckets) == ("scan", None, (64, 256))


def test_engine_only_fields_pass_and_launch_fields_are_refused():
    config = build_engine_config(LaunchConfig(), "m", interpret=True, seed=3)
    assert (config.interpret, config.seed) == (True, 3)
    with pytest.raises(TypeError, match=r"\['dtype'\] come from the launch config \(\['model.dtype'\]\)"):
        build_engine_config(LaunchConfig(), "m", dtype="bfloat16")


def test_llm_kwargs_go_through_the_launch_config(monkeypatch):
    import runtime.engine.llm as llm_module

    built = []
    monkeypatch.setattr(
        llm_module, "LLMEngine", lambda config, model=None: built.append(config) or type("E", (), {"tokenizer": None})()
    )
    llm_module.LLM("m")
    assert built[-1] == EngineConfig(model="m")  # no defaults of its own
    llm_module.LLM(
        "m",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        attention_backend="reference",
        hybrid_checkpoint_budget=None,
        interpret=True,
    )
    assert (built[-1].max_num_seqs, built[-1].max_num_batched_tokens, built[-1].gdn_backend) == (4, 32, "reference")
    assert built[-1].hybrid_checkpoint_budget is None and built[-1].interpret is True
    with pytest.raises(ConfigError, match=r"scheduler: max_num_batched_tokens \(8\) must be >= max_num_seqs \(64\)"):
        llm_module.LLM("m", max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match="cache.page_size: must be a power of two"):
        llm_module.LLM("m", page_size=24)
