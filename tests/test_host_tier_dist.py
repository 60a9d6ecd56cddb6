"""The host-memory tier under attention DP (one tier per rank) and under P/D (a decode instance's
pulled pages and GDN state kept in its prefix cache, evicted to its host tier and hit there later).

DP (ONE subprocess, 2 simulated CPU devices, as tests/test_data_parallel.py with 8): the tiny Qwen3.5
hybrid on mesh (data 2, model 1), each rank's device pool far too small for its conversations
(13 pages, 2 running sequences per rank), serves a multi-turn chat with a shared system prompt;
every output equals a single-device engine with prefix caching off, both ranks' host tiers are hit,
each holds its share of cache.kv_offloading_size, and nothing leaks.

P/D (`slow`; in one process, an in-process connector as tests/test_kv_transfer.py's plugin): a prefill-
and a decode-role engine, both with a host tier and pools too small to keep a conversation, serve
turn 1 through P/D. The decode instance's pulled pages (and the GDN checkpoint its decode steps
keep past them) enter its prefix cache; filler traffic evicts them to host on both sides. Turn 2
through P/D hits the prefill instance's host tier, and turn 2 sent straight to the decode instance
(a local prefill there) hits the decode instance's host tier past the pulled pages; every output
equals a colocated engine with prefix caching off.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from engine_testing import drain

from paged_kv import CacheManager
from runtime.engine_config import EngineConfig, KVTransferConfig
from runtime.kv_transfer import KV_CONNECTORS
from runtime.kv_transfer.base import KVConnector, PullResult
from runtime.types import EngineRequest, SamplingParams

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
            model=path, load_tokenizer=False, aot_compile=True, dtype="float32", page_size=PS,
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


# ---- P/D ------------------------------------------------------------------------------------------
OFFERED: dict[str, list] = {}
TRANSFER_IDS = itertools.count(1)


class InProcessConnector(KVConnector):
    """Offered arrays wait in a dict; a pull takes them (once)."""

    def __init__(self, config):
        super().__init__(config)
        self._done = []

    def offer(self, arrays, descriptor):
        transfer_id = str(next(TRANSFER_IDS))
        OFFERED[transfer_id] = arrays
        return {"transfer_id": transfer_id, "descriptor": descriptor}

    def start_pull(self, key, params, descriptor, specs):
        import jax

        arrays = OFFERED.pop(params["transfer_id"])
        self._done.append(PullResult(key, arrays=[jax.device_put(a, s.sharding) for a, s in zip(arrays, specs)]))

    def poll(self):
        done, self._done = self._done, []
        return done

    def cancel(self, key):
        pass


PS = 8
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pd_engines(tiny_checkpoint):
    from runtime.engine.llm_engine import LLMEngine

    KV_CONNECTORS.register("host_tier_test_inproc", InProcessConnector)

    def config(**kw):
        return EngineConfig(
            aot_compile=False,
            model=str(tiny_checkpoint("qwen3_5")),
            dtype="float32",
            page_size=PS,
            num_pages=14,
            num_state_slots=5,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=64,
            load_tokenizer=False,
            **kw,
        )

    def role(name):
        return config(
            kv_transfer=KVTransferConfig(role=name, connector="host_tier_test_inproc"), kv_offloading_size=0.01
        )

    yield LLMEngine(role("prefill")), LLMEngine(role("decode")), LLMEngine(config(enable_prefix_caching=False))
    KV_CONNECTORS._targets.pop("host_tier_test_inproc", None)


def _run(engine, rid, prompt, params=None):
    engine.add_request(EngineRequest(rid, prompt, GREEDY, kv_transfer_params=params))
    return drain(engine)[rid]


@pytest.mark.slow  # three engines (~80 s on 2 busy cores)
def test_pd_instances_keep_pulled_state_on_host_and_hit_it(pd_engines):
    prefill, decode, colocated = pd_engines
    rng = np.random.default_rng(3)
    draw = lambda n: rng.integers(3, decode.model.cfg.vocab_size, size=n).tolist()

    def through_pd(rid, prompt):
        params = _run(prefill, f"p-{rid}", prompt, {"do_remote_decode": True}).kv_transfer_params
        assert params is not None and params["descriptor"]["num_tokens"] == len(prompt) - 1
        return _run(decode, rid, prompt, params).outputs[0].token_ids

    turn1 = draw(4 * PS + 1)  # 32 tokens pulled (4 pages); decode passes boundary 40
    got = through_pd("t1", turn1)
    assert got == _run(colocated, "t1", turn1).outputs[0].token_ids
    cache, p_cache = decode.scheduler.cache, prefill.scheduler.cache
    on_device = lambda c, tokens: CacheManager.lookup_prefix(c, tokens).num_tokens  # read-only: no host loads
    turn2 = turn1 + got + draw(5)
    assert on_device(cache, turn2) == 5 * PS  # pulled pages + the decode-time checkpoint
    for i in range(8):  # other conversations push turn 1 out of both device pools
        _run(decode, f"fill-d{i}", draw(6 * PS))
        _run(prefill, f"fill-p{i}", draw(6 * PS))
    assert on_device(cache, turn2) < 5 * PS  # gone from the device ...
    assert cache.hit_tokens(turn2) == 5 * PS  # ... kept on host
    assert on_device(p_cache, turn2) < 4 * PS and p_cache.hit_tokens(turn2) >= 4 * PS
    hits = (prefill.stats()["host_cache_hits"], decode.stats()["host_cache_hits"])
    want = _run(colocated, "t2", turn2).outputs[0].token_ids
    assert through_pd("t2", turn2) == want  # the prefill instance's host tier serves turn 2's prefix
    assert prefill.stats()["host_cache_hits"] > hits[0]
    local = _run(decode, "t2-local", turn2)  # straight to the decode instance: its own host tier
    assert local.outputs[0].token_ids == want and local.num_cached_tokens == 5 * PS
    assert decode.stats()["host_cache_hits"] > hits[1]
    for engine in (prefill, decode):
        engine.scheduler.check_invariants()
        stats = engine.stats()
        assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
        assert stats["host_cache_bytes"] <= stats["host_cache_capacity_bytes"]
