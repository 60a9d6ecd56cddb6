"""The host-memory tier under attention DP (one tier per rank) and under P/D (a decode instance's
pulled pages and GDN state kept in its prefix cache, evicted to its host tier and hit there later).

DP (ONE subprocess, 2 simulated CPU devices, as tests/test_data_parallel.py with 8): the tiny Qwen3.5
hybrid on mesh (data 2, model 1), each rank's device pool far too small for its conversations
(13 pages, 2 running sequences per rank), serves a multi-turn chat with a shared system prompt;
every output equals a single-device engine with prefix caching off, both ranks' host tiers are hit,
each holds its share of cache.kv_offloading_size, and nothing leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

DP_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    path = sys.argv[1]
    PS = 8
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def engine(mesh_shape, num_pages, **kw):
        return LLMEngine(EngineConfig(
            model=path, load_tokenizer=False, aot_compile=False, dtype="float32", page_size=PS,
            num_pages=num_pages, num_state_slots=10 if mesh_shape else 5, max_num_seqs=2,
            max_num_batched_tokens=32, max_model_len=64, mesh_shape=mesh_shape, **kw))

    def serve(eng, prompts):
        for rid, prompt in prompts.items():
            eng.add_request(EngineRequest(rid, prompt, params))
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        return done

    tiered = engine((2, 1), 28, kv_offloading_size=0.02)  # per rank: 14 pages, 5 slots, 0.01 GiB
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(3, tiered.model.cfg.vocab_size, size=n).tolist()
    system = draw(2 * PS)
    convs = {f"c{i}": system + draw(10) for i in range(6)}
    prompts, done, rank_of = {}, {}, {}
    for turn in range(3):
        wave = {f"{cid}t{turn}": p for cid, p in convs.items()}
        prompts.update(wave)
        for rid, prompt in wave.items():
            tiered.add_request(EngineRequest(rid, prompt, params))
        rank_of.update({rid: tiered.scheduler.rank_of[rid] for rid in wave})
        while tiered.has_unfinished():
            for out in tiered.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        for cid in convs:
            convs[cid] = convs[cid] + done[f"{cid}t{turn}"] + draw(5)
    tiered.scheduler.check_invariants()
    stats = tiered.stats()
    ranks = [s.cache for s in tiered.scheduler.ranks]
    for cache in ranks:
        cache.host.check_invariants()
    off = engine(None, 14, enable_prefix_caching=False)
    reference = serve(off, prompts)
    print("REPORT" + json.dumps({
        "equal": {rid: done[rid] == reference[rid] for rid in prompts},
        "rank_of": rank_of,
        "host_hits": [c.host.num_hits for c in ranks],
        "pages_loaded": [c.num_materialized_pages for c in ranks],
        "checkpoints_loaded": [c.num_materialized_checkpoints for c in ranks],
        "host_bytes": [c.host.bytes for c in ranks],
        "capacity": [c.host.capacity_bytes for c in ranks],
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
        "load_batches": [t.num_load_batches for t in tiered.host_tier.tiers],
    }))
""")


@pytest.fixture(scope="module")
def dp_report(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3_5"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", DP_SCRIPT, path], capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("REPORT") :])


def test_data_parallel_ranks_each_keep_a_host_tier(dp_report):
    r = dp_report
    assert all(r["equal"].values()), [rid for rid, ok in r["equal"].items() if not ok]
    assert set(r["rank_of"].values()) == {0, 1}  # the conversations are spread over both ranks
    for rid, rank in r["rank_of"].items():  # a returning conversation stays where its prefix is
        assert rank == r["rank_of"][rid[:-1] + "0"], rid
    assert all(h > 0 for h in r["host_hits"]), r["host_hits"]  # each rank hits its own tier
    assert all(p > 0 for p in r["pages_loaded"]) and all(c > 0 for c in r["checkpoints_loaded"]), r
    assert all(b > 0 for b in r["load_batches"]), r["load_batches"]
    share = int(0.02 * 2**30) // 2  # cache.kv_offloading_size split over the ranks, like cache.num_pages
    assert r["capacity"] == [share, share] and all(0 < b <= share for b in r["host_bytes"])
    s = r["stats"]
    assert s["host_cache_hits"] == sum(r["host_hits"]) and s["host_cache_capacity_bytes"] == 2 * share
    assert [s["dp_rank0_host_cache_hits"], s["dp_rank1_host_cache_hits"]] == r["host_hits"]
    assert s["pages_used"] == 0 and s["slots_used"] == 0, s  # nothing leaked on either rank
