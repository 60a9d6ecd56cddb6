"""MLA with the latent pool split by token over the model axis (`parallel.mla_latent: split`,
models/mla_split.py) against one device and HF transformers.

The split runs in subprocesses with simulated CPU devices (the device count must not leak):
DeepSeek-V3 (5 heads) on 5 devices (heads split: the combine reduce-scatters heads) and on 2
(heads do not divide: attention replicated, the combine all-reduces), Kimi Linear (4 heads, KDA
split too) on 2 and 4. Each split model's logits over a 40-token prompt (pages of 20 tokens:
4 / 10 rows per chip per page) equal one device's within 1e-5 and HF's within 1e-4, the pool is
really held 1/m per device, and greedy decoding through the split pool matches one device's. An
engine with the split pool (chunked prefill, prefix hits, a preemption) gives HF's greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_reference import hf_logits

from models.mla_split import check_split, local_slots

SCRIPT = """
import dataclasses, sys
import jax
jax.config.update("jax_num_cpu_devices", 4 if "kimi" in sys.argv[1] else 5)
import numpy as np
from models.model import load_model
from models.sharding import shard_model
from runtime.parallel.mesh import make_mesh

path, out, sizes = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
ids = np.random.default_rng(0).integers(3, 1000, size=40).tolist()
one = load_model(path)
results = {"one": one.logits(ids, page_size=20)}
greedy_one = one.greedy(ids[:13], 6, page_size=20)
for m in sizes:
    model = shard_model(load_model(path), make_mesh(1, m, devices=jax.devices()[:m]))
    model.tp = dataclasses.replace(model.tp, latent_split=True)
    results[f"tp{m}"] = model.logits(ids, page_size=20)
    pool = next(p for p in model.init_caches(4, 20, num_slots=2)["kv"] if p is not None)
    shard = pool.c.addressable_shards[0].data.shape
    print("POOL", m, model.tp.attention, pool.c.shape[1], shard[1], pool.c.sharding.spec)
    print("GREEDY", m, model.greedy(ids[:13], 6, page_size=20) == greedy_one)
np.savez(out, ids=np.array(ids), **results)
if "kimi" not in path:  # mla_latent auto: split iff the replicated pool cannot hold 4 sequences of 160 tokens
    from runtime.engine.construction import auto_latent
    from runtime.engine_config import EngineConfig

    for budget in (1 << 16, 1 << 30):
        model = shard_model(load_model(path), make_mesh(1, 2, devices=jax.devices()[:2]))
        config = EngineConfig(model=path, page_size=16, mla_latent="auto", kv_cache_memory_bytes=budget, max_num_seqs=4,
                              max_model_len=160)
        auto_latent(config, model, 10)
        print("AUTO", budget, model.tp.latent_split)
"""


def _run_split(path: Path, sizes: str, tmp_path: Path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "logits.npz"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(out), sizes],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.splitlines(), np.load(out)


@pytest.mark.parametrize(
    "family,sizes,heads_split",
    [
        ("deepseek_v3", "5,2", (True, False)),
        pytest.param("kimi_linear_tp", "2,4", (True, True), marks=pytest.mark.slow),
    ],
)
def test_split_latent_matches_one_device_and_hf(tiny_checkpoint, hf_model, tmp_path, family, sizes, heads_split):
    lines, got = _run_split(tiny_checkpoint(family), sizes, tmp_path)
    pools = [x.split() for x in lines if x.startswith("POOL ")]
    for (_, m, attention, rows, held, *_), want in zip(pools, heads_split, strict=True):
        assert attention == str(want) and int(rows) == 20 and int(held) == 20 // int(m), pools
    assert [x for x in lines if x.startswith("GREEDY ")] == [f"GREEDY {m} True" for m in sizes.split(",")], lines
    if family == "deepseek_v3":  # 41 pages x 16 tokens x 336 B: a 64 KiB pool is the bound, 1 GiB is not
        assert [x for x in lines if x.startswith("AUTO ")] == [f"AUTO {1 << 16} True", f"AUTO {1 << 30} False"], lines
    reference = hf_logits(hf_model(family), got["ids"].tolist())
    np.testing.assert_allclose(got["one"], reference, atol=1e-4, rtol=0)
    for m in sizes.split(","):
        np.testing.assert_allclose(got[f"tp{m}"], got["one"], atol=1e-5, rtol=0, err_msg=f"tp{m} vs one device")
        np.testing.assert_allclose(got[f"tp{m}"], reference, atol=1e-4, rtol=0, err_msg=f"tp{m} vs HF")


ENGINE_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

rng = np.random.default_rng(0)
shared = rng.integers(3, 1000, 24).tolist()
prompts = {f"r{i}": shared + rng.integers(3, 1000, n).tolist() for i, n in enumerate([5, 60, 9, 73])}

def run(mesh_shape, mode):
    engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", load_tokenizer=False, mesh_shape=mesh_shape,
                                    mla_latent=mode, page_size=8, num_pages=22, max_num_seqs=4, max_num_batched_tokens=16,
                                    token_buckets=(4, 16), max_model_len=160, enable_prefix_caching=True, aot_compile=False))
    assert engine.model.tp is None or engine.model.tp.latent_split
    done = {}
    for i, (rid, ids) in enumerate(prompts.items()):
        engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True)))
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.stats()
    return done, [stats["num_preemptions"], stats["prefix_cache_hit_tokens"], stats["pages_used"]]

print("RESULT " + json.dumps({"prompts": prompts, "split": run((1, 2), "split"), "one": run(None, "replicated")}))
"""


def test_split_engine_matches_one_device_and_hf(tiny_checkpoint, hf_model):
    """An engine with the latent pool split over 2 devices (16-token steps: chunked prefill; a
    shared 24-token prefix: prefix-cache hits; 21 pages of 8 for ~280 tokens: a preemption) gives
    the one-device engine's greedy tokens and HF's, with the same preemptions and hits, every page back."""
    from hf_reference import assert_greedy_match, hf_greedy

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    path = tiny_checkpoint("deepseek_v3")
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(path)], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    (split, split_stats), (one, one_stats) = result["split"], result["one"]
    assert split == one and split_stats == one_stats, (split_stats, one_stats)
    assert split_stats[0] >= 1 and split_stats[1] > 0 and split_stats[2] == 0, split_stats
    for i, (rid, ids) in enumerate(result["prompts"].items()):
        expected, scores = hf_greedy(hf_model("deepseek_v3"), ids, 8 + i)
        assert_greedy_match(split[rid], expected, scores, f"split engine {rid}")


def test_local_slots_interleave_tokens_over_chips():
    """Token at position t of page p (slot p * ps + t) lives on chip t % m at local slot
    p * (ps / m) + t // m; padding (-1) nowhere; every slot on exactly one chip, no chip slot shared."""
    ps, m = 12, 3
    slots = np.array([0, 1, 2, 5, 11, 12, 23, 30, -1])
    held = np.stack([np.asarray(local_slots(slots, ps, m, i)) for i in range(m)])
    for t, slot in enumerate(slots):
        owners = [i for i in range(m) if held[i, t] >= 0]
        if slot < 0:
            assert owners == []
            continue
        page, offset = divmod(int(slot), ps)
        assert owners == [offset % m] and held[owners[0], t] == page * (ps // m) + offset // m
    for chip in held:  # no two tokens share a chip's slot
        live = chip[chip >= 0]
        assert len(set(live.tolist())) == len(live)


@pytest.mark.parametrize(
    "mode,m,page_size,kv_dtype,transfer,match",
    [
        ("sharded", 2, 16, "auto", False, "one of"),
        ("split", 3, 16, "auto", False, "multiple of the model axis 3"),
        ("split", 2, 16, "fp8_e4m3", False, "FP8"),
        ("split", 2, 16, "auto", True, "P/D"),
    ],
)
def test_split_refuses_what_it_does_not_serve(mode, m, page_size, kv_dtype, transfer, match):
    with pytest.raises(ValueError, match=match):
        check_split(mode, m, page_size, True, kv_dtype, transfer)


def test_auto_splits_only_where_the_replicated_pool_is_the_bound():
    assert check_split("auto", 2, 16, True, "auto", False, kv_bound=True)
    assert not check_split("auto", 2, 16, True, "auto", False, kv_bound=False)
    assert not check_split("auto", 2, 16, True, "fp8_e4m3", False, kv_bound=True)  # the split would refuse: replicated
    assert not check_split("auto", 3, 16, True, "auto", False, kv_bound=True)


def test_split_resolution():
    assert check_split("split", 2, 16, True, "auto", False)
    assert not check_split("split", 1, 16, True, "auto", False)  # no model axis to split over
    assert not check_split("split", 2, 16, False, "auto", False)  # no MLA layers
    assert not check_split("replicated", 2, 16, True, "auto", False)
