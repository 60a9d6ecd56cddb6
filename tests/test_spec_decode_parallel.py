"""Speculative decoding composed with tensor parallelism (issue 35): the verify step on a mesh.

TP=2 on simulated CPU devices (a subprocess: the device count must not leak), dense Llama and the
Qwen3.5 GDN hybrid: the verify executables are sharded like the plain steps (parameters and caches
in their shardings, host inputs replicated, caches returned in their layout), and the greedy
output with drafts equals the one-device engine's without speculation, token for token, under
chunked prefill, preemption and prefix hits, and for requests under a grammar, a logit bias and
a `min_tokens` ban (the masked and per-row-feature verify variants on the mesh). The reference is independent of the code under test:
an engine with `speculative_config` off and no mesh. Drafts come from the reference continuation
with one draft spoiled (`OracleDrafts`, tests/test_spec_decode_gdn.py), so accepted counts cycle
through 0 .. k whatever the tiny random model says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, "tests")
from engine_testing import drain
from test_spec_decode import PROMPTS, SPEC, _greedy_requests
from test_spec_decode_gdn import OracleDrafts, _engine
from runtime.speculative import speculator

path = sys.argv[1]

def serve(engine, requests):
    for r in requests:
        engine.add_request(r)
    done = drain(engine)
    s = engine.stats()
    assert s["pages_used"] == 0 and s["slots_used"] == 0, s
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}

off = _engine(path, None)
spec = _engine(path, SPEC, mesh_shape=(1, 2))
exe = next(iter(spec.speculator.verify.executables.values()), None)
tok = spec.tokenizer
oracle = OracleDrafts(spec.model.cfg.vocab_size)
speculator.propose_ngram = oracle
got, ref = {}, {}
for tag in ("g", "h"):  # the second round: the same prompts, prefix hits
    reqs = _greedy_requests(tok, tag)
    ref.update(serve(off, reqs))
    for r in reqs:
        oracle.add(r.prompt_token_ids, ref[r.request_id])
    got.update(serve(spec, reqs))
# under a grammar (masked verify rows) and with a logit bias and a min_tokens ban (per-row features)
from runtime.types import EngineRequest, SamplingParams, StructuredOutput
g = dict(max_tokens=16, temperature=0.0)
first = ref["g0"]
extra = [EngineRequest("x0", tok.encode(PROMPTS[0]), SamplingParams(**g, structured_output=StructuredOutput("regex", r"( ?[a-d])+"))),
         EngineRequest("x1", tok.encode(PROMPTS[1]), SamplingParams(**g, logit_bias={first[2]: -100.0})),
         EngineRequest("x2", tok.encode(PROMPTS[2]), SamplingParams(**g, min_tokens=10, stop_token_ids=[first[1]]))]
ref.update(serve(off, extra))
for r in extra:
    oracle.add(r.prompt_token_ids, ref[r.request_id])
got.update(serve(spec, extra))
cache = spec.caches["kv"][0] if spec.caches["kv"][0] is not None else spec.caches["rec"][0]
keys = list(spec.speculator.verify.executables)
print("REPORT " + json.dumps({"got": got, "ref": ref, "stats": spec.stats(), "tp": spec.opts.tp is not None,
      "cache_sharding": str(jax.tree.leaves(cache)[0].sharding.spec), "verify_keys": [str(k) for k in keys],
      "gdn_split": bool(getattr(spec.model.tp, "gdn", False))}))
"""


def _run(path) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("REPORT ") :])


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_tp2_speculation_equals_one_device_without(family, tiny_checkpoint):
    report = _run(tiny_checkpoint(family))
    stats = report["stats"]
    assert report["tp"] and "model" in report["cache_sharding"], report["cache_sharding"]
    assert report["verify_keys"], "no verify step ran"
    assert family != "qwen3_5" or report["gdn_split"], "the GDN heads are split over the model axis"
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_num_accepted_tokens_per_pos"][-1] > 0, stats  # all k drafts accepted in some steps
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert report["got"] == report["ref"]
