"""Tensor parallelism on a simulated 8-device CPU mesh: sharded == single-device.

The multi-device checks run in ONE subprocess (`jax_num_cpu_devices=8` must be set before any
JAX op, and must not leak into other tests); it prints a JSON report that the tests below read.
References are the same checkpoint on one device, no mesh (fp32): logits to ~1e-5, greedy tokens
exactly. Checkpoints have head counts that divide by the model axis (4); a (1, 3) mesh checks the
fall-back to replication of tensors whose heads / columns do not divide. The hybrid is
Qwen3.5-27B-shaped GQA (24 query / 4 KV heads): on a (1, 8) mesh its KV heads are repeated twice
(models.sharding.repeat_kv_heads), one per device, in bf16- and FP8-KV logits and through the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from models.model import load_model
    from models.ops import KernelOptions
    from models.sharding import shard_model
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.parallel.mesh import make_mesh
    from runtime.types import EngineRequest, SamplingParams

    paths = json.loads(sys.argv[1])
    ids = [5, 17, 300, 2, 999, 41, 7, 8, 9, 10, 11]
    report = {}

    def mesh(data, model):
        return make_mesh(data, model, devices=jax.devices()[:data * model])

    def describe(x):
        return {"spec": str(tuple(x.sharding.spec)), "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape)}

    refs = {}

    def logits_error(name, shape, opts=None, kv_dtype="auto"):
        if (name, kv_dtype) not in refs:
            refs[name, kv_dtype] = load_model(paths[name]).logits(ids, kv_dtype=kv_dtype)
        ref = refs[name, kv_dtype]
        model = shard_model(load_model(paths[name]), mesh(*shape))
        out = model.logits(ids, opts, kv_dtype=kv_dtype)
        g = model.params["groups"]
        leaves = {k: describe(v) for j in range(len(g)) for k, v in g[j].items()}
        leaves["embed"] = describe(model.params["embed"])
        caches = model.init_caches(4, 16, 2)
        leaves.update({f"cache_{k}_{j}": describe(c.k if k == "kv" else c)
                       for k in ("kv", "conv", "rec") for j, c in enumerate(caches[k]) if c is not None})
        return {"err": float(np.abs(out - ref).max()), "scale": float(np.abs(ref).max()),
                "leaves": leaves, "tp": [model.tp.attention, model.tp.gdn, model.tp.kv_repeat]}

    import time
    t0 = time.perf_counter()
    report["dense_2x4"] = logits_error("dense", (2, 4))
    report["fallback_1x3"] = logits_error("dense", (1, 3))
    print(f"dense done {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    report["hybrid_2x4"] = logits_error("hybrid", (2, 4))
    report["gqa_1x8"] = logits_error("hybrid", (1, 8))
    report["gqa_fp8_1x8"] = logits_error("hybrid", (1, 8), kv_dtype="fp8_e4m3")
    print(f"hybrid done {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    report["pallas_1x4"] = logits_error(
        "hybrid", (1, 4), KernelOptions(attention="pallas", gdn="pallas", interpret=True))

    def generate(mesh_shape):
        engine = LLMEngine(EngineConfig(
            model=paths["hybrid"], page_size=16, num_pages=16, max_num_seqs=4, max_num_batched_tokens=16,
            token_buckets=(16,), max_model_len=64, aot_compile=mesh_shape == (2, 4), load_tokenizer=False,
            enable_prefix_caching=False, mesh_shape=mesh_shape))  # aot on one mesh: the meshed start-up set compiles
        rng = np.random.default_rng(0)
        for i, n in enumerate([5, 13, 9]):
            engine.add_request(EngineRequest(f"r{i}", rng.integers(3, 1000, n).tolist(),
                                             SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)  # deltas add up
        rec = next(r for r in engine.caches["rec"] if r is not None)
        kv = next(c for c in engine.caches["kv"] if c is not None)
        return done, {"rec": describe(rec), "kv": describe(kv.k)} if mesh_shape else None

    print(f"pallas done {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    report["engine_single"], _ = generate(None)
    report["engine_2x4"], report["engine_rec"] = generate((2, 4))
    report["engine_1x8"], report["engine_1x8_caches"] = generate((1, 8))
    print(f"subprocess wall {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print("REPORT " + json.dumps(report))
""")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from models.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("tp_checkpoints")
    paths = {
        "dense": write_random_checkpoint(
            "llama", root / "llama", num_attention_heads=8, num_key_value_heads=4, vocab_size=1032
        ),
        "hybrid": write_random_checkpoint(
            "qwen3_5",
            root / "qwen3_5",
            num_attention_heads=24,  # Qwen3.5-27B's GQA: 24 query / 4 KV heads
            num_key_value_heads=4,
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            vocab_size=1032,
        ),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps({k: str(v) for k, v in paths.items()})],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    sys.stderr.write(proc.stderr[-2000:])
    return json.loads(line[len("REPORT ") :])


def _assert_close(case):
    assert case["err"] <= 1e-5 * max(1.0, case["scale"]), case["err"]


def test_dense_sharded_logits_match_single_device(report):
    case = report["dense_2x4"]
    assert case["tp"][0], "attention should be split: 8 query / 4 KV heads over 4"
    _assert_close(case)


def test_hybrid_sharded_logits_match_single_device(report):
    case = report["hybrid_2x4"]
    assert case["tp"] == [True, True, 1]
    _assert_close(case)


def test_pallas_under_shard_map_matches(report):
    _assert_close(report["pallas_1x4"])


def test_heads_that_do_not_divide_fall_back_to_replication(report):
    case = report["fallback_1x3"]  # 8 query / 4 KV heads, FFN 160: replicated; vocab 1032: split 3 ways
    assert case["tp"] == [False, False, 1]
    leaves = case["leaves"]
    assert leaves["q_proj"]["shard"] == leaves["q_proj"]["shape"]
    assert leaves["gate_proj"]["shard"] == leaves["gate_proj"]["shape"]
    assert leaves["embed"]["shard"][0] * 3 == leaves["embed"]["shape"][0]
    _assert_close(case)


@pytest.mark.parametrize(
    "name, split_dim",
    [
        ("q_proj", 2),
        ("k_proj", 2),
        ("o_proj", 1),
        ("down_proj", 1),
        ("embed", 0),
        ("in_qkv", 2),
        ("conv_w", 1),
        ("out_proj", 1),
        ("A_log", 1),
        ("cache_kv_1", 1),
        ("cache_conv_0", 2),
        ("cache_rec_0", 1),
    ],
)
def test_leaves_are_really_sharded(report, name, split_dim):
    leaf = report["hybrid_2x4"]["leaves"][name]
    expected = [n // 4 if d == split_dim else n for d, n in enumerate(leaf["shape"])]
    assert leaf["shard"] == expected, leaf
    assert "model" in leaf["spec"] and "data" not in leaf["spec"]


def test_engine_on_a_mesh_generates_the_same_greedy_tokens(report):
    single, sharded = report["engine_single"], report["engine_2x4"]
    assert len(single) == 3 and all(len(t) == 5 for t in single.values())
    assert sharded == single
    rec = report["engine_rec"]["rec"]  # [D, slots, H, K, V]: data 2 is attention DP (runtime/parallel/data_parallel.py)
    assert rec["shard"][0] * 2 == rec["shape"][0]  # each rank's slots on its own devices
    assert rec["shard"][2] * 4 == rec["shape"][2]  # engine caches split by value heads


@pytest.mark.parametrize("case", ["gqa_1x8", "gqa_fp8_1x8"])
def test_fewer_kv_heads_than_devices_repeat_each_head_and_match_one_device(report, case):
    """4 KV heads on 8 devices: each head repeated twice, so every device holds one KV head of the
    weights and of the cache (1/4 of the KV: attention was replicated before), 3 query heads."""
    case = report[case]
    assert case["tp"] == [True, True, 2]
    leaves = case["leaves"]
    D = 32
    assert leaves["k_proj"]["shape"][-1] == 8 * D and leaves["k_proj"]["shard"][-1] == D
    assert leaves["v_proj"]["shard"][-1] == D
    assert leaves["q_proj"]["shard"][-1] * 8 == leaves["q_proj"]["shape"][-1]  # 3 query heads (x2: gate)
    assert leaves["o_proj"]["shard"][1] * 8 == leaves["o_proj"]["shape"][1]
    assert leaves["cache_kv_1"]["shape"][1] == 8 and leaves["cache_kv_1"]["shard"][1] == 1
    _assert_close(case)


def test_engine_with_repeated_kv_heads_generates_the_same_greedy_tokens(report):
    assert report["engine_1x8"] == report["engine_single"]
    kv = report["engine_1x8_caches"]["kv"]  # [P, 8 held heads, ps, D]: one per device
    assert kv["shape"][1] == 8 and kv["shard"][1] == 1


# ---- in-process: layout helpers and config errors (one device is enough) ------------------------------
def test_qkv_permutation_round_trip_against_numpy():
    import jax.numpy as jnp

    from models.sharding import qkv_permutation, unpermute_qkv

    widths, shards = (6, 6, 12), 3  # Q, K 3 heads x 2, V 3 heads x 4
    canonical = np.arange(2 * 24, dtype=np.float32).reshape(2, 24)
    permuted = canonical[:, qkv_permutation(widths, shards)]
    # shard 1's block: its Q heads (channels 2-3), K (8-9), V (16-19)
    np.testing.assert_array_equal(permuted[0, 8:16], [2, 3, 8, 9, 16, 17, 18, 19])
    np.testing.assert_array_equal(np.asarray(unpermute_qkv(jnp.asarray(permuted), widths, shards)), canonical)


def test_make_mesh_names_the_device_mismatch():
    from runtime.parallel.mesh import make_mesh

    with pytest.raises(ValueError, match=r"data=2 x model=64 needs 128 devices"):
        make_mesh(2, 64)


def test_launch_config_parallel_section():
    from configs.schema import config_from_dict
    from runtime.engine.loading import engine_config_from_launch
    from runtime.parallel.mesh import initialize_multihost

    cfg = config_from_dict({"parallel": {"mesh": {"data": 2, "model": 4}}})
    assert engine_config_from_launch(cfg, "m").mesh_shape == (2, 4)
    assert engine_config_from_launch(config_from_dict({}), "m").mesh_shape is None
    prefill = engine_config_from_launch(config_from_dict({"parallel": {"role": "prefill"}}), "m")
    assert prefill.kv_transfer.role == "prefill"  # P/D (issue 12): the role reaches the engine
    assert initialize_multihost(cfg.parallel) is False  # no multihost section: nothing to start
