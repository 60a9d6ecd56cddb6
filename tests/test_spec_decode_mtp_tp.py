"""`speculative_config: {method: mtp}` under tensor parallelism (issue 35): the MTP layer split as the target.

TP=2 on simulated CPU devices (a subprocess: the device count must not leak). The MTP's decoder layer
is split as one of the target's full-attention layers (its KV pool on the KV heads; Qwen3-Next's MoE
as the target's MoE layers), `fc` row-parallel, the carry replicated (models/mtp.py). References are
independent of the code under test: greedy output equals the one-device engine's without speculation
(token for token, under chunked prefill, preemption and prefix hits, drafts accepted and rejected:
the `OracleMTP` of tests/test_spec_decode_mtp.py) and HF's greedy `generate`; every draft the sharded
MTP makes (the speculator's `draft_log`, the MTP's own drafts also when the oracle's are verified)
equals the torch chain (`TorchMTP`: HF's decoder-layer class with the checkpoint's `mtp.*` weights).
Under `slow`: one KV head on two chips (the MTP's KV heads repeated), Qwen3-Next's MoE MTP layer, and
the sealed AOT start-up set on the mesh (nothing compiles after start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import assert_greedy_match, hf_greedy
from test_spec_decode import NUM_TOKENS, PROMPTS
from test_spec_decode_mtp import TorchMTP, assert_drafts_match

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, "tests")
from engine_testing import drain
from test_spec_decode import _greedy_requests
from test_spec_decode_mtp import SPEC, OracleMTP, _engine
from runtime.speculative import speculator

path, variant = sys.argv[1], json.loads(sys.argv[2])

def serve(engine, requests):
    for r in requests:
        engine.add_request(r)
    done = drain(engine)
    s = engine.stats()
    assert s["pages_used"] == 0 and s["slots_used"] == 0, s
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}

off = _engine(path, None, **variant)
spec = _engine(path, SPEC, mesh_shape=(1, 2), **variant)
spec.speculator.draft_log = []
tok = spec.tokenizer
oracle = OracleMTP(spec.model.cfg.vocab_size)
own = speculator.propose_mtp
got, ref, hits = {}, {}, 0
for tag in ("g", "h"):  # the MTP's own drafts, then the oracle's (accepted counts 0 .. k) and prefix hits
    reqs = _greedy_requests(tok, tag)
    ref.update(serve(off, reqs))
    oracle.continuations += [r.prompt_token_ids + ref[r.request_id] for r in reqs]
    speculator.propose_mtp = own if tag == "g" else oracle
    got.update(serve(spec, reqs))
    hits = hits or spec.stats()["prefix_cache_hit_tokens"]
mtp = spec.model.params["mtp"]
shardings = {"k_proj": mtp["layer"]["k_proj"], "fc": mtp["fc"], "pool": spec.caches["mtp"]["kv"].k,
             "carry": spec.caches["mtp"]["hidden"]}
print("REPORT " + json.dumps({"got": got, "ref": ref, "stats": spec.stats(), "hits_first_round": hits,
      "log": spec.speculator.draft_log, "prompts": {r.request_id: r.prompt_token_ids for r in reqs}, "kv_repeat": spec.model.tp.kv_repeat,
      "shardings": {k: str(v.sharding.spec) for k, v in shardings.items()},
      "pool_heads": spec.caches["mtp"]["kv"].k.shape[1], "target_heads": spec.caches["kv"][1].k.shape[1]}))
"""


def _run(path, variant: dict) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), json.dumps(variant)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("REPORT ") :])


def _check(report, hf, path, kv_repeat: int):
    stats = report["stats"]
    assert report["kv_repeat"] == kv_repeat
    sh = report["shardings"]
    assert sh["k_proj"] == "P(None, 'model')" and sh["pool"] == "P(None, 'model')", sh  # KV heads split
    assert sh["fc"] == "P('model', None)" and sh["carry"] == "P()", sh
    assert report["pool_heads"] == report["target_heads"]  # the pool holds the target's (repeated) KV heads
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_num_accepted_tokens_per_pos"][-1] > 0, stats  # all k drafts accepted in some steps
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > report["hits_first_round"], stats
    assert report["got"] == report["ref"]
    assert all(len(tokens) == NUM_TOKENS for tokens in report["got"].values())
    for i, prompt in enumerate(PROMPTS[:3]):  # round h's prompts are round g's
        expected, scores = hf_greedy(hf, report["prompts"][f"h{i}"], NUM_TOKENS)
        assert_greedy_match(report["got"][f"g{i}"], expected, scores, f"TP=2 MTP {prompt!r}")
    log = report["log"]
    assert len(log) > 50, len(log)
    sequences = [report["prompts"]["h" + rid[1:]] + tokens for rid, tokens in report["got"].items()]
    assert_drafts_match(TorchMTP(hf, path, sequences), log, min_checked=len(log))


def test_tp2_mtp_drafts_and_greedy_output_qwen3_5(tiny_checkpoint, hf_model):
    """Qwen3.5 (KV heads 4 on 2 chips): the MTP split over the model axis drafts as the torch
    reference, and greedy output equals one device without speculation and HF."""
    path = tiny_checkpoint("qwen3_5")
    _check(_run(path, {}), hf_model("qwen3_5"), path, kv_repeat=1)


def _hf(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, overrides, variant, kv_repeat",
    [
        # one KV head on two chips: the MTP's k_proj / v_proj columns repeated as the target's (`repeat_kv_heads`)
        ("qwen3_5", dict(num_key_value_heads=1), {}, 2),
        # Qwen3-Next: scanned layer groups, its MTP layer MoE (experts split on their intermediate dim)
        (
            "qwen3_next",
            dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2),
            {"layer_loop": "scan", "gdn_backend": "chunked"},
            1,
        ),
    ],
    ids=["qwen3_5-kv-repeat", "qwen3_next-moe"],
)
def test_tp2_mtp_variants(family, overrides, variant, kv_repeat, tmp_path):
    from models.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(family, tmp_path / "ckpt", **overrides)
    _check(_run(path, variant), _hf(path), path, kv_repeat=kv_repeat)


AOT_SCRIPT = """
import json, logging, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, "tests")
from engine_testing import drain
from test_no_compile_after_startup import CompileCounter, mixed_requests
from test_spec_decode import PROMPTS
from test_spec_decode_mtp import SPEC, _engine
from runtime.types import EngineRequest, SamplingParams

engine = _engine(sys.argv[1], SPEC, mesh_shape=(1, 2), page_size=16, num_pages=64, max_num_batched_tokens=64,
                 token_buckets=(8, 64), max_model_len=256, aot_compile=True, aot_compile_all=True)
counter = CompileCounter()
logging.getLogger("jax").addHandler(counter)
jax.config.update("jax_log_compiles", True)
drafting = [EngineRequest(f"c{i}-{t}", engine.tokenizer.encode(p), SamplingParams(max_tokens=12, temperature=t, seed=i))
            for i, p in enumerate(PROMPTS) for t in (0.0, 1.0)]
for request in mixed_requests(engine.model.cfg.vocab_size) + drafting:
    engine.add_request(request)
drain(engine)
jax.config.update("jax_log_compiles", False)
print("REPORT " + json.dumps({"sealed": engine.speculator.verify.sealed, "compiled": [str(c) for c in counter.compiled],
      "drafted": engine.stats()["spec_decode_num_draft_tokens"]}))
"""


@pytest.mark.slow
def test_tp2_mtp_no_compile_after_startup(tiny_checkpoint):
    """The sealed start-up set on the mesh (the sharded MTP params and pool in every step, its
    drafts in the verify executables): a mixed workload plus drafting requests compile nothing."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", AOT_SCRIPT, str(tiny_checkpoint("qwen3_5"))]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    report = json.loads(line[len("REPORT ") :])
    assert report["sealed"] and report["drafted"] > 0, report
    assert report["compiled"] == [], report["compiled"]
