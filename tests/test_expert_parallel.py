"""Expert parallelism on a simulated 8-device CPU mesh: EP on (model 4) == single device, both MoE families.

One subprocess (`jax_num_cpu_devices=8` must be set before any JAX op and must not leak into other
tests) prints a JSON report read by the tests below. References are the same checkpoint on one
device, no mesh, fp32: logits within 1e-5, greedy tokens equal through the engine on mixed steps
(prefill chunks beside decodes, padding rows: 3 requests in one 16-token bucket) on (data 2,
model 4) through `EngineConfig` and on (model 8, one expert per device) through `LLM`'s vLLM names;
an orbax checkpoint restores straight into the EP sharding.
Checkpoints have 8 experts, top-3 routing. Qwen3-Next also splits attention and GDN heads (TP beside
EP); Qwen3.5-MoE keeps the tiny model's 6 / 2 heads, so attention stays replicated there.
The routing kernel is also checked in-process against a numpy reference with no mesh at all.
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
    import json, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from models.model import load_model
    from models.convert import convert_checkpoint
    from models.sharding import shard_model
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.engine.llm import LLM
    from runtime.parallel.mesh import make_mesh
    from runtime.types import EngineRequest, SamplingParams

    paths = json.loads(sys.argv[1])
    ids = [5, 17, 300, 2, 999, 41, 7, 8, 9, 10, 11]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 13, 9)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(page_size=16, num_pages=16, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,),
                         max_model_len=64, aot_compile=False, load_tokenizer=False, enable_prefix_caching=False)
    report, t0 = {}, time.perf_counter()

    def spec(x):
        return {"spec": str(tuple(x.sharding.spec)), "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape)}

    def engine_tokens(path, **extra):
        engine = LLMEngine(EngineConfig(model=path, **engine_kwargs, **extra))
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", prompt, greedy))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)  # deltas add up
        return [done[f"r{i}"] for i in range(len(prompts))], engine.model.tp.expert if extra else None

    mesh4 = make_mesh(1, 4, devices=jax.devices()[:4])
    for family, path in paths.items():
        ref = load_model(path).logits(ids)
        model = shard_model(load_model(path), mesh4, expert_parallel=True)
        group = model.params["groups"][0]
        report[family] = {
            "err": float(np.abs(model.logits(ids) - ref).max()), "scale": float(np.abs(ref).max()),
            "tp": [model.tp.attention, model.tp.gdn, model.tp.expert],
            "leaves": {k: spec(v) for k, v in group.items() if k.startswith(("experts_", "shared_"))},
            "single": engine_tokens(path)[0],
        }
        print(f"{family} logits + single engine {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    # 7 tokens on 4 devices: padded to 8 inside; every token routed to 3 of 8 experts
    from models.expert_parallel import routed_experts_ep
    from models.transformer import _routed_experts
    r = np.random.default_rng(1)
    x7, w7 = r.normal(size=(7, 16)).astype(np.float32), r.random((7, 3)).astype(np.float32)
    e7 = np.stack([r.permutation(8)[:3] for _ in range(7)]).astype(np.int32)
    gu, dn = r.normal(size=(8, 16, 10)).astype(np.float32), r.normal(size=(8, 5, 16)).astype(np.float32)
    single = np.asarray(_routed_experts(x7, w7, e7, gu, dn, 8))
    report["padded"] = {"err": float(np.abs(routed_experts_ep(x7, w7, e7, gu, dn, model.tp) - single).max()),
                        "scale": float(np.abs(single).max())}

    # an orbax checkpoint restored straight into the EP sharding (what a multi-host launch reads)
    orbax_dir = convert_checkpoint(paths["qwen3_next"], sys.argv[2], dtype="float32")
    restored = load_model(orbax_dir, mesh=mesh4, expert_parallel=True)
    report["orbax"] = {"err": float(np.abs(restored.logits(ids) - load_model(paths["qwen3_next"]).logits(ids)).max()),
                       "expert": restored.tp.expert,
                       "shard": list(restored.params["groups"][0]["experts_down"].addressable_shards[0].data.shape)}

    # the engine on a (data 2, model 4) mesh, EP over model, through EngineConfig
    report["qwen3_next"]["ep"], report["qwen3_next"]["engine_expert"] = engine_tokens(
        paths["qwen3_next"], mesh_shape=(2, 4), expert_parallel=True)
    # the offline API's vLLM names, on (model 8): one expert per device
    llm = LLM(paths["qwen3_5_moe"], tensor_parallel_size=8, enable_expert_parallel=True, **engine_kwargs)
    report["qwen3_5_moe"]["ep"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    report["qwen3_5_moe"]["engine_expert"] = llm.engine.model.tp.expert
    print(f"subprocess wall {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print("REPORT " + json.dumps(report))
""")

FAMILIES = {
    "qwen3_5_moe": dict(num_experts=8, num_experts_per_tok=3, vocab_size=1032),
    "qwen3_next": dict(
        num_experts=8,
        num_experts_per_tok=3,
        vocab_size=1032,
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
    ),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from models.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("ep_checkpoints")
    paths = {
        family: str(write_random_checkpoint(family, root / family, **overrides))
        for family, overrides in FAMILIES.items()
    }
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(paths), str(root / "orbax")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    sys.stderr.write(proc.stderr[-2000:])
    return json.loads(line[len("REPORT ") :])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_parallel_logits_match_single_device(report, family):
    case = report[family]
    assert case["tp"][2], "experts should be split by index"
    assert case["err"] <= 1e-5 * max(1.0, case["scale"]), case["err"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_parallel_engine_greedy_tokens_equal(report, family):
    case = report[family]
    assert len(case["single"]) == 3 and all(len(t) == 5 for t in case["single"])
    assert case["engine_expert"] is True
    assert case["ep"] == case["single"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_experts_are_split_by_index_and_the_shared_expert_by_columns(report, family):
    leaves = report[family]["leaves"]
    for name in ("experts_gate_up", "experts_down"):  # [G, E, in, out]: E/4 whole experts per device
        shape, shard = leaves[name]["shape"], leaves[name]["shard"]
        assert shard == [shape[0], shape[1] // 4, shape[2], shape[3]], leaves[name]
    gate = leaves["shared_gate_proj"]  # [G, H, I_shared]: still column-parallel
    assert gate["shard"][-1] * 4 == gate["shape"][-1]


def test_attention_and_gdn_stay_tensor_parallel_beside_ep(report):
    assert report["qwen3_next"]["tp"] == [True, True, True]


def test_token_count_that_does_not_divide_by_the_mesh_is_padded(report):
    case = report["padded"]
    assert case["err"] <= 1e-6 * max(1.0, case["scale"]), case


def test_orbax_checkpoint_restores_into_the_expert_parallel_sharding(report):
    case = report["orbax"]
    assert case["expert"] and case["shard"][1] == 8 // 4  # [G, E/4, I, H]
    assert case["err"] <= 1e-5, case["err"]


# ---- in-process (one device): the routing arithmetic and config errors ---------------------------------
def _numpy_moe(x, weights, experts, w_gate_up, w_down):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            h = x[t] @ w_gate_up[e]
            gate, up = np.split(h, 2)
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


@pytest.mark.parametrize("tokens", [7])
def test_routed_experts_ep_matches_numpy_on_a_one_device_mesh(tokens):
    import jax
    from jax.sharding import AxisType, Mesh

    from models.expert_parallel import routed_experts_ep
    from models.sharding import TensorParallel

    rng = np.random.default_rng(3)
    E, K, H, I = 6, 4, 8, 5
    x = rng.normal(size=(tokens, H)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, K)).astype(np.float32)
    w_gate_up = rng.normal(size=(E, H, 2 * I)).astype(np.float32)
    w_down = rng.normal(size=(E, I, H)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    plan = TensorParallel(mesh=mesh, attention=False, gdn=False, expert=True)
    got = np.asarray(routed_experts_ep(x, weights, experts, w_gate_up, w_down, plan))
    np.testing.assert_allclose(got, _numpy_moe(x, weights, experts, w_gate_up, w_down), rtol=1e-4, atol=1e-4)


def test_dispatch_capacity_never_drops():
    from models.expert_parallel import dispatch_capacity

    assert dispatch_capacity(4, top_k=10, local_experts=128) == 40  # all 10 picks may live on one device
    assert dispatch_capacity(4, top_k=10, local_experts=2) == 8  # a token picks each expert once


def test_experts_that_do_not_divide_are_refused(tiny_checkpoint):
    from jax.sharding import AbstractMesh

    from models.config import parse_config
    from models.safetensors_io import read_json
    from models.sharding import tensor_parallel_plan

    cfg = parse_config(read_json(tiny_checkpoint("qwen3_5_moe") / "config.json"))  # 6 experts
    mesh = AbstractMesh((1, 4), ("data", "model"))
    with pytest.raises(ValueError, match="6 experts do not divide by model axis 4"):
        tensor_parallel_plan(cfg, mesh, expert_parallel=True)
    assert not tensor_parallel_plan(cfg, mesh).expert  # default: expert-intermediate TP
    assert tensor_parallel_plan(cfg, AbstractMesh((1, 2), ("data", "model")), expert_parallel=True).expert


def test_plan_reports_expert_parallel_weights_per_device():
    """`jaxserve plan` with `parallel.expert: true` shards the abstract Qwen3-Next-80B by expert index
    over the v5p slice's model axis (no compile): each device holds 512 / 4 whole experts."""
    import os

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from configs import CONFIG_DIR, load_config
    from models.abstract import abstract_model, shard_abstract_model
    from models.config import parse_config
    from models.safetensors_io import read_json
    from runtime.aot.chip_report import format_report, model_config_json, per_device_bytes, plan_config, target_mesh

    name = "tpu-v5p-16-qwen3-next-80b-multihost.yaml"
    ep, tp = (load_config(CONFIG_DIR / name, {"parallel.expert": expert}) for expert in (True, False))
    cfg = parse_config(read_json(model_config_json(ep)))
    model = shard_abstract_model(abstract_model(cfg, "bfloat16"), target_mesh(ep), expert_parallel=True)
    gate_up = model.params["groups"][0]["experts_gate_up"]  # [G, E, H, 2I]
    assert gate_up.sharding.shard_shape(gate_up.shape) == (gate_up.shape[0], 512 // 4, *gate_up.shape[2:])
    assert per_device_bytes({"w": gate_up}) * 4 == gate_up.size * 2
    report = plan_config(ep, name, token_buckets=(), compile_sampler=False)
    assert report.expert_parallel and report.fits, report.problems
    assert "experts split by index (EP)" in format_report(report)
    # whole experts / 4 or every expert's intermediate / 4: the same bytes per device
    assert report.weight_bytes == plan_config(tp, name, token_buckets=(), compile_sampler=False).weight_bytes


def test_benchmark_reads_collective_bytes_from_hlo():
    from benchmarks.expert_parallel import analytic_wire_bytes, collectives

    hlo = "\n".join(
        [
            "  %all-to-all.1 = f32[4,40,256]{2,1,0} all-to-all(f32[4,40,256]{2,1,0} %x), replica_groups={{0,1,2,3}}",
            "  %ar = (f32[16,256]{1,0}, s32[8]{0}) all-reduce-start(%a, %b), to_apply=%add",
            "  %ar.done = (f32[16,256]{1,0}, s32[8]{0}) all-reduce-done(%ar)",
            "  %add.3 = f32[16,256]{1,0} add(%p, %q)",
        ]
    )
    comm = collectives(hlo, 4)
    assert comm["all-to-all"] == {"count": 1, "buffer_bytes": 4 * 40 * 256 * 4, "wire_bytes": 4 * 40 * 256 * 4 * 0.75}
    assert comm["all-reduce"]["buffer_bytes"] == 16 * 256 * 4 + 8 * 4 and comm["all-reduce"]["count"] == 1
    b = analytic_wire_bytes(128, 4, hidden=2048, experts=512, top_k=10, intermediate=512, shared=512)
    row = 2048 * 2
    assert b["tp"] == 1.5 * 128 * row  # ring all-reduce of [T, H] in bf16
    assert b["ep_padded"] == 2 * 3 * 320 * row + 0.75 * 128 * row + 1.5 * 128 * row  # C = 32 x 10
