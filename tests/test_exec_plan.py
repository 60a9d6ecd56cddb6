"""runtime/steps/execution_plan.py: backend x model size x knobs -> ExecutionPlan, as a table written by hand.
Pure (no devices): the engine constructor only carries the plan out."""

from types import SimpleNamespace

import pytest

from runtime.engine_config import EngineConfig
from runtime.steps.execution_plan import ExecutionPlan, plan_buckets, plan_execution

SHALLOW, DEEP = SimpleNamespace(num_layers=6, is_hybrid=False), SimpleNamespace(num_layers=30, is_hybrid=False)
HYBRID = SimpleNamespace(num_layers=8, is_hybrid=True)
CPU_TOKENS = (4, 6, 8, 12, 16, 32, 64, 128, 256, 512)  # max_num_seqs 16: 1.5x steps up to 16
ACC_TOKENS = (16, 32, 64, 128, 256, 512)
SEQS = (8, 16)

# (backend, model, knobs) -> (layer_loop, token buckets, fuse_greedy, attention, gdn, kv bit storage, weights)
TABLE = [
    ("cpu", SHALLOW, {}, ("unroll", CPU_TOKENS, False, "native", "native", True, "out_in")),
    ("cpu", DEEP, {}, ("scan", CPU_TOKENS, False, "native", "native", True, "out_in")),
    ("cpu", DEEP, {"dtype": "bfloat16"}, ("unroll", CPU_TOKENS, True, "native", "native", True, "out_in")),  # any depth
    (
        "cpu",
        DEEP,
        {"dtype": "bfloat16", "layer_loop": "scan"},
        ("scan", CPU_TOKENS, True, "native", "native", True, "out_in"),
    ),
    (
        "cpu",
        HYBRID,
        {"dtype": "bfloat16"},
        ("unroll", CPU_TOKENS, False, "native", "native", True, "out_in"),
    ),  # no fused greedy
    (
        "cpu",
        HYBRID,
        {"dtype": "bfloat16", "fuse_greedy": True},
        ("unroll", CPU_TOKENS, True, "native", "native", True, "out_in"),
    ),
    ("tpu", DEEP, {"dtype": "bfloat16"}, ("scan", ACC_TOKENS, False, "pallas", "pallas", False, "in_out")),
    (
        "cpu",
        SHALLOW,
        {"layer_loop": "scan", "fuse_greedy": False},
        ("scan", CPU_TOKENS, False, "native", "native", True, "out_in"),
    ),
    (
        "cpu",
        SHALLOW,
        {"attention_backend": "reference", "fuse_greedy": True},
        ("unroll", CPU_TOKENS, True, "reference", "native", True, "out_in"),
    ),
    ("cpu", SHALLOW, {"interpret": True}, ("unroll", CPU_TOKENS, False, "pallas", "pallas", False, "out_in")),
    (
        "cpu",
        SHALLOW,
        {"attention_backend": "chunked", "gdn_backend": "chunked"},
        ("unroll", CPU_TOKENS, False, "chunked", "chunked", True, "out_in"),
    ),
    (
        "cpu",
        DEEP,
        {"mesh_shape": (1, 2)},
        ("scan", CPU_TOKENS, False, "native", "native", True, "in_out"),
    ),  # sharding rules
    ("cpu", SHALLOW, {"token_buckets": (64, 512)}, ("unroll", (64, 512), False, "native", "native", True, "out_in")),
    ("gpu", SHALLOW, {}, ("scan", ACC_TOKENS, False, "pallas", "pallas", False, "in_out")),
    ("tpu", DEEP, {}, ("scan", ACC_TOKENS, False, "pallas", "pallas", False, "in_out")),
    (
        "tpu",
        DEEP,
        {"layer_loop": "unroll", "fuse_greedy": True},
        ("unroll", ACC_TOKENS, True, "pallas", "pallas", False, "in_out"),
    ),
    (
        "gpu",
        DEEP,
        {"attention_backend": "reference", "gdn_backend": "reference"},
        ("scan", ACC_TOKENS, False, "reference", "reference", True, "in_out"),
    ),
]


@pytest.mark.parametrize("backend,model,knobs,expected", TABLE)
def test_plan_table(backend, model, knobs, expected):
    config = EngineConfig(model="m", max_num_seqs=16, max_num_batched_tokens=512, **knobs)
    plan = plan_execution(config, model, backend)
    assert (
        plan.layer_loop,
        plan.token_buckets,
        plan.fuse_greedy,
        plan.attention_path,
        plan.gdn_path,
        plan.kv_bit_storage,
        plan.weight_layout,
    ) == expected
    assert plan.seq_buckets == SEQS and plan.backend == backend
    assert plan.aot_compile and plan.grammar_samplers  # the EngineConfig defaults
    assert "execution plan (" in plan.describe() and str(list(plan.token_buckets)) in plan.describe()


def test_plan_is_frozen_and_warns_about_unmeasured_cpu_dtypes():
    plan = plan_execution(EngineConfig(model="m", dtype="float16"), SHALLOW, "cpu")
    assert isinstance(plan, ExecutionPlan) and len(plan.warnings) == 1 and "float16" in plan.warnings[0]
    with pytest.raises(AttributeError):
        plan.layer_loop = "scan"
    assert plan_execution(EngineConfig(model="m", dtype="float16"), SHALLOW, "tpu").warnings == ()
    assert "float16" in plan_execution(EngineConfig(model="m"), SHALLOW, "cpu", dtype="float16").warnings[0]
    # bfloat16 is CPU's fast dtype (measured: benchmarks/saturation.py, docs/benchmarks.md): no warning
    assert plan_execution(EngineConfig(model="m", dtype="bfloat16"), DEEP, "cpu").warnings == ()
    assert not plan_execution(EngineConfig(model="m", aot_compile=False), SHALLOW, "cpu").aot_compile


def test_packed_weights_where_the_native_matmul_runs():
    """bf16 on a CPU whose native matmul runs AVX512-BF16 (`native_matmul`, a fact the engine
    looks up): projections packed for it; float32, meshes and accelerators keep their layouts."""
    bf16 = EngineConfig(model="m", dtype="bfloat16")
    assert plan_execution(bf16, DEEP, "cpu", native_matmul=True).weight_layout == "packed"
    assert plan_execution(bf16, DEEP, "cpu", native_matmul=False).weight_layout == "out_in"
    assert plan_execution(EngineConfig(model="m"), DEEP, "cpu", native_matmul=True).weight_layout == "out_in"
    assert (
        plan_execution(EngineConfig(model="m"), DEEP, "cpu", dtype="bfloat16", native_matmul=True).weight_layout
        == "packed"
    )
    meshed = EngineConfig(model="m", dtype="bfloat16", mesh_shape=(1, 2))
    assert plan_execution(meshed, DEEP, "cpu", native_matmul=True).weight_layout == "in_out"
    assert plan_execution(bf16, DEEP, "tpu", native_matmul=True).weight_layout == "in_out"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        plan_execution(EngineConfig(model="m"), SHALLOW, "metal")


def test_plan_buckets_is_what_jaxserve_plan_compiles():
    """runtime/aot/chip_report.py (the accelerator planner) takes its buckets from the same rule."""
    assert plan_buckets(1024, 256, None, "tpu") == ((16, 32, 64, 128, 256, 512, 1024), (8, 16, 32, 64, 128, 256))
    assert plan_buckets(8, 4, None, "cpu") == ((4, 8), (4,))  # 1.5x steps only up to max_num_seqs
    assert plan_buckets(8, 8, None, "cpu") == ((4, 6, 8), (8,))


def test_engine_carries_out_the_plan(tiny_checkpoint, caplog):
    """The constructor takes every choice from the plan: the default one, logged in one line, or
    one handed to it (nothing compiled: aot off)."""
    import dataclasses
    import logging

    import jax

    from runtime.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(tiny_checkpoint("llama")),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_pages=40,
        max_model_len=256,
        aot_compile=False,
        load_tokenizer=False,
    )
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        engine = LLMEngine(config)
    assert engine.plan == plan_execution(config, engine.model.cfg, jax.default_backend(), dtype="float32")
    assert [r.getMessage() for r in caplog.records].count(engine.plan.describe()) == 1
    assert engine.token_buckets == engine.plan.token_buckets and engine.opts.attention == engine.plan.attention_path
    given = dataclasses.replace(
        engine.plan,
        layer_loop="scan",
        token_buckets=(8, 32),
        fuse_greedy=False,
        attention_path="reference",
        kv_bit_storage=True,
        weight_layout="in_out",
    )
    assert engine.model.out_in and engine.plan.weight_layout == "out_in"  # CPU: projections held [out, in]
    engine = LLMEngine(dataclasses.replace(config, kv_cache_dtype="bfloat16"), plan=given)
    assert not engine.model.out_in
    assert (engine.layer_loop, engine.token_buckets, engine.executables.greedy_buckets) == ("scan", (8, 32), ())
    assert engine.opts.attention == "reference" and engine.caches["kv"][0].k.dtype == "uint16"  # bf16 held as bits


def test_start_up_warm_up_writes_nothing(tiny_checkpoint, hf_model):
    """The start-up warm-up runs every compiled backbone and sampler on an empty batch: every KV
    page (the null page 0 included), conv state and recurrent state must still be the zeros the
    pools were created with, and the first real request still matches HF's greedy tokens."""
    import jax
    import numpy as np
    from hf_reference import assert_greedy_match, hf_greedy

    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint("qwen3_5")
    config = EngineConfig(
        model=str(path),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_pages=40,
        max_model_len=256,
        token_buckets=(8, 32),
        load_tokenizer=False,
    )
    engine = LLMEngine(config)
    leaves = [x for x in jax.tree.leaves(engine.caches) if x is not None]
    assert leaves and all(not np.asarray(x).any() for x in leaves)
    prompt = [5, 9, 13, 200, 17, 3, 44]
    engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = tokens + out.new_token_ids
    expected, scores = hf_greedy(hf_model("qwen3_5"), prompt, 6)
    assert_greedy_match(list(tokens), expected, scores, "engine after warm-up vs HF")
