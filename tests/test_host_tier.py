"""The host-memory tier (cache.kv_offloading_size): evicted KV pages and GDN checkpoints kept in host
memory, host hits loaded back bitwise, failed loads recomputed, byte caps held, nothing leaked.

Unit tests drive `HostStore` and `TieredCacheManager` directly (no JAX). The engine tests share
one engine on the tiny Qwen3.5 hybrid whose device pool is far too small for the conversations
(13 KV pages, 4 state slots, 2 running sequences): a multi-turn chat with a shared system prompt
is served through the host tier and every output is compared with HF transformers' greedy
generation of the whole prompt and with an engine that has prefix caching off.
"""

import jax
import numpy as np
import pytest
from engine_testing import drain
from hf_reference import assert_greedy_match, hf_greedy

from benchmarks.prefix_cache_sim import SimConfig, ceiling, run_trace
from benchmarks.prefix_traces import Session, Turn
from paged_kv import CacheManager
from paged_kv.checkpoint_policy import CHECKPOINTS_PER_SEQ, plan_state_slots
from paged_kv.host_tier import KV, STATE, HostStore
from paged_kv.tiered_cache import SwapCost, TieredCacheManager
from runtime.engine.host_tier import refuse_host_tier
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

PS, MAX_TOKENS = 8, 6


# ---- unit: the store, the manager, the slot plan ---------------------------------------------------
def test_host_store_is_an_lru_within_its_byte_cap():
    store = HostStore(100)
    assert store.put("a", 1, 40) and store.put("b", 2, 40)
    assert store.get("a") == 1  # a is now the most recently used
    assert store.put("c", 3, 40)  # evicts b, the least recently used
    assert "b" not in store and store.get("a") == 1 and store.get("c") == 3
    assert store.bytes == 80 and store.num_evictions == 1 and store.num_hits == 3
    assert not store.put("huge", 0, 101) and "huge" not in store  # never fits: refused, nothing evicted
    store.resize(50)  # shrinking the cap drops LRU entries until the rest fit
    assert len(store) == 1 and store.bytes == 40 and store.num_evictions == 2
    store.discard("c")
    assert store.bytes == 0 and store.num_dropped == 1
    store.check_invariants()
    with pytest.raises(ValueError, match="positive byte capacity"):
        HostStore(0)


def test_a_failed_host_read_is_counted_and_dropped():
    store = HostStore(100)
    store.put("a", 1, 10)
    store.fail_next = 1
    assert store.get("a") is None and store.num_failures == 1 and "a" not in store
    assert store.get("missing") is None and store.num_failures == 1  # a miss is not a failure


def test_checkpoint_slots_are_sized_by_memory_with_per_sequence_and_per_page_caps():
    slot, page = 1000, 100
    # the budget binds: 0.25 x 100k = 25 slots
    assert plan_state_slots(
        max_num_seqs=4, prefix_caching=True, budget_fraction=0.25, cache_bytes=100_000, state_bytes_per_slot=slot
    ) == (1 + 4 + 25, 25)
    # 32 per sequence binds
    big = 10**9
    assert plan_state_slots(
        max_num_seqs=2, prefix_caching=True, budget_fraction=0.5, cache_bytes=big, state_bytes_per_slot=slot
    ) == (1 + 2 + 2 * CHECKPOINTS_PER_SEQ, 2 * CHECKPOINTS_PER_SEQ)
    # one checkpoint per page: (20k - 5 running slots) / (page + slot) = 13 < 0.9 x 20k / 1k = 18
    num_slots, checkpoints = plan_state_slots(
        max_num_seqs=4,
        prefix_caching=True,
        budget_fraction=0.9,
        cache_bytes=20_000,
        state_bytes_per_slot=slot,
        page_bytes=page,
    )
    assert checkpoints == (20_000 - 5 * slot) // (page + slot) == 13
    assert (20_000 - num_slots * slot) // page >= checkpoints  # the pages left hold at least that many


def _chat(num_sessions: int, turns: int, seed: int = 0) -> list[Session]:
    rng = np.random.default_rng(seed)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, 1000, size=n))
    system = draw(2 * PS)
    return [
        Session(
            f"s{i}",
            tuple(Turn((system if k == 0 else ()) + draw(10 if k == 0 else 5), draw(7)) for k in range(turns)),
            i,
        )
        for i in range(num_sessions)
    ]


def _manager(host_bytes: int | None, **kw):
    args = dict(page_size=PS, num_pages=24, num_state_slots=6, checkpoint_policy="auto", num_checkpoint_slots=3)
    args.update(kw)
    return TieredCacheManager(host_bytes=host_bytes, **args) if host_bytes else CacheManager(**args)


def test_host_tier_brings_a_small_pool_to_the_hit_rate_ceiling():
    """The simulator's driver (real Scheduler, fake model) on a chat trace with more conversations than
    the device keeps: the host tier takes every evicted page and checkpoint, lookups find them again."""
    sessions, config = _chat(8, 4), SimConfig(page_size=PS, max_num_seqs=2, max_num_batched_tokens=32)
    top = ceiling(sessions, config)["hit_rate"]
    device_only = run_trace(sessions, _manager(None), config)["stats"]
    tiered = _manager(10**6)
    run = run_trace(sessions, tiered, config, sizes=(100, 1000))["stats"]
    tiered.check_invariants()
    assert device_only["prefix_cache_hit_rate"] < 0.8 * top  # the pool alone loses the conversations
    assert run["prefix_cache_hit_rate"] >= 0.95 * top
    assert run["host_cache_pages_loaded"] > 0 and run["host_cache_checkpoints_loaded"] > 0
    assert run["host_cache_bytes"] <= 10**6 and run["pages_used"] == 0 and run["slots_used"] == 0


def test_host_cap_is_held_and_superseded_checkpoints_leave_the_host():
    sessions, config = _chat(8, 4), SimConfig(page_size=PS, max_num_seqs=2, max_num_batched_tokens=32)
    tiered = _manager(10 * 100)  # ten pages' worth
    run = run_trace(sessions, tiered, config, sizes=(100, 300))["stats"]
    tiered.check_invariants()
    assert run["host_cache_bytes"] <= 1000 and run["host_cache_evictions"] > 0
    assert run["host_cache_superseded"] > 0  # a rolling checkpoint replaced after it went to host


def test_a_materialized_checkpoint_survives_until_its_load_ran():
    """A host hit's checkpoint slot is read by the same step's copy_before: it cannot be evicted
    (and its load cancelled) by a later admission of the same schedule."""
    cache = _manager(10**6, num_pages=40, num_state_slots=4, num_checkpoint_slots=None, checkpoint_policy="page")
    tokens = list(range(3, 3 + 3 * PS + 1))
    cache.allocate("a", tokens, len(tokens))
    cache.reserve_checkpoint("a", tokens, 3 * PS)
    cache.commit("a", tokens, len(tokens))
    cache.free("a")
    cache._evict_checkpoint(cache.slots.checkpoints.evict_lru())  # as the budget would: to host
    offloads, _, _ = cache.take_transfers()
    assert [kind for kind, _, _ in offloads] == [STATE]
    for kind, _, block_hash in offloads:
        cache.store(kind, block_hash, kind, 10)
    hit = cache.lookup_prefix(tokens + [1, 2])
    assert hit.num_tokens == 3 * PS and hit.checkpoint_slot is not None
    assert hit.checkpoint_slot not in cache.slots.checkpoints.evictable  # pinned until loaded
    taken = []
    while (slot := cache.slots.acquire()) is not None:  # every other slot; the pinned one is never evicted
        taken.append(slot)
    assert cache.slots.lookup_checkpoint(hit.block_hashes[2]) == hit.checkpoint_slot
    for slot in taken:
        cache.slots.release(slot)
    cache.check_invariants()
    _, loads, _ = cache.take_transfers()
    assert (STATE, hit.checkpoint_slot, "state") in loads
    assert hit.checkpoint_slot in cache.slots.checkpoints.evictable  # loaded: evictable again


def test_swap_cost_compares_a_load_with_a_recompute():
    cost = SwapCost(load_bytes_per_s=1e9, load_latency_s=1e-3, recompute_tokens_per_s=1e4)
    assert cost.load_seconds(10**6) == pytest.approx(2e-3) and cost.recompute_seconds(16) == pytest.approx(1.6e-3)
    assert not cost.prefers_load(10**6, 16) and cost.prefers_load(10**6, 32)
    with pytest.raises(ValueError, match="positive"):
        SwapCost(0, 0, 1)
    from types import SimpleNamespace

    from runtime.steps.execution_plan import BACKENDS, HOST_SWAP_COST, plan_execution

    model = SimpleNamespace(num_layers=8, is_hybrid=True)
    for backend in BACKENDS:  # every backend's plan carries the rule's constants, each one usable
        plan = plan_execution(EngineConfig(model="m", kv_offloading_size=1), model, backend)
        assert plan.host_swap_cost == HOST_SWAP_COST[backend]
        SwapCost(*plan.host_swap_cost)


def test_the_cost_rule_declines_a_host_hit_that_recomputing_beats():
    """Unit: the same host hit taken under one cost and declined (device depth answered) under another."""
    tokens = list(range(3, 3 + 3 * PS + 1))
    for cost, taken in ((SwapCost(1e30, 0.0, 1e-9), True), (SwapCost(1.0, 1.0, 1e12), False)):
        cache = _manager(10**6, num_pages=40, num_checkpoint_slots=None, checkpoint_policy="page", swap_cost=cost)
        cache.allocate("a", tokens, len(tokens))
        cache.reserve_checkpoint("a", tokens, 3 * PS)
        cache.commit("a", tokens, len(tokens))
        cache.free("a")
        other = list(range(500, 500 + 39 * PS))
        assert cache.allocate("b", other, len(other)) is not None  # takes every page: a's go to host
        cache.free("b")
        for kind, _, block_hash in cache.take_transfers()[0]:
            cache.store(kind, block_hash, kind, 100)
        hit = cache.lookup_prefix(tokens + [1])
        stats = cache.stats()
        assert hit.num_tokens == (3 * PS if taken else 0)
        assert (stats["host_cache_hits_taken"], stats["host_cache_recomputes"]) == ((1, 0) if taken else (0, 1))
        assert stats["host_cache_pages_loaded"] == (3 if taken else 0)


def test_offloading_size_from_yaml_keys_and_the_cli_flag():
    from configs.schema import config_from_dict
    from runtime.engine_config import build_engine_config
    from server.cli import _load, _parser

    launch = config_from_dict({"cache": {"kv_offloading_size": 2, "kv_offloading_backend": "native"}})
    engine = build_engine_config(launch, "m")
    assert (engine.kv_offloading_size, engine.kv_offloading_backend) == (2, "native")
    with pytest.raises(ValueError, match="native"):
        config_from_dict({"cache": {"kv_offloading_backend": "lmcache"}})
    args = _parser().parse_args(["config", "--kv-offloading-size", "1.5", "--kv-offloading-backend", "native"])
    assert _load(args).cache.kv_offloading_size == 1.5
    assert build_engine_config(config_from_dict({}), "m").kv_offloading_size is None  # off by default


def test_config_keys_and_start_up_refusals():
    config = EngineConfig(model="x", kv_offloading_size=0.5)
    assert config.cache_config(num_pages=40, max_model_len=64).host_tier_bytes == 2**29
    assert isinstance(config.cache_config(num_pages=40, max_model_len=64).build_manager(), TieredCacheManager)
    with pytest.raises(ValueError, match="native"):
        EngineConfig(model="x", kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(model="x", kv_offloading_size=-1)
    refuse_host_tier(config, window=None)  # supported (attention DP too: tests/test_host_tier_dist.py)
    refuse_host_tier(EngineConfig(model="x"), window=4)  # off: nothing to refuse
    with pytest.raises(ValueError, match="window_paging"):
        refuse_host_tier(config, window=128)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        refuse_host_tier(EngineConfig(model="x", kv_offloading_size=1, enable_prefix_caching=False), None)


# ---- the engine -----------------------------------------------------------------------------------
def _engine_config(path, **kw) -> EngineConfig:
    return EngineConfig(
        aot_compile=False,
        model=str(path),
        dtype="float32",
        page_size=PS,
        num_pages=14,  # 13 usable pages for 2 running sequences of up to 64 tokens
        num_state_slots=5,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_model_len=64,
        load_tokenizer=False,
        **kw,
    )


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    from runtime.engine.llm_engine import LLMEngine

    path = tiny_checkpoint("qwen3_5")
    tiered = LLMEngine(_engine_config(path, kv_offloading_size=0.01))
    off = LLMEngine(_engine_config(path, enable_prefix_caching=False))
    return tiered, off


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _serve(engine, prompts: dict) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, PARAMS))
    return drain(engine)


@pytest.fixture(scope="module")
def chat(engines):
    """5 conversations x 3 turns (shared 16-token system prompt) through the host-tier engine."""
    tiered, _ = engines
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(3, tiered.model.cfg.vocab_size, size=n).tolist()
    system = draw(2 * PS)
    convs = {f"c{i}": system + draw(10) for i in range(5)}
    prompts, done = {}, {}
    for turn in range(3):
        wave = {f"{cid}t{turn}": p for cid, p in convs.items()}
        prompts.update(wave)
        done.update(_serve(tiered, wave))
        for cid in convs:
            convs[cid] = convs[cid] + done[f"{cid}t{turn}"].outputs[0].token_ids + draw(5)
    return prompts, done, tiered.stats(), draw


def test_chat_through_the_host_tier_matches_caching_off_and_hf(engines, chat, hf_model):
    _, off = engines
    prompts, done, stats, _ = chat
    assert stats["host_cache_pages_loaded"] > 0 and stats["host_cache_checkpoints_loaded"] > 0, stats
    assert stats["page_evictions"] > 0 and stats["host_cache_hits"] > 0
    cached = sorted(done[f"c{i}t2"].num_cached_tokens for i in range(5))
    assert cached[1] >= 4 * PS, cached  # third turns resume past their second turn's prompt (LRU: not all)
    reference = _serve(off, prompts)
    hf = hf_model("qwen3_5")
    for rid, prompt in prompts.items():
        got = done[rid].outputs[0].token_ids
        assert got == reference[rid].outputs[0].token_ids, rid
        expected, scores = hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_match(got, expected, scores, rid)


def _rows(engine, kind: str, resource_id: int) -> list[np.ndarray]:
    """One page's rows of every KV leaf, or one slot's of every state leaf, over the layer groups."""
    size = engine.cache_config.num_pages if kind == KV else engine.cache_config.num_state_slots
    parts = ("kv",) if kind == KV else ("conv", "rec")
    rows = [g * size + resource_id for g in range(engine.model.num_groups)]
    return [np.asarray(x)[rows] for part in parts for x in jax.tree.leaves(engine.caches[part])]


def test_a_host_hit_restores_the_device_state_bitwise(engines, chat):
    tiered, _ = engines
    cache, draw = tiered.scheduler.cache, chat[3]
    prompt = draw(3 * PS + 2)
    first = _serve(tiered, {"x0": prompt})["x0"].outputs[0].token_ids
    full = prompt + first
    hashes = cache.lookup_prefix(full + [5]).block_hashes
    depth = max(i + 1 for i, h in enumerate(hashes) if cache.slots.lookup_checkpoint(h) is not None)
    snapshot = {(KV, h): _rows(tiered, KV, cache.page_index.get(h)) for h in hashes[:depth]}
    snapshot[(STATE, hashes[depth - 1])] = _rows(tiered, STATE, cache.slots.lookup_checkpoint(hashes[depth - 1]))
    _serve(tiered, {f"fill{i}": draw(40) for i in range(4)})  # evicts x0's pages and checkpoint to host
    assert all(key in cache.host for key in snapshot)
    assert cache.slots.lookup_checkpoint(hashes[depth - 1]) is None
    hit = cache.lookup_prefix(full + [5])  # materializes the host part and queues its loads
    assert hit.num_tokens == depth * PS
    tiered.caches = tiered.host_tier.run(tiered.caches)
    for (kind, h), want in snapshot.items():
        rid = cache.page_index.get(h) if kind == KV else cache.slots.lookup_checkpoint(h)
        got = _rows(tiered, kind, rid)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), (kind, h.hex()[:8])
    again = _serve(tiered, {"x1": prompt})["x1"]  # and the same prompt generates the same tokens
    assert again.outputs[0].token_ids == first


def test_a_failed_host_load_falls_back_to_recompute(engines, chat, hf_model):
    tiered, _ = engines
    cache, draw = tiered.scheduler.cache, chat[3]
    prompts, done = chat[0], chat[1]
    _serve(tiered, {f"flush{i}": draw(40) for i in range(4)})
    failures = cache.host.num_failures
    cache.host.fail_next = 10**6  # every host read fails
    try:
        returning = prompts["c0t1"] + done["c0t1"].outputs[0].token_ids + draw(4)
        out = _serve(tiered, {"back": returning})["back"]
    finally:
        cache.host.fail_next = 0
    assert cache.host.num_failures > failures
    assert out.num_cached_tokens < len(prompts["c0t1"]) - PS  # recomputed what the host would have given
    assert out.outputs[0].token_ids == _serve(engines[1], {"back": returning})["back"].outputs[0].token_ids
    expected, scores = hf_greedy(hf_model("qwen3_5"), returning, MAX_TOKENS)
    assert_greedy_match(out.outputs[0].token_ids, expected, scores, "after a failed host load")


def test_host_bytes_stay_within_the_cap_and_nothing_leaks(engines, chat):
    tiered, _ = engines
    cache, draw = tiered.scheduler.cache, chat[3]
    entry = max(n for _, n in cache.host.entries.values())
    capacity = cache.host.capacity_bytes
    cache.host.resize(3 * entry)
    try:
        evictions = cache.host.num_evictions
        _serve(tiered, {f"cap{i}": draw(30) for i in range(4)})
        assert cache.host.bytes <= 3 * entry and cache.host.num_evictions > evictions
    finally:
        cache.host.resize(capacity)
    tiered.scheduler.check_invariants()
    stats = tiered.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    assert stats["host_cache_bytes"] == cache.host.bytes and stats["host_cache_load_batches"] > 0


def test_the_cost_rule_picks_swap_or_recompute_in_the_engine(engines, chat):
    """The engine's rule comes from its execution plan; forced each way, a returning conversation
    evicted to host is loaded (swap-in) or recomputed, and its output equals caching off's."""
    tiered, off = engines
    cache, draw = tiered.scheduler.cache, chat[3]
    plan_cost = cache.swap_cost
    bandwidth, latency, _ = tiered.plan.host_swap_cost
    assert (plan_cost.load_bytes_per_s, plan_cost.load_latency_s) == (bandwidth, latency)
    cached = {}
    try:
        for name, cost in (("recompute", SwapCost(1.0, 1.0, 1e12)), ("swap", SwapCost(1e30, 0.0, 1e-9))):
            cache.swap_cost = cost
            first = draw(3 * PS + 2)
            returning = first + _serve(tiered, {f"{name}-0": first})[f"{name}-0"].outputs[0].token_ids + draw(4)
            _serve(tiered, {f"{name}-flush{i}": draw(40) for i in range(4)})  # its pages leave the device
            before = tiered.stats()
            out = _serve(tiered, {name: returning})[name]
            after = tiered.stats()
            delta = {k: after[k] - before[k] for k in ("host_cache_hits_taken", "host_cache_recomputes")}
            loaded = after["host_cache_pages_loaded"] - before["host_cache_pages_loaded"]
            cached[name] = out.num_cached_tokens
            if name == "swap":
                assert delta["host_cache_hits_taken"] > 0 and loaded > 0, delta
            else:
                assert delta["host_cache_hits_taken"] == 0 and delta["host_cache_recomputes"] > 0, delta
                assert loaded == 0
            assert out.outputs[0].token_ids == _serve(off, {name: returning})[name].outputs[0].token_ids, name
    finally:
        cache.swap_cost = plan_cost
    assert cached["swap"] >= 3 * PS > cached["recompute"], cached  # the host gave what recompute redid
    tiered.scheduler.check_invariants()


def test_sealed_transfers_compile_nothing(engines, chat):
    """The tier's gathers and scatters, compiled for the engine's caches and sealed (as start-up
    does under aot_compile), serve evictions to host and a host hit without one compilation."""
    import logging

    from test_no_compile_after_startup import CompileCounter

    tiered, _ = engines
    draw, transfers = chat[3], tiered.host_tier
    assert transfers.compile_all(tiered.caches, sealed=True) > 0
    counter, logger = CompileCounter(), logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    before = tiered.stats()
    try:
        first = draw(3 * PS + 2)
        back = first + _serve(tiered, {"sealed-0": first})["sealed-0"].outputs[0].token_ids + draw(4)
        _serve(tiered, {f"sealed-flush{i}": draw(40) for i in range(4)})
        _serve(tiered, {"sealed-back": back})
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
        transfers.sealed = False
    after = tiered.stats()
    assert after["host_cache_offloads"] > before["host_cache_offloads"]
    assert after["host_cache_pages_loaded"] > before["host_cache_pages_loaded"]
    assert not [c for c in counter.compiled if "gather" in c or "scatter" in c], counter.compiled


def test_metrics_expose_the_host_tier(engines, chat):
    from prometheus_client.utils import floatToGoString

    from server.metrics import ServerMetrics

    tiered, off = engines
    text = ServerMetrics(tiered.stats).render().decode()
    stats = tiered.stats()
    value = lambda key: floatToGoString(stats[key])
    assert f"jaxserve_host_cache_bytes {value('host_cache_bytes')}" in text
    assert f"jaxserve_host_cache_hits_total {value('host_cache_hits')}" in text
    assert "jaxserve_host_cache_evictions_total" in text and "jaxserve_host_cache_load_seconds_mean" in text
    # swap counts (host hits loaded, declined by cost, admissions waiting for room) and load latency
    for name in ("hits_taken", "recomputes", "admission_waits", "pages_loaded", "load_batches"):
        assert f"jaxserve_host_cache_{name}_total {value(f'host_cache_{name}')}" in text, name
    assert stats["host_cache_hits_taken"] > 0 and stats["host_cache_load_seconds_total"] > 0
    assert f"jaxserve_host_cache_load_seconds_total {value('host_cache_load_seconds_total')}" in text
    assert "jaxserve_host_cache_load_seconds_p90" in text
    assert "jaxserve_host_cache" not in ServerMetrics(off.stats).render().decode()  # off: no series
