"""Window-aware paging (issue 34): the sliding-window layers' second page pool.

Allocator tests are plain Python (paged_kv); the engine tests check greedy output against HF
transformers on tiny gpt-oss and Gemma 3 checkpoints whose prompts span several windows, under
chunked prefill, preemption and prefix hits, and that nothing leaks from either pool.
"""

import random

import pytest
from engine_testing import Outputs, drain, small_engine_config
from hf_reference import assert_greedy_match, hf_greedy, random_prompt
from test_scheduler import VOCAB, FakeDevice, add, reference_generation, step

from paged_kv import NULL_PAGE, CacheManager, window_pages_per_sequence, window_pool_pages
from runtime.engine_config import CacheConfig, SchedulerConfig
from runtime.scheduling.scheduler import Scheduler

PS, W = 4, 6


def window_manager(num_pages=40, num_window_pages=12, prefix=True, window=W):
    return CacheManager(
        page_size=PS,
        num_pages=num_pages,
        enable_prefix_caching=prefix,
        window=window,
        num_window_pages=num_window_pages,
    )


def live_blocks(num_computed, window=W, page_size=PS):
    """Blocks holding a key some query at position >= num_computed sees (HF: p - window < k <= p)."""
    first_key = max(0, num_computed - window + 1)
    return set(range(first_key // page_size, 10_000))


def run(cache, request_id, tokens, chunk):
    """Admit `tokens` and compute them `chunk` at a time; checks the window table after each step."""
    hit = cache.lookup_prefix(tokens)
    first = min(len(tokens), hit.num_tokens + chunk)
    admission = cache.allocate(request_id, tokens, first, hit)
    assert admission is not None
    done = hit.num_tokens
    while True:
        end = min(len(tokens), done + chunk)
        assert cache.grow(request_id, end)
        done = end
        cache.commit(request_id, tokens, done)
        cache.check_invariants()
        table = cache.allocations[request_id].window_block_table
        held = {b for b, page in enumerate(table) if page != NULL_PAGE}
        assert held == set(range(len(table))) & live_blocks(done), (done, table)
        if done == len(tokens):
            return hit


def test_window_blocks_are_released_as_the_sequence_advances():
    cache = window_manager()
    tokens = list(range(100, 160))
    run(cache, "a", tokens, chunk=1)
    stats = cache.stats()
    assert stats["pages_used"] == 15  # the full layers keep every block
    assert stats["window_pages_used"] == len(set(range(15)) & live_blocks(60)) == 2
    cache.free("a")
    cache.check_invariants()
    stats = cache.stats()
    assert stats["pages_used"] == stats["window_pages_used"] == 0


def test_window_pages_per_sequence_stay_bounded_under_chunked_prefill():
    cache = window_manager(num_pages=60, num_window_pages=window_pages_per_sequence(W, PS, 9) + 1, prefix=False)
    tokens = list(range(200))
    hit = cache.lookup_prefix(tokens)
    assert cache.allocate("a", tokens, 9, hit) is not None
    done = 0
    while done < len(tokens):
        end = min(done + 9, len(tokens))
        assert cache.grow("a", end)
        assert cache.stats()["window_pages_used"] <= window_pages_per_sequence(W, PS, 9)
        cache.commit("a", tokens, end)
        done = end
        assert cache.stats()["window_pages_used"] <= -(-W // PS) + 1
        cache.check_invariants()
    cache.free("a")
    assert cache.stats()["window_pages_free"] == cache.stats()["window_pages_total"]


def test_allocation_needs_both_pools_and_changes_nothing_when_one_is_short():
    cache = window_manager(num_pages=40, num_window_pages=4, prefix=False)  # 3 window pages
    before = cache.stats()
    assert cache.allocate("a", list(range(16)), 16, cache.lookup_prefix(list(range(16)))) is None  # 4 blocks
    assert cache.stats() == before and not cache.allocations
    assert cache.allocate("a", list(range(16)), 8, cache.lookup_prefix(list(range(16)))) is not None
    assert cache.allocate("b", list(range(16)), 8, cache.lookup_prefix(list(range(16)))) is None  # window short
    snapshot = cache.stats()
    assert not cache.grow("a", 16)  # needs 2 more of each; the window pool has 1
    assert cache.stats() == snapshot and len(cache.allocations["a"].block_table) == 2
    cache.commit("a", list(range(16)), 8)  # blocks below 8 - 6 + 1 = 3 // 4 = 0: none released
    assert cache.stats()["window_pages_used"] == 2
    cache.free("a")
    cache.check_invariants()
    assert cache.stats()["window_pages_free"] == 3 and cache.stats()["pages_free"] == 39


def _expected_hit(cache, tokens, cached_window_blocks):
    """Deepest page boundary d < len(tokens) whose window blocks are all in `cached_window_blocks`."""
    for depth in range((len(tokens) - 1) // PS * PS, 0, -PS):
        needed = set(range(max(0, depth - W + 1) // PS, depth // PS))
        if needed <= cached_window_blocks:
            return depth
    return 0


def test_prefix_hit_needs_the_window_pages_below_its_depth():
    cache = window_manager(num_window_pages=30)
    tokens = list(range(300, 330))  # 7 full blocks + 2 tokens
    run(cache, "a", tokens, chunk=5)
    cache.free("a")
    cache.check_invariants()
    assert cache.stats()["window_pages_cached"] == 7 and cache.stats()["pages_cached"] == 7
    hit = cache.lookup_prefix(tokens + [1, 2])
    assert hit.num_tokens == _expected_hit(cache, tokens + [1, 2], set(range(7))) == 28
    # evict the window page of the deepest block: the hit falls back to a boundary that does not need it
    deepest = cache.window.index.get(hit.block_hashes[6])
    cache.window.index.remove(deepest)
    cache.window.pool.put_free(deepest)
    hit = cache.lookup_prefix(tokens + [1, 2])
    assert hit.num_tokens == _expected_hit(cache, tokens + [1, 2], set(range(6))) == 24
    assert len(hit.pages) == 6 and len(hit.window_pages) == len(set(range(6)) & live_blocks(24)) == 2
    run(cache, "b", tokens + [1, 2], chunk=3)
    table = cache.allocations["b"].window_block_table
    assert table[:4] == [NULL_PAGE] * 4
    cache.free("b")
    cache.check_invariants()
    assert cache.stats()["pages_used"] == cache.stats()["window_pages_used"] == 0


def test_shared_window_pages_survive_one_holder_sliding_past_them():
    cache = window_manager(num_window_pages=30)
    prompt = list(range(500, 520))
    run(cache, "a", prompt, chunk=20)
    run(cache, "b", prompt + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], chunk=1)  # hit 20: shares window pages
    cache.check_invariants()
    cache.free("b")
    cache.free("a")
    cache.check_invariants()
    assert cache.stats()["window_pages_used"] == 0 and cache.stats()["pages_used"] == 0


def test_window_pool_sizing_covers_every_running_sequence():
    # max_num_seqs x (ceil(window / page) + 2) + ceil(budget / page) + the null page
    assert window_pool_pages(128, 16, max_num_seqs=4, max_num_batched_tokens=512) == 4 * 10 + 32 + 1
    assert window_pages_per_sequence(128, 16, 512) == 41


def test_zero_window_is_refused():
    with pytest.raises(ValueError, match="window must be >= 1"):
        window_manager(window=-1)


# ---- the scheduler on a fake device with a window pool -------------------------------------------------
class WindowFakeDevice(FakeDevice):
    """FakeDevice plus the window layers' pages: every query's window is read back through the
    window block table and must equal the record (a released page still in a live window, or a
    page reused while another sequence sees it, shows up as a wrong token)."""

    def __init__(self, cache):
        super().__init__(cache)
        self.window = cache.window.window
        self.window_kv = [[None] * cache.page_size for _ in range(cache.window.pool.num_pages)]

    def step(self, out):
        ps = self.page_size
        for seq in out.sequences:
            for pos, token in enumerate(seq.token_ids, start=seq.start_position):
                page = seq.window_block_table[pos // ps]
                assert page != NULL_PAGE, f"{seq.request_id}: writes position {pos} to the null window page"
                self.window_kv[page][pos % ps] = token
        for seq in out.sequences:
            truth, table = self.truth[seq.request_id], seq.window_block_table
            for q in range(seq.start_position, seq.start_position + seq.num_new_tokens):
                keys = range(max(0, q - self.window + 1), q + 1)
                seen = [self.window_kv[table[k // ps]][k % ps] for k in keys]
                assert seen == truth[keys.start : q + 1], f"{seq.request_id}: window of {q} differs"
        return super().step(out)


def window_scheduler(num_pages=40, num_window_pages=None, prefix=True, window=W, **sched):
    sched.setdefault("max_model_len", 64)
    sched.setdefault("max_num_batched_tokens", 8)
    sched.setdefault("max_num_seqs", 3)
    if num_window_pages is None:
        num_window_pages = window_pool_pages(window, PS, sched["max_num_seqs"], sched["max_num_batched_tokens"])
    cache = CacheConfig(PS, num_pages, 0, prefix, window=window, num_window_pages=num_window_pages).build_manager()
    return Scheduler(SchedulerConfig(**sched), cache), WindowFakeDevice(cache)


# the pool that runs short: the full one, or the window one (room for two windows + a chunk)
SHORT_POOLS = {"full": dict(num_pages=17), "window": dict(num_pages=80, num_window_pages=8)}


@pytest.mark.parametrize("short", sorted(SHORT_POOLS))
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_scheduler_with_a_window_pool_matches_the_reference_under_preemption(short, prefix, seed):
    rng = random.Random(seed)
    scheduler, device = window_scheduler(prefix=prefix, **SHORT_POOLS[short])
    shared = [rng.randint(1, VOCAB) for _ in range(13)]
    requests = []
    for i in range(8):
        prompt = (shared if i % 2 else []) + [rng.randint(1, VOCAB) for _ in range(rng.randint(2, 20))]
        requests.append(add(scheduler, device, f"r{i}", prompt, max_tokens=rng.randint(10, 30)))
    window_pages_in_use = []
    while scheduler.has_unfinished():
        step(scheduler, device)
        window_pages_in_use.append(scheduler.cache.stats()["window_pages_used"])
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert (request.output_token_ids, request.finish_reason) == reference_generation(
            request.prompt_token_ids, request.params
        )
    stats = scheduler.cache.stats()
    assert stats["pages_used"] == stats["window_pages_used"] == 0
    if prefix:
        assert stats["prefix_cache_hit_tokens"] > 0
    assert max(window_pages_in_use) <= scheduler.cache.window.num_allocatable


def test_a_window_pool_too_small_for_one_window_refuses_the_request():
    scheduler, device = window_scheduler(num_window_pages=3)
    with pytest.raises(ValueError, match="window pool has only 2"):
        add(scheduler, device, "a", range(1, 30), max_tokens=4)


# ---- the engine against HF ------------------------------------------------------------------------------
ENGINE_PS = 4  # the tiny checkpoints' window is 7: prompts of 20-60 tokens span many windows and pages


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """One window-paged engine per family: pages of 4, 8-token steps (chunked prefill), a full pool
    of 29 pages (the four requests need 43 beside their shared prefix: preemption), prefix caching on."""
    from runtime.engine.llm_engine import LLMEngine

    built = {}

    def build(family):
        if family not in built:
            config = small_engine_config(
                tiny_checkpoint(family),
                page_size=ENGINE_PS,
                num_pages=30,
                max_num_batched_tokens=8,
                max_model_len=96,
                token_buckets=(4, 8),
                load_tokenizer=False,
            )
            built[family] = LLMEngine(config)
        return built[family]

    return build


def _greedy(engine, prompts, max_tokens):
    from runtime.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    return drain(engine)


def _assert_nothing_held(engine):
    engine.scheduler.check_invariants()
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["window_pages_used"] == 0, stats


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_engine_greedy_matches_hf_under_chunked_prefill_preemption_and_prefix_hits(engines, hf_model, family):
    engine = engines(family)
    cache = engine.scheduler.cache
    assert cache.window is not None and cache.window.window == 7  # on by default for window layers
    assert cache.window.num_allocatable < cache.num_allocatable_pages
    vocab, hf = engine.model.cfg.vocab_size, hf_model(family)
    shared = random_prompt(vocab, 29, seed=900)
    prompts = {f"r{i}": shared + random_prompt(vocab, n, seed=910 + i) for i, n in enumerate((1, 31, 17, 40))}
    preemptions = engine.stats()["num_preemptions"]
    outputs = _greedy(engine, prompts, 12)
    assert engine.stats()["num_preemptions"] > preemptions, "the pool was meant to run short"
    _assert_nothing_held(engine)
    # each prompt twice more, alone: the second admission hits its deepest page boundary (the
    # first left its last window's pages cached, most recently used)
    again = {}
    for rid, ids in prompts.items():
        for twice in ("again", "twice"):
            hits = engine.stats()["prefix_cache_hit_tokens"]
            again[f"{twice}-{rid}"] = ids
            outputs.update(_greedy(engine, {f"{twice}-{rid}": ids}, 12))
        assert engine.stats()["prefix_cache_hit_tokens"] - hits == (len(ids) - 1) // ENGINE_PS * ENGINE_PS
        _assert_nothing_held(engine)
    for rid, ids in {**prompts, **again}.items():
        expected, scores = hf_greedy(hf, ids, 12)
        assert_greedy_match(outputs[rid].outputs[0].token_ids, expected, scores, f"{family} {rid} ({len(ids)})")


def test_window_pages_in_use_stay_bounded_by_the_window_during_a_long_decode(engines, hf_model):
    from runtime.types import EngineRequest, SamplingParams

    engine = engines("gpt_oss")
    ids = random_prompt(engine.model.cfg.vocab_size, 9, seed=77)
    engine.add_request(EngineRequest("long", ids, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)))
    outputs, window_used, full_used = Outputs(), [], []
    while engine.has_unfinished():
        outputs.step(engine)
        stats = engine.stats()
        window_used.append(stats["window_pages_used"])
        full_used.append(stats["pages_used"])
    # a window of 7 between steps: keys p-6..p live in at most 3 pages of 4, plus one new page
    assert max(window_used) <= window_pages_per_sequence(7, ENGINE_PS, 1) == 3
    assert max(full_used) == -(-(9 + 80 - 1) // ENGINE_PS)  # the full layers keep the whole context
    _assert_nothing_held(engine)
    expected, scores = hf_greedy(hf_model("gpt_oss"), ids, 80)
    assert_greedy_match(outputs["long"].outputs[0].token_ids, expected, scores, "gpt_oss long decode")


# ---- the request table's second block table -------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_gathers_the_window_block_table_as_the_host_builder_does(seed):
    """test_request_table's random steps (prefill chunks, placeholders, placements with hits that
    overflow the page writes, ends and readmissions), each sequence given a window block table
    that is null below its first live block: the device table, after its page writes and null
    writes, gives the batch `build_batch` builds (window tables and window slots included)."""
    import dataclasses
    import functools

    import jax
    import numpy as np
    from test_request_table import BUCKETS, MB, PAGE, S, Simulation

    from models.batch import ForwardBatch
    from runtime.buckets import bucket_for
    from runtime.steps.inputs import build_batch
    from runtime.steps.table_device import apply_write, init_table, prepare
    from runtime.steps.table_host import RequestTableHost

    def with_window_tables(out):
        for seq in out.sequences:
            first_live = max(0, seq.start_position - W + 1) // PAGE
            seq.window_block_table = [0 if b < first_live else 5000 + p for b, p in enumerate(seq.block_table)]

    host = RequestTableHost(S, PAGE, BUCKETS[-1], window_columns=MB)
    table = init_table(S, MB, window=True)
    run_prepare, write = jax.jit(functools.partial(prepare, page_size=PAGE)), jax.jit(apply_write)
    sim, prev_tokens = Simulation(seed), np.zeros(S, np.int32)
    nulls_written = 0
    for _ in range(40):
        sampled = prev_tokens.copy()
        out, true = sim.step(prev_tokens)
        if out.is_empty:
            continue
        with_window_tables(out)
        with_window_tables(true)
        step, writes = host.plan(out, bucket_for(max(out.num_batched_tokens, len(out.sequences)), BUCKETS))
        for w in writes:
            table = write(table, w)
        table, batch = run_prepare(table, step, sampled)
        expected = build_batch(true, token_buckets=BUCKETS, max_num_seqs=S, max_blocks_per_seq=MB, page_size=PAGE)
        assert expected.window_block_tables is not None
        for f in dataclasses.fields(ForwardBatch):
            np.testing.assert_array_equal(np.asarray(getattr(batch, f.name)), getattr(expected, f.name), err_msg=f.name)
        released = (expected.window_block_tables == 0) & (expected.block_tables != 0)
        nulls_written += int(released[:, 1:].sum())  # slid past (a hit's first blocks are null from the start too)
    assert nulls_written


# ---- the switch ---------------------------------------------------------------------------------------
def test_window_paging_is_on_by_default_also_under_p_d_roles(tiny_checkpoint):
    from models.abstract import abstract_model
    from models.config import parse_config
    from models.safetensors_io import read_json
    from runtime.engine.construction import window_paging
    from runtime.engine_config import EngineConfig, KVTransferConfig

    def model_of(family):
        path = tiny_checkpoint(family)
        return path, abstract_model(parse_config(read_json(path / "config.json")), "float32", path)

    path, gpt_oss = model_of("gpt_oss")
    assert window_paging(EngineConfig(model=str(path)), gpt_oss) == 7
    assert window_paging(EngineConfig(model=str(path), window_paging=False), gpt_oss) is None
    for role in ("prefill", "decode"):  # the window layers' live pages travel (tests/test_window_paging_parallel.py)
        assert window_paging(EngineConfig(model=str(path), kv_transfer=KVTransferConfig(role=role)), gpt_oss) == 7
    dense_path, dense = model_of("llama")
    assert window_paging(EngineConfig(model=str(dense_path), window_paging=True), dense) is None


def test_plan_sizes_both_pools_and_holds_more_long_sequences():
    """`jaxserve plan` (sizing only, nothing compiled) for Gemma-3-27B on 4 TPU v5p chips: the KV
    arrays' bytes (from the abstract caches' shapes) are the full layers' pages plus the window
    layers' pool, within the memory budget, and the pools hold more 32k-token sequences."""
    from configs.chips import CHIPS
    from configs.schema import CONFIG_DIR, LaunchConfig
    from models.config import parse_config
    from models.safetensors_io import read_json
    from runtime.aot.chip_report import plan_config

    cfg = parse_config(read_json(CONFIG_DIR / "models" / "gemma-3-27b.json"))
    windowed = sum(cfg.sliding_window(i) is not None for i in range(cfg.num_layers))
    heads, page, seqs, step_tokens = cfg.num_kv_heads // 4, 128, 256, 4096
    page_bytes = lambda layers: 2 * layers * heads * cfg.head_dim * 2 * page  # K and V, bf16

    def plan(window_paging):
        launch = LaunchConfig.model_validate(
            {
                "model": {"path": "/models/gemma-3-27b-it", "dtype": "bfloat16", "max_model_len": 32768},
                "cache": {"page_size": page, "memory_fraction": 0.85, "window_paging": window_paging},
                "scheduler": {"max_num_seqs": seqs, "max_num_batched_tokens": step_tokens},
                "parallel": {"mesh": {"data": 1, "model": 4}, "chip": "tpu-v5p", "topology": "2x2x1"},
            }
        )
        return plan_config(launch, token_buckets=(), compile_sampler=False, compile_cost=False)

    without, with_ = plan(False), plan(None)
    assert (without.window, without.num_window_pages) == (None, 0)
    assert with_.window == cfg.sliding_window(0) == 1024 and windowed == 52
    assert with_.num_window_pages == seqs * (1024 // page + 2) + step_tokens // page + 1
    assert without.kv_bytes == without.num_pages * page_bytes(cfg.num_layers)
    assert with_.kv_bytes == with_.num_pages * page_bytes(
        cfg.num_layers - windowed
    ) + with_.num_window_pages * page_bytes(windowed)
    budget = 0.85 * CHIPS["tpu-v5p"].hbm_bytes
    for report in (without, with_):
        assert report.weight_bytes + report.kv_bytes <= budget and report.fits
        assert report.weight_bytes + report.kv_bytes > budget - page_bytes(cfg.num_layers)  # the budget is used
    assert without.max_sequences(32768) == (without.num_pages - 1) // (32768 // page)
    assert with_.max_sequences(32768) > 2 * without.max_sequences(32768)
