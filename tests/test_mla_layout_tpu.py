"""An MLA model's serving step reads and writes its latent pools in place on TPU (models/cache_formats.py).

The step of a small DeepSeek-V3-shaped model (MLA rows of 512 + 64 = 576 channels, 128-token
pages) is compiled by libtpu's compiler ahead of time for a v5e and a v6e chip (no TPU attached),
through the engine's own executables table, as `jaxserve plan` compiles it. Left to TPU's default
entry layout the pool is [P, ps, W] with ps minor, and the step copied every layer's pool into the
kernel's rows-minor layout and back (temp of the order of the pools' bytes). Pinned, the step's
cache arguments are rows-minor, no array of the pool's shape is copied, and its temp is a small
fraction of one pool. libtpu is needed (skipped without it).
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import json

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from configs import CONFIG_DIR
from models.abstract import abstract_caches, abstract_model, shard_abstract_model
from models.cache_formats import on_tpu
from models.config import parse_config
from models.ops import KernelOptions
from runtime.steps.executables import StepExecutables, StepKey

topologies = pytest.importorskip("jax.experimental.topologies")
pytest.importorskip("libtpu")

PAGE_SIZE, NUM_PAGES = 128, 2049  # TPU's default entry layout puts ps minor at this shape (pool_copied)


def small_deepseek():
    """DeepSeek-V3's config.json with small widths and two layers (one dense, one MoE), its MLA rows kept."""
    hf = json.loads((CONFIG_DIR / "models" / "deepseek-v3.json").read_text())
    hf.update(
        hidden_size=512,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=256,
        vocab_size=1024,
    )
    return parse_config(hf)


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def compiled(request):
    """(caches, compiled 64-token backbone step) on a 1-chip mesh of that TPU generation."""
    topology = topologies.get_topology_desc(f"{request.param}=1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    devices = np.array(topology.devices[:1], dtype=object).reshape(1, 1)
    mesh = Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    model = shard_abstract_model(abstract_model(small_deepseek(), "bfloat16"), mesh, True)
    caches = abstract_caches(model, NUM_PAGES, PAGE_SIZE, 2, "auto")
    opts = KernelOptions(attention="pallas_tpu", gdn="pallas_tpu", tp=model.tp)
    exes = StepExecutables(
        model,
        caches,
        opts,
        token_buckets=(64,),
        seq_buckets=(8,),
        max_num_seqs=16,
        max_blocks_per_seq=32768 // PAGE_SIZE,
        page_size=PAGE_SIZE,
    )
    return caches, exes.compile(StepKey("backbone", 64))


def test_the_plan_pins_the_latent_pool_rows_minor(compiled):
    caches, _ = compiled
    pools = [pages.c for pages in caches["kv"]]
    assert len(pools) == 2 and all(on_tpu(c.sharding) for c in pools)
    assert all(c.format.layout.major_to_minor == (0, 1, 2) for c in pools)


def test_the_step_reads_and_writes_the_pool_in_place(compiled):
    caches, step = compiled
    pools = [pages.c for pages in caches["kv"]]
    shape = "[" + ",".join(map(str, pools[0].shape)) + "]"
    pool_bytes = pools[0].size * pools[0].dtype.itemsize
    entry = [leaf.layout.major_to_minor for leaf in jax.tree.leaves(step.input_formats[0][1]["kv"])]
    assert entry == [(0, 1, 2)] * 2
    out = [leaf.layout.major_to_minor for leaf in jax.tree.leaves(step.output_formats[0]["kv"])]
    assert out == [(0, 1, 2)] * 2  # donated and returned in the same layout: aliased, no copy out
    assert not [line for line in step.as_text().splitlines() if " copy(" in line and shape in line]
    memory = step.memory_analysis()
    assert memory.temp_size_in_bytes < pool_bytes / 20, (memory.temp_size_in_bytes, pool_bytes)
    # arguments include both pools at 640 lanes a row (576 padded to a lane multiple)
    assert memory.alias_size_in_bytes >= 2 * pool_bytes * 640 // 576


def test_the_plan_counts_the_pools_as_the_compiler_lays_them_out(compiled):
    """The planner's KV bytes (and the engine's page budget, `cache_bytes_per_token(lane_padded=True)`)
    count the 640 lanes a pinned 576-channel row takes, as the compiled step's aliased arguments do."""
    from runtime.aot.costs import per_device_bytes

    caches, step = compiled
    kv_bytes = per_device_bytes(caches["kv"])
    assert kv_bytes == 2 * NUM_PAGES * PAGE_SIZE * 640 * 2
    assert kv_bytes <= step.memory_analysis().alias_size_in_bytes < kv_bytes * 1.01
    model = abstract_model(small_deepseek(), "bfloat16")
    assert model.cache_bytes_per_token(lane_padded=True) == 2 * 640 * 2
    assert model.cache_bytes_per_token() == 2 * 576 * 2


@pytest.fixture(scope="module")
def one_chip():
    """(caches, compiled 64-token backbone step) of a one-chip v5e engine without a mesh (model.tp
    None): params and caches on the chip's `SingleDeviceSharding`, as a TPU engine holds them."""
    from jax.sharding import SingleDeviceSharding

    topology = topologies.get_topology_desc("v5e=1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    chip = SingleDeviceSharding(topology.devices[0])
    on_chip = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=chip)
    model = abstract_model(small_deepseek(), "bfloat16")
    assert model.tp is None
    model.params = jax.tree.map(on_chip, model.params)
    caches = jax.tree.map(on_chip, abstract_caches(model, NUM_PAGES, PAGE_SIZE, 2, "auto"))
    exes = StepExecutables(
        model,
        caches,
        KernelOptions(attention="pallas_tpu", gdn="pallas_tpu"),
        token_buckets=(64,),
        seq_buckets=(8,),
        max_num_seqs=16,
        max_blocks_per_seq=32768 // PAGE_SIZE,
        page_size=PAGE_SIZE,
    )
    return caches, exes.compile(StepKey("backbone", 64))


def test_one_chip_without_a_mesh_reads_and_writes_the_pool_in_place(one_chip):
    """No mesh: the step still takes and returns the pools rows-minor (`cache_formats.one_tpu`), copies
    no array of the pool's shape, and its temp is a small fraction of one pool."""
    caches, step = one_chip
    pools = [pages.c for pages in caches["kv"]]
    shape = "[" + ",".join(map(str, pools[0].shape)) + "]"
    entry = [leaf.layout.major_to_minor for leaf in jax.tree.leaves(step.input_formats[0][1]["kv"])]
    out = [leaf.layout.major_to_minor for leaf in jax.tree.leaves(step.output_formats[0]["kv"])]
    assert entry == out == [(0, 1, 2)] * 2
    assert not [line for line in step.as_text().splitlines() if " copy(" in line and shape in line]
    pool_bytes = pools[0].size * pools[0].dtype.itemsize
    assert step.memory_analysis().temp_size_in_bytes < pool_bytes / 20


def test_caches_off_tpu_are_not_pinned():
    """On CPU (no TPU chip) the caches keep their default layout and the step its plain shardings."""
    from models.cache_formats import one_tpu, place_pinned
    from pallas_kernels.mla import LatentPages

    caches = {"kv": (LatentPages.create(3, 8, 28, "float32"), None), "conv": (), "rec": ()}
    assert one_tpu(caches) is None and place_pinned(caches) is caches
