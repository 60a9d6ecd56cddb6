"""Preemption by swap (paged_kv/preempt_swap.py): a preempted request's partial last page and running
GDN state go to host memory under its request id and come back at re-admission, so it resumes at
exactly its num_computed_tokens with nothing recomputed; a lost record (evicted, a failed read) is
recomputed as without the tier; a finished or aborted request's record is dropped.

Unit tests drive `TieredCacheManager` and the `Scheduler` directly (no JAX). The engine tests run a
KV-exhaustion workload (more decoding requests than the pool holds, so the scheduler preempts) on the
tiny Qwen3.5 hybrid and the tiny Llama, one engine pair per model for the module: every output
equals prefix caching off and HF transformers' greedy generation, swapped-in requests recompute no
token, and nothing leaks (pages, state slots, host bytes).
"""

import numpy as np
import pytest
from engine_testing import Outputs, drain
from hf_reference import assert_greedy_match, hf_greedy

from paged_kv.host_tier import KV, STATE
from paged_kv.tiered_cache import SwapCost, TieredCacheManager
from runtime.engine_config import EngineConfig, SchedulerConfig
from runtime.scheduling.request import Request
from runtime.scheduling.scheduler import Scheduler
from runtime.types import EngineRequest, SamplingParams

PS = 8
ALWAYS_SWAP = SwapCost(1e30, 0.0, 1e-9)  # loading anything beats recomputing one token
NEVER_SWAP = SwapCost(1.0, 1.0, 1e12)


# ---- unit: the manager --------------------------------------------------------------------------
def _manager(hybrid: bool = True, **kw) -> TieredCacheManager:
    args = dict(page_size=PS, num_pages=24, num_state_slots=6 if hybrid else 0, checkpoint_policy="page")
    return TieredCacheManager(host_bytes=10**6, **{**args, **kw})


def _gather(cache) -> dict:
    """What the engine's transfers do with the offload queue: store a stand-in value per entry
    (its kind, id and key), so a load can be traced back to what was gathered."""
    offloads, loads, _ = cache.take_transfers()
    for kind, rid, key in offloads:
        cache.store(kind, key, (kind, rid, key), 100)
    return {(kind, rid): value for kind, rid, value in loads}


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_swapped_out_request_comes_back_at_its_exact_progress(hybrid):
    cache = _manager(hybrid)
    tokens = list(range(3, 3 + 3 * PS + 4))  # 3 full pages + 3 computed tokens of the 4th (+1 to feed)
    done = len(tokens) - 1
    admission = cache.allocate("a", tokens, done)
    table, slot = list(admission.allocation.block_table), admission.allocation.state_slot
    cache.commit("a", tokens, done)
    assert cache.preempt("a", tokens, done)
    offloads = list(cache.offloads)
    assert (KV, table[3]) in [(k, r) for k, r, _ in offloads]  # the partial last page
    assert ((STATE, slot) in [(k, r) for k, r, _ in offloads]) == hybrid  # the running state at that token
    assert "a" not in cache.allocations and cache.resume_point("a") == (done, 0)
    _gather(cache)
    assert cache.stats()["host_cache_swapped_requests"] == 1
    back = cache.swap_in("a", tokens, done + 1)
    assert back is not None and back.copy_before == []
    allocation = back.allocation
    assert allocation.block_table[:3] == table[:3]  # the full pages never left the device
    assert allocation.num_published_pages == 3 and cache.resume_point("a") is None
    loads = _gather(cache)
    assert loads[(KV, allocation.block_table[3])][1] == table[3]  # the partial page, as gathered
    if hybrid:
        assert loads[(STATE, allocation.state_slot)][1] == slot  # the state, as gathered
    stats = cache.stats()
    assert (stats["host_cache_swap_outs"], stats["host_cache_swap_ins"]) == (1, 1)
    assert stats["host_cache_swapped_requests"] == 0 and not any(isinstance(k[1], tuple) for k in cache.host.entries)
    cache.check_invariants()
    cache.free("a")
    cache.check_invariants()


def test_full_pages_evicted_meanwhile_come_back_from_host():
    cache = _manager(num_pages=12)
    tokens = list(range(3, 3 + 3 * PS + 4))
    cache.allocate("a", tokens, len(tokens) - 1)
    cache.commit("a", tokens, len(tokens) - 1)
    cache.preempt("a", tokens, len(tokens) - 1)
    other = list(range(500, 500 + 11 * PS))
    assert cache.allocate("b", other, len(other)) is not None  # every page: a's go to host
    cache.free("b")
    _gather(cache)
    back = cache.swap_in("a", tokens, len(tokens))
    assert back is not None
    loads = _gather(cache)
    assert sum(kind == KV for kind, _ in loads) == 4  # three chain pages from host + the partial page
    assert cache.stats()["host_cache_pages_loaded"] == 3
    cache.check_invariants()


def test_a_lost_record_falls_back_to_recompute():
    for lose in ("evicted", "failed read", "not gathered"):  # (nothing else runs: no wait)
        cache = _manager()
        tokens = list(range(3, 3 + 2 * PS + 5))
        cache.allocate("a", tokens, len(tokens) - 1)
        cache.commit("a", tokens, len(tokens) - 1)
        cache.preempt("a", tokens, len(tokens) - 1)
        if lose != "not gathered":
            _gather(cache)
        if lose == "evicted":
            cache.host.resize(150)  # room for one of its two entries
        elif lose == "failed read":
            cache.host.fail_next = 1
        assert cache.swap_in("a", tokens, len(tokens)) is None and cache.resume_point("a") is None, lose
        assert cache.stats()["host_cache_swap_fallbacks"] == 1 and "a" not in cache.allocations
        assert not cache.offloads or lose != "not gathered"  # its queued gathers went with it
        cache.check_invariants()


def test_no_room_waits_while_others_run_and_never_when_nothing_does():
    cache = _manager(num_pages=8)
    tokens = list(range(3, 3 + 3 * PS + 4))
    cache.allocate("a", tokens, len(tokens) - 1)
    cache.commit("a", tokens, len(tokens) - 1)
    cache.preempt("a", tokens, len(tokens) - 1)
    _gather(cache)
    other = list(range(500, 500 + 6 * PS))
    cache.allocate("b", other, len(other))  # holds 6 of 7 pages: a's 4 do not fit
    _gather(cache)  # a's chain pages it evicted reach the host
    assert cache.swap_in("a", tokens, len(tokens)) is None and cache.resume_point("a") is not None
    cache.free("b")
    _gather(cache)
    assert cache.swap_in("a", tokens, len(tokens)) is not None
    cache.check_invariants()


def test_the_cost_rule_and_nothing_to_gain_leave_preemption_to_recompute():
    tokens = list(range(3, 3 + 2 * PS + 5))
    cache = _manager(swap_cost=NEVER_SWAP)
    cache.entry_bytes = {KV: 100, STATE: 1000}
    cache.allocate("a", tokens, len(tokens) - 1)
    cache.commit("a", tokens, len(tokens) - 1)
    assert not cache.preempt("a", tokens, len(tokens) - 1) and cache.resume_point("a") is None
    assert cache.stats()["host_cache_swap_declined"] == 1 and not cache.offloads
    cache = _manager(hybrid=False)  # attention only, stopped on a page boundary: the prefix cache has it all
    cache.allocate("a", tokens, 2 * PS)
    cache.commit("a", tokens, 2 * PS)
    assert not cache.preempt("a", tokens, 2 * PS) and cache.stats()["host_cache_swap_outs"] == 0


def test_the_scheduler_resumes_swapped_requests_and_drops_records_of_finished_ones():
    """A real Scheduler on a pool too small for its requests: swapped-in requests recompute no
    token; aborting a swapped-out request drops its record and its host entries."""
    cache = _manager(num_pages=12, num_state_slots=8)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64), cache)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", list(range(10 + i, 10 + i + 13)), params))
    aborted = False
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        _gather(cache)
        scheduler.update_from_output(out, {s.request_id: [7] for s in out.sequences if s.sample})
        scheduler.check_invariants()
        if cache.swapped and not aborted:
            rid = next(iter(cache.swapped))
            owned = sum(cache.host.nbytes(key) for key in cache.swapped[rid].keys.values())
            before = cache.host.bytes
            assert scheduler.abort(rid) and rid not in cache.swapped
            assert cache.host.bytes == before - owned
            aborted = True
    stats = scheduler.stats()
    assert aborted and stats["num_preemptions"] > 1 and stats["host_cache_swap_ins"] > 0, stats
    assert stats["preemption_recomputed_tokens"] == 0, stats
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and not cache.swapped
    cache.check_invariants()


# ---- the engine ----------------------------------------------------------------------------------
MAX_TOKENS = 20


def _config(path, hybrid: bool, **kw) -> EngineConfig:
    args = dict(
        aot_compile=False,
        model=str(path),
        dtype="float32",
        page_size=PS,
        num_pages=17,  # 16 usable pages for 4 running sequences of up to 48 tokens: preemption
        num_state_slots=9 if hybrid else 0,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        load_tokenizer=False,
    )
    return EngineConfig(**{**args, **kw})


def _prompts(vocab: int, n: int = 8, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.integers(3, vocab, size=int(rng.integers(13, 27))).tolist() for i in range(n)}


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _serve(engine, prompts: dict, outputs: Outputs | None = None) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, PARAMS))
    return drain(engine, outputs=outputs)


@pytest.fixture(scope="module", params=["qwen3_5", "llama"])
def swap_run(request, tiny_checkpoint):
    """Per model: a tiered engine that always swaps and an engine with caching off, the workload
    served through both."""
    from runtime.engine.llm_engine import LLMEngine

    family = request.param
    path, hybrid = tiny_checkpoint(family), family == "qwen3_5"
    tiered = LLMEngine(_config(path, hybrid, kv_offloading_size=0.01))
    cache = tiered.scheduler.cache
    cache.swap_cost, preempted, preempt = ALWAYS_SWAP, set(), cache.preempt
    cache.preempt = lambda rid, *a: preempted.add(rid) or preempt(rid, *a)  # which ones HF checks
    off = LLMEngine(_config(path, hybrid, enable_prefix_caching=False))
    prompts = _prompts(tiered.model.cfg.vocab_size)
    done = _serve(tiered, prompts)
    return family, tiered, off, prompts, done, sorted(preempted)


def test_swapped_requests_resume_exactly_and_match_caching_off_and_hf(swap_run, hf_model):
    family, tiered, off, prompts, done, preempted = swap_run
    stats = tiered.stats()
    assert stats["num_preemptions"] > 0 and stats["host_cache_swap_outs"] > 0 and stats["host_cache_swap_ins"] > 0
    assert stats["preemption_recomputed_tokens"] == 0, stats  # every preempted request resumed at its token
    assert stats["host_cache_swap_fallbacks"] == 0
    reference = _serve(off, prompts)
    assert off.stats()["preemption_recomputed_tokens"] > 0  # without the tier the same workload recomputes
    for rid in prompts:
        assert done[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
    hf = hf_model(family)
    for rid in preempted[:3]:  # swapped out and back in
        expected, scores = hf_greedy(hf, prompts[rid], MAX_TOKENS)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, rid)


def _leak_free(engine) -> None:
    """Every page and slot free or cached, no record left and no host byte held for one (the host
    keeps evicted pages and checkpoints only, within its cap)."""
    engine.scheduler.check_invariants()
    stats, cache = engine.stats(), engine.scheduler.cache
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
    assert stats["host_cache_swapped_requests"] == 0 and not cache.swapped
    swap_bytes = sum(n for (_, key), (_, n) in cache.host.entries.items() if isinstance(key, tuple))
    assert swap_bytes == 0 and all(isinstance(key, bytes) for _, key in cache.host.entries)
    assert cache.host.bytes == sum(n for _, n in cache.host.entries.values()) <= cache.host.capacity_bytes


def test_nothing_leaks_after_swaps(swap_run):
    _, tiered, *_ = swap_run
    _leak_free(tiered)


def _until_swapped(engine, seed: int) -> tuple[dict, Outputs]:
    """Fresh prompts stepped until a preempted request's record waits on host (the next seed's
    prompts if a batch ends without one); -> (the prompts, the outputs so far)."""
    cache, outputs, prompts = engine.scheduler.cache, Outputs(), {}
    for s in range(seed, seed + 8):
        batch = {f"s{s}-{rid}": p for rid, p in _prompts(engine.model.cfg.vocab_size, seed=s).items()}
        prompts.update(batch)
        for rid, prompt in batch.items():
            engine.add_request(EngineRequest(rid, prompt, PARAMS))
        while not cache.swapped and engine.has_unfinished():
            outputs.step(engine)
        if cache.swapped:
            return prompts, outputs
    raise AssertionError("no preemption was swapped out")


def test_abort_while_swapped_out_frees_the_record(swap_run):
    _, tiered, off, _, _, _ = swap_run
    cache = tiered.scheduler.cache
    prompts, outputs = _until_swapped(tiered, seed=1)
    victim = next(iter(cache.swapped))
    record_bytes = sum(cache.host.nbytes(k) for k in cache.swapped[victim].keys.values())
    bytes_before = cache.host.bytes
    assert tiered.abort(victim).finish_reason == "abort"
    assert victim not in cache.swapped and cache.host.bytes == bytes_before - record_bytes
    done = drain(tiered, outputs=outputs)
    reference = _serve(off, {rid: p for rid, p in prompts.items() if rid != victim})
    for rid in reference:
        assert done[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
    _leak_free(tiered)


def test_a_failing_host_load_recomputes_with_exact_output(swap_run):
    _, tiered, off, _, _, _ = swap_run
    cache = tiered.scheduler.cache
    before = tiered.stats()
    prompts, outputs = _until_swapped(tiered, seed=20)
    cache.host.fail_next = 10**6  # every host read fails from now on: records and host hits alike
    try:
        done = drain(tiered, outputs=outputs)
    finally:
        cache.host.fail_next = 0
    after = tiered.stats()
    assert after["host_cache_swap_fallbacks"] > before["host_cache_swap_fallbacks"]
    assert after["host_cache_load_failures"] > before["host_cache_load_failures"]
    assert after["preemption_recomputed_tokens"] > before["preemption_recomputed_tokens"]
    reference = _serve(off, prompts)
    for rid in prompts:
        assert done[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
    _leak_free(tiered)


def test_swap_counters_in_stats_and_metrics(swap_run):
    from prometheus_client.utils import floatToGoString

    from server.metrics import ServerMetrics

    _, tiered, *_ = swap_run
    stats, text = tiered.stats(), ServerMetrics(tiered.stats).render().decode()
    for name in ("swap_outs", "swap_ins", "swap_fallbacks", "swap_declined"):
        assert f"jaxserve_host_cache_{name}_total {floatToGoString(stats[f'host_cache_{name}'])}" in text, name
    assert stats["host_cache_swap_outs"] > 0 and "jaxserve_preemption_recomputed_tokens_total" in text


# ---- attention DP: each rank swaps into its own tier ------------------------------------------------
DP_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, "tests")
from engine_testing import drain
from test_preempt_swap import ALWAYS_SWAP, _config, _prompts, PARAMS
from runtime.engine.llm_engine import LLMEngine
from runtime.types import EngineRequest

path = sys.argv[1]
dp = LLMEngine(_config(path, True, kv_offloading_size=0.02, mesh_shape=(2, 1), aot_compile=True,
                       num_pages=34, num_state_slots=18))  # per rank: the single engine's pool
for rank in dp.scheduler.ranks:
    rank.cache.swap_cost = ALWAYS_SWAP
off = LLMEngine(_config(path, True, enable_prefix_caching=False))
vocab = dp.model.cfg.vocab_size
prompts = {**_prompts(vocab, n=8, seed=0), **{f"q{k}": p for k, p in _prompts(vocab, n=8, seed=5).items()}}
outs = {}
for engine in (dp, off):
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, PARAMS))
    outs[engine is dp] = {rid: o.outputs[0].token_ids for rid, o in drain(engine).items()}
s, ranks = dp.stats(), [r.cache.stats() for r in dp.scheduler.ranks]
print("REPORT" + json.dumps({
    "equal": outs[True] == outs[False],
    "swap_ins": [r["host_cache_swap_ins"] for r in ranks],
    "swap_outs": [r["host_cache_swap_outs"] for r in ranks],
    "stats": {k: v for k, v in s.items() if isinstance(v, (int, float))},
}))
"""


@pytest.mark.slow  # a subprocess with 2 CPU devices and two engines (~40 s on 2 busy cores)
def test_data_parallel_ranks_swap_into_their_own_tiers(tiny_checkpoint):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    path = str(tiny_checkpoint("qwen3_5"))
    proc = subprocess.run(
        [sys.executable, "-c", DP_SCRIPT, path], capture_output=True, text=True, env=env, timeout=900, cwd=root
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    r = json.loads(line[len("REPORT") :])
    assert r["equal"]
    assert all(n > 0 for n in r["swap_ins"]) and r["swap_ins"] == r["swap_outs"], r  # both ranks swapped
    s = r["stats"]
    assert s["preemption_recomputed_tokens"] == 0 and s["host_cache_swapped_requests"] == 0, s
    assert s["pages_used"] == 0 and s["slots_used"] == 0, s
