"""`jaxserve plan`: shapes-only models, the shipped configs compiled by libtpu's real compiler.

The abstract parameter tree is checked against the real loader on every tiny family; the
shipped real-model config.json files against the parameter counts their model cards publish;
each shipped accelerator config is compiled for its chip (TPU: libtpu, no TPU attached; GPU:
lowered for CUDA) with its real shapes and sizes, and must fit; an oversized config is refused
naming the numbers. CI cost: the decode bucket only (`jaxserve plan` compiles every bucket); the
Qwen3-Next-80B compile (~2.5 min per bucket on 2 busy cores: 512 experts) and the P/D configs'
compiles (~25 s each) are `slow`; CI plans every shipped YAML up to the compile (chip, topology,
mesh, memory budget) instead. The whole-model cost extrapolation is checked on a tiny
model against the fully unrolled compile.
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest

from configs import CONFIG_DIR, load_config
from models.config import parse_config
from models.model import load_model
from models.random_checkpoint import ALL_FAMILIES
from models.safetensors_io import read_json
from models.weights import abstract_params
from runtime.aot import chip_report
from runtime.aot.chip_report import PlanError, model_config_json, plan_config

# Parameter counts the model cards publish (language model incl. embeddings; 9B / 27B / 80B).
PUBLISHED_PARAMS = {
    "qwen3_5-9b.json": 9e9,
    "qwen3_5-27b.json": 27e9,
    "qwen3-next-80b-a3b.json": 80e9,
    "gemma-3-27b.json": 27e9,
    "kimi-linear-48b-a3b.json": 48e9,
}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_abstract_params_match_the_loader(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    cfg = parse_config(read_json(path / "config.json"))
    loaded = load_model(path, dtype="bfloat16").params
    abstract = abstract_params(cfg, "bfloat16")
    assert jax.tree.structure(loaded) == jax.tree.structure(abstract)
    for real, shape in zip(jax.tree.leaves(loaded), jax.tree.leaves(abstract)):
        assert (real.shape, real.dtype) == (shape.shape, shape.dtype)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_shipped_model_configs_have_the_published_size(name):
    cfg = parse_config(read_json(CONFIG_DIR / "models" / name))
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.05, count


def _decode_bucket(launch):
    buckets = launch.scheduler.token_buckets or (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    return next(b for b in buckets if b >= launch.scheduler.max_num_seqs)


@pytest.mark.parametrize(
    "name,cost",
    [
        ("gpu-h200-qwen3_5-9b.yaml", True),
        ("tpu-v5e-8-qwen3_5-27b.yaml", False),
        pytest.param("tpu-v5p-16-qwen3-next-80b-multihost.yaml", True, marks=pytest.mark.slow),
        pytest.param("gpu-h200-qwen3_5-9b-prefill.yaml", False, marks=pytest.mark.slow),  # the P/D pairs
        pytest.param("gpu-h200-qwen3_5-9b-decode.yaml", False, marks=pytest.mark.slow),
        pytest.param("tpu-v5e-8-qwen3_5-27b-prefill.yaml", False, marks=pytest.mark.slow),
        pytest.param("tpu-v5e-8-qwen3_5-27b-decode.yaml", False, marks=pytest.mark.slow),
    ],
)
def test_shipped_config_fits_its_chip(name, cost):
    launch = load_config(CONFIG_DIR / name)
    assert model_config_json(launch).parent == CONFIG_DIR / "models"  # no checkpoint on this machine
    decode = _decode_bucket(launch)
    report = plan_config(launch, name, token_buckets=(decode,), compile_sampler=False, compile_cost=cost)
    assert report.fits, report.problems
    step = report.step("decode")
    assert step.tokens == decode
    # the compiler's figures account for at least the weights and the KV pool it was given
    assert step.argument_bytes >= report.weight_bytes + report.kv_bytes
    assert step.peak_bytes <= report.chip.hbm_bytes
    if cost:  # ~2 flops per parameter per token of what one device holds (MoE: far fewer are active)
        assert 0 < step.flops <= 2.2 * report.param_count * decode / report.mesh[1]
        assert report.roofline("decode")["tokens_per_s_per_chip"] > 0


# Shipped configs `jaxserve plan` cannot plan, each with its reason: the CPU configs run the default
# model (`model.path: null`) on the local CPU devices, which is no chip of configs/chips.py. Every
# other YAML under configs/ must plan and fit its chip (a new config without `parallel.chip` fails).
NOT_PLANNABLE = {
    "cpu-demo.yaml": "CPU: the local devices, no target chip",
    "cpu-multihost-2x4.yaml": "CPU: simulated local devices, no target chip",
}
SHIPPED = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_plans_up_to_the_compile(name):
    """Target chip, topology and mesh, the model's shapes, the weights / state / KV budget: all but
    the compile (the compile of each config's decode bucket: test_shipped_config_fits_its_chip)."""
    launch = load_config(CONFIG_DIR / name)
    if name in NOT_PLANNABLE:
        assert launch.parallel.chip is None and launch.model.path is None, NOT_PLANNABLE[name]
        with pytest.raises(PlanError, match="parallel.chip is not set"):
            plan_config(launch, name, token_buckets=(), compile_sampler=False)
        return
    report = plan_config(launch, name, token_buckets=(), compile_sampler=False)
    assert report.fits, report.problems
    assert report.num_devices == launch.parallel.mesh.num_devices
    assert report.kv_bytes >= report.max_model_len * report.kv_bytes_per_token


def test_multihost_config_budget_without_compiling():
    name = "tpu-v5p-16-qwen3-next-80b-multihost.yaml"
    report = plan_config(load_config(CONFIG_DIR / name), name, token_buckets=(), compile_sampler=False)
    assert report.fits and report.num_processes == 2 and report.num_devices == 8, report.problems
    # 80B bf16 parameters over the model axis of 4 (2 KV heads: each held on 2 devices)
    assert 2 * report.param_count / 4 <= report.weight_bytes <= 2 * report.param_count / 4 * 1.1
    assert report.kv_bytes >= report.max_model_len * report.kv_bytes_per_token


def test_cost_extrapolation_matches_the_unrolled_model(tiny_checkpoint):
    import dataclasses

    from models.abstract import abstract_caches, abstract_model, unstack_abstract
    from models.ops import KernelOptions
    from runtime.aot.costs import cost_of, extrapolated_cost
    from runtime.steps.executables import StepExecutables, StepKey

    base = parse_config(read_json(tiny_checkpoint("qwen3_5") / "config.json"))
    p = base.layer_period()
    cfg = dataclasses.replace(
        base, num_layers=3 * p, layer_types=base.layer_types[:p] * 3, mlp_types=base.mlp_types[:p] * 3
    )
    sizes = dict(num_pages=9, page_size=16, num_slots=3, kv_dtype="auto", max_num_seqs=4, blocks_per_seq=4)
    opts = KernelOptions(attention="reference", gdn="reference")
    flops, moved = extrapolated_cost(cfg, "float32", None, opts, 16, **sizes)
    model = abstract_model(cfg, "float32")
    caches = abstract_caches(model, 9, 16, 3)
    model.params = unstack_abstract(model.params)
    exes = StepExecutables(
        model, caches, opts, token_buckets=(16,), seq_buckets=(8,), max_num_seqs=4, max_blocks_per_seq=4
    )
    direct = cost_of(exes.compile(StepKey("batch_backbone", 16)))
    assert flops == pytest.approx(direct[0], rel=1e-3)
    assert moved > 0  # bytes are not linear in depth (each cache update counts the whole pool): not used


def test_a_config_that_does_not_fit_names_the_numbers():
    launch = load_config(
        CONFIG_DIR / "tpu-v5e-8-qwen3_5-27b.yaml",
        {"parallel.mesh": {"data": 2, "model": 4}, "scheduler.max_num_seqs": 128},
    )
    report = plan_config(launch, "too-big", token_buckets=(128,), compile_sampler=False)
    assert not report.steps  # the weights alone overflow: nothing compiled
    assert not report.fits
    with pytest.raises(PlanError, match=r"weights \d+\.\d\d GiB"):
        report.raise_if_unfit()


def test_plan_needs_a_target_chip():
    with pytest.raises(PlanError, match="parallel.chip"):
        plan_config(load_config(CONFIG_DIR / "gpu-h200-qwen3_5-9b.yaml", {"parallel.chip": None}))


@pytest.mark.parametrize(
    "overrides,checkpoints",
    [
        ({}, "budget"),  # the default: 0.25 of the cache memory, fewer than 2 per sequence here
        ({"cache.hybrid_checkpoint_budget": 0.1}, "budget"),
        ({"cache.hybrid_checkpoint_budget": 0.9, "scheduler.max_num_seqs": 8}, "cap"),  # capped at 32 per sequence
        ({"cache.hybrid_checkpoint_budget": None}, None),  # 2 x max_num_seqs shared, no budget
        ({"cache.enable_prefix_caching": False}, None),
    ],
)
def test_checkpoint_slots_follow_the_memory_budget(overrides, checkpoints):
    """The plan sizes GDN checkpoint slots by the engine's rule: `cache.hybrid_checkpoint_budget` x
    (memory_fraction x HBM - weights) per device, over one slot's bytes on a device (GDN heads split
    8 ways), at most 32 per sequence; the table and the JSON show the budget."""
    from runtime.aot.plan_report import format_report, report_json

    name = "tpu-v5e-8-qwen3_5-27b.yaml"
    launch = load_config(CONFIG_DIR / name, overrides)
    r = plan_config(launch, name, token_buckets=(), compile_sampler=False)
    cfg = parse_config(read_json(model_config_json(launch)))
    conv_dim = (
        2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    slot = 4 * cfg.num_linear_layers * ((cfg.linear_conv_kernel_dim - 1) * conv_dim + recurrent) // 8
    cache_bytes = int(16 * 2**30 * launch.cache.memory_fraction) - r.weight_bytes
    assert r.cache_bytes == cache_bytes
    fraction = launch.cache.hybrid_checkpoint_budget
    seqs = launch.scheduler.max_num_seqs
    if checkpoints == "budget":
        checkpoints = int(fraction * cache_bytes // slot)
        assert checkpoints < 32 * seqs  # the memory budget binds, not the per-sequence cap
    elif checkpoints == "cap":
        assert int(fraction * cache_bytes // slot) > 32 * seqs
        checkpoints = 32 * seqs
    running = 1 + seqs + (2 * seqs if overrides == {"cache.hybrid_checkpoint_budget": None} else 0)
    assert r.num_checkpoint_slots == checkpoints
    assert r.num_state_slots == running + (checkpoints or 0)
    assert r.state_bytes == r.num_state_slots * slot
    data = report_json(r)["checkpoints"]
    if checkpoints is None:
        assert data == {"num_slots": None, "bytes": None, "budget_fraction": None, "budget_bytes": None}
        assert f"({r.num_state_slots} slots)" in format_report(r)
    else:
        assert data == {
            "num_slots": checkpoints,
            "bytes": checkpoints * slot,
            "budget_fraction": fraction,
            "budget_bytes": int(fraction * cache_bytes),
        }
        assert checkpoints * slot <= data["budget_bytes"]
        assert f"{checkpoints} checkpoints within cache.hybrid_checkpoint_budget {fraction}" in format_report(r)


def test_head_dims_below_128_are_stored_token_minor_on_tpu():
    """The page layout rule plan shares with the engine: token-minor [P, Hkv, D, ps] pages on TPU for
    head_dim < 128 with whole 128-token lane rows; other TPU page sizes keep the lane-padded copy and
    get a warning naming the fix; GPU and head_dim >= 128 keep head-major pages."""
    assert chip_report.kv_page_layout(32, 128, "tpu") == (True, None)
    assert chip_report.kv_page_layout(64, 256, "tpu") == (True, None)
    minor, warning = chip_report.kv_page_layout(32, 16, "tpu")
    assert not minor and "16-token pages" in warning and "multiple of 128" in warning
    assert chip_report.kv_page_layout(256, 16, "tpu") == (False, None)
    assert chip_report.kv_page_layout(128, 128, "tpu") == (False, None)
    assert chip_report.kv_page_layout(32, 128, "gpu") == (False, None)


def _hand_page_and_checkpoint_bytes(cfg, page_size: int, kv_itemsize: int, kv_heads: int, state_itemsize: int):
    """One KV page over every attention layer (K and V, FP8: a float32 scale per page and KV head
    each) and one GDN checkpoint over every linear layer (conv: kernel - 1 columns of q, k, v;
    recurrent: value heads x key dim x value dim), from the config's fields."""
    attention = cfg.num_layers - cfg.num_linear_layers
    scales = 2 * kv_heads * 4 if kv_itemsize == 1 else 0
    page = attention * (2 * kv_heads * cfg.head_dim * page_size * kv_itemsize + scales)
    conv_dim = (
        2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    checkpoint = cfg.num_linear_layers * ((cfg.linear_conv_kernel_dim - 1) * conv_dim + recurrent) * state_itemsize
    return page, checkpoint


def test_plan_reports_the_host_tier():
    """cache.kv_offloading_size in the plan: bytes per host page / checkpoint at the real shapes
    (Qwen3.5-9B: 8 attention layers of 4 KV heads x 256, FP8 pages of 64 tokens; 24 GDN layers,
    float32 state), how many the tier holds, and a tier larger than --host-ram refused."""
    from runtime.aot.plan_report import format_report, report_json

    name = "gpu-h200-qwen3_5-9b.yaml"
    launch = load_config(CONFIG_DIR / name, {"cache.kv_offloading_size": 100})
    cfg = parse_config(read_json(model_config_json(launch)))
    page, checkpoint = _hand_page_and_checkpoint_bytes(cfg, 64, 1, cfg.num_kv_heads, 4)
    assert (page, checkpoint) == (8 * (2 * 4 * 256 * 64 + 32), 24 * (3 * 8192 + 32 * 128 * 128) * 4)
    r = plan_config(launch, name, token_buckets=(), compile_sampler=False, host_ram_bytes=512 * 2**30)
    assert r.fits, r.problems
    host = report_json(r)["host_tier"]
    assert host["page_bytes"] == page and host["checkpoint_bytes"] == checkpoint
    assert host["pages"] == 100 * 2**30 // page == 102375
    assert host["checkpoints"] == 100 * 2**30 // checkpoint == 2037
    assert host["bytes_per_rank"] == 100 * 2**30 and host["host_ram_bytes"] == 512 * 2**30
    assert "host tier 100.00 GiB (cache.kv_offloading_size): holds 102,375 pages" in format_report(r)
    assert "2,037 GDN checkpoints" in format_report(r)
    small = plan_config(launch, name, token_buckets=(), compile_sampler=False, host_ram_bytes=64 * 2**30)
    assert not small.fits and "exceeds host RAM 64.00 GiB" in small.problems[0]
    off = plan_config(load_config(CONFIG_DIR / name), name, token_buckets=(), compile_sampler=False)
    assert off.host_tier is None and report_json(off)["host_tier"] is None


def test_plan_splits_the_host_tier_per_data_rank():
    """Under attention DP each rank has its own tier: kv_offloading_size / data each; an entry is a
    rank's page whole over the model axis (Qwen3-Next-80B's 2 KV heads held 4 times, one per model shard)."""
    name = "tpu-v5p-16-qwen3-next-80b-multihost.yaml"
    launch = load_config(CONFIG_DIR / name, {"cache.kv_offloading_size": 64})
    r = plan_config(launch, name, token_buckets=(), compile_sampler=False)
    cfg = parse_config(read_json(model_config_json(launch)))
    assert launch.parallel.mesh.data == 2 and cfg.num_kv_heads == 2 and launch.parallel.mesh.model == 4
    kv_itemsize = 1 if str(launch.cache.kv_cache_dtype).startswith("fp8") else 2
    state_itemsize = 4 if launch.cache.state_dtype in (None, "float32") else 2
    page, checkpoint = _hand_page_and_checkpoint_bytes(cfg, launch.cache.page_size, kv_itemsize, 4, state_itemsize)
    h = r.host_tier
    assert (h.page_bytes, h.checkpoint_bytes, h.bytes_per_rank) == (page, checkpoint, 32 * 2**30)
    assert h.pages == 32 * 2**30 // page and h.checkpoints == 32 * 2**30 // checkpoint
    assert "per DP rank (2 tiers of 32.00 GiB)" in h.line()
