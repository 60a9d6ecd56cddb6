"""One config path (issue 14 item 4): YAML, CLI flags and `LLM(...)` reach the engine through
`build_engine_config`, with one set of defaults; each rule is written once (configs/rules.py),
and the engine's cache and scheduler configs come from it (issue 30). Expected values are
written out by hand."""

import dataclasses

import pytest

from configs.schema import ConfigError, LaunchConfig, config_from_dict, load_config
from runtime.engine_config import (
    ENGINE_FIELD_KEYS,
    CacheConfig,
    CompileConfig,
    EngineConfig,
    KernelConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
    build_engine_config,
)

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


def test_kernel_parallel_and_compile_parts_carry_the_launch_sections():
    launch = load_config(
        None,
        {
            "kernels.layer_loop": "unroll",
            "kernels.attention_backend": "reference",
            "parallel.mesh": {"data": 2, "model": 4},
            "compile.aot": False,
            "compile.cache_dir": None,
        },
    )
    config = build_engine_config(launch, "m", interpret=True)
    assert config.kernel_config() == KernelConfig("reference", "auto", "unroll", None, True)
    assert config.parallel_config() == ParallelConfig((2, 4), False)
    assert config.parallel_config().data_parallel_size == 2 and ParallelConfig().data_parallel_size == 1
    assert config.compile_config() == CompileConfig(
        aot=False, grammar_samplers=True, every_variant=False, cache_dir=None
    )


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


# (EngineConfig field, launch key, a value that breaks the rule, the rule's message)
BROKEN = [
    ("page_size", "cache.page_size", 24, "must be a power of two in [1, 1024], got 24"),
    ("num_pages", "cache.num_pages", 1, "must be >= 2 (page 0 is the null page), got 1"),
    ("memory_fraction", "cache.memory_fraction", 1.5, "must be in (0, 1], got 1.5"),
    ("kv_cache_dtype", "cache.kv_cache_dtype", "int4", "must be one of 'auto', 'float32', 'bfloat16', 'fp8_e4m3', "),
    ("hybrid_checkpoint_budget", "cache.hybrid_checkpoint_budget", 1.0, "must be in [0, 1), got 1.0"),
    ("dtype", "model.dtype", "int8", "must be one of 'bfloat16', 'float16', 'float32', got 'int8'"),
    ("max_model_len", "model.max_model_len", 1, "must be >= 2 (a prompt token and a generated one), got 1"),
    ("max_num_seqs", "scheduler.max_num_seqs", 0, "must be >= 1, got 0"),
    ("layer_loop", "kernels.layer_loop", "vmap", "must be one of 'auto', 'scan', 'unroll', got 'vmap'"),
    ("policy", "scheduler.policy", "lifo", "unknown scheduling_policy 'lifo'; known (built-in and installed): ["),
    ("attention_backend", "kernels.attention_backend", "nope", "unknown attention_backend 'nope'; known"),
]


@pytest.mark.parametrize("field, key, value, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_each_rule_is_written_once(field, key, value, message):
    """The launch schema and the engine's config call the same rule: the same message, named by
    the launch key in one and by the field in the other."""
    with pytest.raises(ConfigError) as launch_error:
        load_config(None, {key: value})
    with pytest.raises(ValueError) as engine_error:
        EngineConfig(model="m", **{field: value})
    assert str(launch_error.value).startswith(f"{key}: {message}")
    assert str(engine_error.value).startswith(f"{field}: {message}")


def test_the_budget_rule_names_both_fields_everywhere():
    message = r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\) so a full decode step fits"
    with pytest.raises(ConfigError, match="scheduler: " + message):
        load_config(None, {"scheduler.max_num_seqs": 16, "scheduler.max_num_batched_tokens": 8})
    with pytest.raises(ValueError, match="^" + message):
        EngineConfig(model="m", max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="^" + message):
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8)


def test_kv_transfer_settings_share_the_section_rules():
    with pytest.raises(ConfigError, match=r"^kv_transfer.lease_s: must be > 0, got 0"):
        load_config(None, {"kv_transfer.lease_s": 0})
    with pytest.raises(ValueError, match=r"^lease_s: must be > 0, got 0"):
        KVTransferConfig(lease_s=0)
    with pytest.raises(ValueError, match=r"^peers: must be host:port, got 'nohost'"):
        KVTransferConfig(peers=("nohost",))
    assert load_config(None, {"kv_transfer.peers": ["HTTP://Prefill:8100/"]}).kv_transfer.peers == ["prefill:8100"]
    launch = load_config(None, {"parallel.role": "decode", "kv_transfer.peers": ["Prefill:8100"]})
    assert build_engine_config(launch, "m").kv_transfer == KVTransferConfig(role="decode", peers=("prefill:8100",))


def test_the_engine_gets_its_cache_and_scheduler_configs_from_one_call():
    config = EngineConfig(
        model="m",
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        policy="priority",
        long_prefill_token_threshold=16,
        enable_prefix_caching=False,
        hybrid_checkpoint_policy="ends",
    )
    assert config.cache_config(
        num_pages=20, max_model_len=64, num_state_slots=6, num_checkpoint_slots=2
    ) == CacheConfig(
        page_size=8,
        num_pages=20,
        num_state_slots=6,
        enable_prefix_caching=False,
        checkpoint_policy="ends",
        num_checkpoint_slots=2,
    )
    assert config.scheduler_config(max_model_len=64) == SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, policy="priority", long_prefill_token_threshold=16
    )
    with pytest.raises(ValueError, match=r"holds 152 tokens \(19 usable pages x 8\).*max_model_len=160.*20 pages"):
        config.cache_config(num_pages=20, max_model_len=160)
    with pytest.raises(ValueError, match="^num_state_slots: must be 0"):
        config.cache_config(num_pages=20, max_model_len=64, num_state_slots=1)
