"""Nemotron-H under tensor parallelism on simulated CPU devices (subprocesses: the device count must
not leak), on the tiny `nemotron_h_moe` checkpoint with every block kind (M, E, *, -).

Model axis 2: the 6 Mamba-2 heads and 2 B/C groups split (in_proj / conv in the per-shard order of
models/mamba2_tp.py, the conv and the SSD scan per shard), attention heads split, MoE experts and the
MLP on their intermediate dimension. Model axis 3: the heads split, the 2 groups held 3 times each
(replicated), attention and the shared expert whole. Expert parallelism on 2: the 8 routed experts
4 per device behind the all-to-all of models/expert_parallel.py, with the gateless relu2 MLP. An
orbax checkpoint restored straight onto both meshes. Checked against the one-device model (logits,
within the bound the tests hold against HF) and against HF itself: the TP=2 and TP=3 engines' greedy
output (chunked prefill, a prefix-cache hit on a continuation, preemptions) is HF's and the TP=1
engine's, token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_reference import assert_greedy_match, hf_greedy

FAMILY = "nemotron_h_moe"

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[3]))
import numpy as np
from models.model import load_model
from models.orbax_io import write_checkpoint
from models.sharding import shard_model
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.parallel.mesh import make_mesh
from runtime.types import EngineRequest, SamplingParams

path, prompts, devices = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
ids = prompts["logits"]
ref = load_model(path, dtype="float32").logits(ids)
split, err = {}, {}
for m in (devices,):
    model = shard_model(load_model(path, dtype="float32"), make_mesh(1, m, devices=jax.devices()[:m]))
    g = next(g for g in model.params["groups"] if "in_proj" in g)
    e = next(g for g in model.params["groups"] if "experts_up" in g)
    split[m] = [model.tp.mamba, model.tp.attention, g["in_proj"].shape[-1], str(g["in_proj"].sharding.spec),
                str(e["experts_up"].sharding.spec)]
    err[m] = float(np.abs(model.logits(ids) - ref).max())
# an orbax checkpoint restored straight onto the mesh (models/orbax_io.py: the held layout's shardings)
base = load_model(path, dtype="float32")
out = write_checkpoint(base.params, base.cfg, path, f"{sys.argv[4]}/orbax{devices}", "float32")
restored = load_model(out, mesh=make_mesh(1, devices))
err[f"orbax{devices}"] = float(np.abs(restored.logits(ids) - ref).max())
g = next(g for g in restored.params["groups"] if "in_proj" in g)
split[f"orbax{devices}"] = [g["in_proj"].shape[-1], str(g["in_proj"].sharding.spec)]
if devices == 2:  # expert parallelism: the 8 routed experts 4 per device, tokens moved by all-to-all
    model = shard_model(load_model(path, dtype="float32"), make_mesh(1, 2), expert_parallel=True)
    e = next(g for g in model.params["groups"] if "experts_up" in g)
    split["ep2"] = [model.tp.expert, str(e["experts_up"].sharding.spec)]
    err["ep2"] = float(np.abs(model.logits(ids) - ref).max())

def run(mesh_shape):
    engine = LLMEngine(EngineConfig(model=path, load_tokenizer=False, mesh_shape=mesh_shape, page_size=8, num_pages=22,
                                    max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(4, 16), max_model_len=128,
                                    enable_prefix_caching=True, aot_compile=False, dtype="float32"))
    done, cached, used = {}, {}, {}
    for wave in prompts["waves"]:
        for rid, p in wave.items():
            if isinstance(p, dict):  # a chat continuation: an earlier prompt, its output, new tokens
                p = used[p["continue"]] + done[p["continue"]] + p["extra"]
            used[rid] = p
            engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens or 0)
    s = engine.stats()
    return {"tokens": done, "cached": cached, "preemptions": s["num_preemptions"], "leaked": s["pages_used"] + s["slots_used"],
            "prompts": used}

print("REPORT " + json.dumps({"split": split, "err": err, "tp1": run(None) if devices == 2 else None, f"tp{devices}": run((1, devices))}))
"""


@pytest.fixture(scope="module")
def report_and_prompts(tiny_checkpoint, tmp_path_factory):
    rng = np.random.default_rng(3)
    draw = lambda n: rng.integers(3, 1031, size=n).tolist()
    shared = draw(41)
    prompts = {
        "logits": draw(40),
        "waves": [
            {"a": shared, "b": draw(23)},
            {"c": {"continue": "a", "extra": draw(6)}, "d": draw(60), "e": draw(55), "f": draw(50)},
        ],
    }
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    report, tmp = {}, tmp_path_factory.mktemp("nemotron_tp")
    for devices in (2, 3):
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tiny_checkpoint(FAMILY)), json.dumps(prompts), str(devices), str(tmp)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
        assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
        for key, value in json.loads(line[len("REPORT ") :]).items():
            report[key] = {**report.get(key, {}), **value} if key in ("split", "err") else report.get(key) or value
    return report, prompts


def test_tp_and_ep_split_and_match_one_device(report_and_prompts):
    """Model axis 2: heads and groups split, in_proj as wide as the checkpoint's (2*72 + 2*2*10 + 6).
    Model axis 3: the 2 groups do not divide, each is held 3 times (lcm(2, 3) = 6 groups: in_proj
    2*72 + 2*6*10 + 6 wide), the heads still split; attention (4 heads) stays whole."""
    report, _ = report_and_prompts
    split = report["split"]
    assert split["2"] == [True, True, 190, "P(None, None, 'model')", "P(None, None, None, 'model')"], split
    assert split["3"] == [True, False, 270, "P(None, None, 'model')", "P(None, None, None, 'model')"], split
    assert split["orbax2"] == [190, "P(None, None, 'model')"] and split["orbax3"] == [270, "P(None, None, 'model')"]
    assert split["ep2"] == [True, "P(None, 'model', None, None)"], split  # experts [G, E, H, I] by index
    assert len(report["err"]) == 5 and max(report["err"].values()) <= 1e-4, report["err"]  # 2, 3, ep2, orbax 2 / 3


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = tiny_checkpoint(FAMILY)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def test_tp_engine_greedy_matches_tp1_and_hf(report_and_prompts, hf):
    report, _ = report_and_prompts
    tp1, tp2, tp3 = report["tp1"], report["tp2"], report["tp3"]
    assert tp3["tokens"] == tp2["tokens"] == tp1["tokens"] and len(tp2["tokens"]) == 6
    for run in (tp1, tp2, tp3):
        assert run["leaked"] == 0 and run["preemptions"] > 0 and run["cached"]["c"] >= 24, run
    for rid, ids in tp2["prompts"].items():
        expected, scores = hf_greedy(hf, ids, 12)
        assert_greedy_match(tp2["tokens"][rid], expected, scores, f"TP=2 engine {rid} ({len(ids)} tokens)")


def test_per_shard_order_with_a_replicated_group_by_hand():
    """4 heads of 1 channel, one B/C group of state 1, on 2 shards: the group is held twice and
    each shard's block reads [its z, its x, B, C, its dt] from the checkpoint's columns
    [z 0-3 | x 4-7 | B 8 | C 9 | dt 10-13] (conv channels [x 0-3 | B 4 | C 5])."""
    from models.mamba2_config import Mamba2Config
    from models.mamba2_tp import _sources, held_groups

    m = Mamba2Config(num_heads=4, head_dim=1, state_size=1, n_groups=1, conv_kernel=4, chunk_size=8)
    cols, conv = _sources(m, 2)
    assert held_groups(m, 2) == 2
    assert cols.tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 2, 3, 6, 7, 8, 9, 12, 13]
    assert conv.tolist() == [0, 1, 4, 5, 2, 3, 4, 5]
    split = Mamba2Config(num_heads=4, head_dim=1, state_size=1, n_groups=2, conv_kernel=4, chunk_size=8)
    cols, conv = _sources(split, 2)  # [z 0-3 | x 4-7 | B 8-9 | C 10-11 | dt 12-15]: each shard its own group
    assert cols.tolist() == [0, 1, 4, 5, 8, 10, 12, 13, 2, 3, 6, 7, 9, 11, 14, 15]
    assert conv.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def test_pd_transfer_refuses_replicated_groups(tiny_checkpoint):
    """The P/D wire carries the checkpoint's conv width: a layout that holds groups twice is refused."""
    from types import SimpleNamespace

    from jax.sharding import AbstractMesh, AxisType

    from models.config import parse_config
    from models.safetensors_io import read_json
    from models.sharding import tensor_parallel_plan
    from runtime.kv_transfer.layout import conv_permutation

    cfg = parse_config(read_json(tiny_checkpoint(FAMILY) / "config.json"))
    plans = {
        m: tensor_parallel_plan(cfg, AbstractMesh((1, m), ("data", "model"), axis_types=(AxisType.Auto,) * 2))
        for m in (2, 3)
    }
    assert conv_permutation(SimpleNamespace(cfg=cfg, tp=plans[2])) is not None
    with pytest.raises(ValueError, match="B/C groups replicated"):
        conv_permutation(SimpleNamespace(cfg=cfg, tp=plans[3]))


def test_abstract_model_holds_the_repeated_groups(tiny_checkpoint):
    """`jaxserve plan`'s abstract model (models/abstract.py) holds the layout the forward reads: on
    a model axis of 3 the 2 groups held 3 times (in_proj 270 wide, conv state 72 + 2*6*10)."""
    from jax.sharding import AbstractMesh, AxisType

    from models.abstract import abstract_caches, abstract_model, shard_abstract_model
    from models.config import parse_config
    from models.safetensors_io import read_json

    model = abstract_model(parse_config(read_json(tiny_checkpoint(FAMILY) / "config.json")), "float32")
    shard_abstract_model(model, AbstractMesh((1, 3), ("data", "model"), axis_types=(AxisType.Auto,) * 2))
    g = next(g for g in model.params["groups"] if "in_proj" in g)
    assert g["in_proj"].shape[-1] == 270 and g["conv_w"].shape[-2] == 72 + 2 * 6 * 10
    caches = abstract_caches(model, num_pages=4, page_size=8, num_slots=3)
    assert next(c for c in caches["conv"] if c is not None).shape[-1] == 72 + 2 * 6 * 10
