"""Device-free tests of the page pool, prefix cache, state slots and cache manager."""

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from paged_kv import CacheManager, PagePool, StateSlotPool, hash_block, hash_full_pages

PS = 4


def manager(num_pages=9, num_state_slots=0, prefix=True):
    return CacheManager(
        page_size=PS, num_pages=num_pages, num_state_slots=num_state_slots, enable_prefix_caching=prefix
    )


def run_request(cache, request_id, tokens, checkpoint_at=()):
    """Admit `tokens`, compute them all, save checkpoints at `checkpoint_at`; returns the admission."""
    hit = cache.lookup_prefix(tokens)
    admission = cache.allocate(request_id, tokens, len(tokens), hit)
    assert admission is not None
    for boundary in checkpoint_at:
        assert cache.reserve_checkpoint(request_id, tokens, boundary) is not None
        cache.commit(request_id, tokens, boundary)
    cache.commit(request_id, tokens, len(tokens))
    cache.check_invariants()
    return admission


# ---- page pool --------------------------------------------------------------------------------
def test_page_pool_never_hands_out_the_null_page_and_counts_refs():
    pool = PagePool(4)
    pages = [pool.allocate() for _ in range(3)]
    assert sorted(pages) == [1, 2, 3] and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.take(pages[0])
    assert pool.release(pages[0]) == 1 and pool.release(pages[0]) == 0
    with pytest.raises(RuntimeError):
        pool.release(pages[0])
    pool.put_free(pages[0])
    assert pool.allocate() == pages[0]


def test_state_slot_pool_never_hands_out_the_null_slot():
    slots = StateSlotPool(3)
    assert sorted([slots.acquire(), slots.acquire()]) == [1, 2]
    assert slots.acquire() is None


# ---- hashing ----------------------------------------------------------------------------------
def test_block_hash_is_sha256_of_parent_and_tokens():
    tokens = [5, 6, 7, 8]
    expected = hashlib.sha256(b"\x00" * 32 + struct.pack("<4q", *tokens)).digest()
    assert hash_block(None, tokens) == expected
    child = hash_block(expected, [1, 2, 3, 4])
    assert child == hashlib.sha256(expected + struct.pack("<4q", 1, 2, 3, 4)).digest()


def test_block_hash_is_stable_across_processes():
    code = "from paged_kv import hash_block; print(hash_block(None, [1, 2, 3], ('lora', 7)).hex())"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                env=env,
                check=True,
                cwd=os.path.dirname(os.path.dirname(__file__)),
            ).stdout
        )
    assert len(outs) == 1


def test_hash_chain_depends_on_parent_and_extra_keys():
    a = hash_full_pages([1, 2, 3, 4, 9, 9, 9, 9], PS)
    b = hash_full_pages([0, 2, 3, 4, 9, 9, 9, 9], PS)
    assert a[0] != b[0] and a[1] != b[1]  # same second-page tokens, different parent
    assert hash_full_pages([1, 2, 3, 4], PS, ("salt",)) != a[:1]
    assert len(hash_full_pages(list(range(11)), PS)) == 2


# ---- prefix cache -------------------------------------------------------------------------------
def test_prefix_hit_reuses_pages_and_never_covers_the_whole_prompt():
    cache = manager()
    prompt = list(range(12))  # exactly 3 pages
    first = run_request(cache, "a", prompt).allocation
    hit = cache.lookup_prefix(prompt)
    assert hit.num_tokens == 8 and list(hit.pages) == first.block_table[:2]  # last token is computed
    second = cache.allocate("b", prompt, 12, hit).allocation
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert cache.pages.ref_counts[first.block_table[0]] == 2
    cache.check_invariants()
    cache.free("a")
    cache.free("b")
    cache.check_invariants()
    stats = cache.stats()
    assert stats["pages_used"] == 0 and stats["pages_cached"] == 3  # b's third page duplicated a's
    assert stats["pages_free"] == stats["pages_total"] - 3


def test_same_tokens_after_a_different_prefix_do_not_hit():
    cache = manager()
    run_request(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert cache.lookup_prefix([9, 2, 3, 4, 5, 6, 7, 8, 0]).num_tokens == 0
    assert cache.lookup_prefix([1, 2, 3, 4, 5, 6, 7, 9, 0]).num_tokens == 4
    assert cache.lookup_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0], ("other-adapter",)).num_tokens == 0


def test_pages_are_published_only_once_computed():
    cache = manager()
    tokens = list(range(10))
    cache.allocate("a", tokens, 10)
    cache.commit("a", tokens, 5)  # one full page computed
    assert cache.lookup_prefix(tokens).num_tokens == 4
    cache.commit("a", tokens, 10)
    assert cache.lookup_prefix(tokens).num_tokens == 8


def test_allocation_prefers_free_pages_then_evicts_lru_cached_tail_first():
    cache = manager(num_pages=7)  # 6 allocatable pages
    run_request(cache, "a", [1] * 8 + [0])  # 3 pages, 2 published
    cache.free("a")
    run_request(cache, "b", [2] * 8 + [0])
    cache.free("b")
    assert cache.stats()["pages_cached"] == 4 and cache.stats()["pages_free"] == 2
    assert cache.allocate("c", [3] * 8, 8) is not None  # 2 free pages suffice: nothing evicted
    assert cache.lookup_prefix([1] * 8 + [0]).num_tokens == 8
    assert cache.lookup_prefix([2] * 8 + [0]).num_tokens == 8
    assert cache.grow("c", 12)  # one more page: evicts a's tail page (least recently used)
    assert cache.lookup_prefix([1] * 8 + [0]).num_tokens == 4
    assert cache.lookup_prefix([2] * 8 + [0]).num_tokens == 8
    cache.check_invariants()
    assert cache.grow("c", 24)  # all remaining cached pages
    assert not cache.grow("c", 28)
    assert cache.stats()["pages_cached"] == 0
    cache.check_invariants()


def test_a_hit_on_evictable_pages_is_not_counted_as_obtainable():
    cache = manager(num_pages=4)  # 3 pages
    run_request(cache, "a", [1] * 8 + [0])
    cache.free("a")
    hit = cache.lookup_prefix([1] * 8 + [5] * 5)
    assert hit.num_tokens == 8
    assert cache.allocate("b", [1] * 8 + [5] * 5, 13, hit) is None  # would need 4 pages
    cache.check_invariants()
    assert cache.allocate("b", [1] * 8 + [5] * 5, 12, hit) is not None


def test_hit_rate_is_hit_tokens_over_queried_tokens():
    cache = manager()
    prompt = list(range(9))
    run_request(cache, "a", prompt)
    run_request(cache, "b", prompt)
    assert cache.stats()["prefix_cache_hit_rate"] == pytest.approx(8 / 18)


def test_disabled_prefix_caching_never_hits_and_frees_pages():
    cache = manager(prefix=False)
    run_request(cache, "a", list(range(9)))
    cache.free("a")
    assert cache.lookup_prefix(list(range(9))).num_tokens == 0
    assert cache.stats()["pages_free"] == cache.stats()["pages_total"]


# ---- hybrid: state slots and checkpoints --------------------------------------------------------
def test_hybrid_hit_is_truncated_to_the_deepest_checkpoint():
    cache = manager(num_state_slots=5)
    prompt = list(range(13))
    run_request(cache, "a", prompt, checkpoint_at=(4,))
    hit = cache.lookup_prefix(prompt)  # 3 pages cached, state only after page 1
    assert hit.num_tokens == 4 and hit.checkpoint_slot is not None
    admission = cache.allocate("b", prompt, 13, hit)
    assert admission.copy_before == [(hit.checkpoint_slot, admission.allocation.state_slot)]
    cache.check_invariants()
    assert cache.lookup_prefix(list(range(8)) + [99]).num_tokens == 4
    assert cache.stats()["slots_cached"] == 1 and cache.stats()["slots_used"] == 2


def test_hybrid_without_checkpoint_has_no_hit():
    cache = manager(num_state_slots=3)
    run_request(cache, "a", list(range(9)))
    assert cache.lookup_prefix(list(range(9))).num_tokens == 0


def test_checkpoint_reservation_skips_existing_and_frees_on_abort():
    cache = manager(num_state_slots=5)
    tokens = list(range(9))
    run_request(cache, "a", tokens, checkpoint_at=(4,))
    cache.allocate("b", tokens, 9)
    assert cache.reserve_checkpoint("b", tokens, 4) is None  # already checkpointed
    copy = cache.reserve_checkpoint("b", tokens, 8)
    assert copy is not None and copy[0] == cache.allocations["b"].state_slot
    cache.check_invariants()
    cache.free("b")  # aborted before the step committed: the reserved slot is freed
    cache.check_invariants()
    assert cache.stats()["slots_cached"] == 1 and cache.stats()["slots_used"] == 1


def test_checkpoints_are_evicted_lru_for_running_slots_and_adopted_as_last_resort():
    cache = manager(num_pages=20, num_state_slots=3)  # 2 slots
    tokens = list(range(9))
    run_request(cache, "a", tokens, checkpoint_at=(4,))  # holds slot + checkpoint
    cache.free("a")
    run_request(cache, "b", [7] * 9)
    assert cache.stats()["slots_free"] == 0 and cache.stats()["slots_cached"] == 1
    assert cache.lookup_prefix([1] * 9).checkpoint_slot is None
    hit = cache.lookup_prefix(tokens)
    admission = cache.allocate("c", tokens, 9, hit)
    assert admission.copy_before == [] and admission.allocation.state_slot == hit.checkpoint_slot
    assert cache.stats()["slots_cached"] == 0
    cache.check_invariants()
    assert cache.allocate("d", [5] * 5, 5) is None  # no slot left at all


def test_running_slot_evicts_a_checkpoint():
    cache = manager(num_pages=20, num_state_slots=3)
    run_request(cache, "a", list(range(9)), checkpoint_at=(4,))
    cache.free("a")
    run_request(cache, "b", [7] * 9)
    assert cache.stats()["slots_free"] == 0 and cache.stats()["slots_cached"] == 1
    assert cache.allocate("c", [3] * 5, 5) is not None  # takes the checkpoint's slot
    cache.check_invariants()
    assert cache.stats()["slots_cached"] == 0 and cache.lookup_prefix(list(range(9))).num_tokens == 0


def test_check_invariants_detects_broken_accounting():
    cache = manager(num_state_slots=3)
    run_request(cache, "a", list(range(9)))
    cache.pages.ref_counts[cache.allocations["a"].block_table[0]] += 1
    with pytest.raises(AssertionError):
        cache.check_invariants()
    cache.pages.ref_counts[cache.allocations["a"].block_table[0]] -= 1
    cache.slots.free_slots.append(cache.allocations["a"].state_slot)
    with pytest.raises(AssertionError):
        cache.check_invariants()


def test_double_allocation_is_an_error():
    cache = manager()
    cache.allocate("a", [1, 2], 2)
    with pytest.raises(ValueError, match="already holds"):
        cache.allocate("a", [1, 2], 2)


# ---- checkpoint policies -------------------------------------------------------------------------
def test_checkpoint_policy_parsing_and_errors():
    from paged_kv import CheckpointPolicy

    assert CheckpointPolicy.parse("auto") == CheckpointPolicy()
    align = CheckpointPolicy.parse("align:528")
    assert (align.block, align.decode_interval, align.prompt_end, align.divergence) == (528, 528, False, False)
    assert CheckpointPolicy.parse("auto,interval=512,per_path_cap=3").interval == 512
    keep = CheckpointPolicy.parse("auto,keep_prompt_end=1")
    where = dict(prefill=True, num_tokens=30, page_size=4)
    assert not keep.is_rolling(28, **where) and CheckpointPolicy().is_rolling(28, **where)  # the prompt end
    assert keep.is_rolling(8, **where) and not keep.is_rolling(8, divergence=8, **where)  # chunk end / divergence
    page = CheckpointPolicy.parse("page")
    assert page.chunk_ends and not page.decode and not page.divergence
    for bad, match in [
        ("align", "block size"),
        ("lru", "unknown"),
        ("auto:16", "only align"),
        ("auto,interval=x", "bad option"),
        ("auto,speed=3", "bad option"),
    ]:
        with pytest.raises(ValueError, match=match):
            CheckpointPolicy.parse(bad)
    with pytest.raises(ValueError, match="multiple of the page size"):
        CacheManager(page_size=16, num_pages=4, num_state_slots=3, checkpoint_policy="align:20")


def test_policy_cuts_chunks_at_the_boundaries_it_saves():
    from paged_kv import CheckpointPolicy

    auto = CheckpointPolicy.parse("auto,interval=8")
    # prompt of 30 tokens, pages of 4: reusable boundary 28, interval 8/16/24, divergence 12
    assert auto.prefill_boundaries(0, 30, 30, 4, divergence=12) == [8, 12, 16, 24, 28]
    assert auto.chunk_end(0, 30, 30, 4, divergence=12) == 8
    assert auto.chunk_end(8, 11, 30, 4, divergence=12) == 11  # nothing to save inside: as proposed
    page = CheckpointPolicy.parse("page")
    assert page.chunk_end(0, 10, 30, 4) == 8 and page.chunk_end(0, 30, 30, 4) == 28
    align = CheckpointPolicy.parse("align:8")
    assert align.chunk_end(0, 30, 30, 4) == 8 and align.chunk_end(24, 30, 30, 4) == 30
    assert align.saves(16, prefill=False, num_tokens=40, page_size=4) and not align.saves(
        12, prefill=False, num_tokens=40, page_size=4
    )
    assert auto.saves(12, prefill=False, num_tokens=40, page_size=4)  # decode: every page
    assert not page.saves(12, prefill=False, num_tokens=40, page_size=4)


def test_checkpoint_budget_evicts_lru_and_is_never_exceeded():
    cache = CacheManager(
        page_size=PS, num_pages=40, num_state_slots=8, checkpoint_policy="auto", num_checkpoint_slots=2
    )
    for i in range(4):
        run_request(cache, f"r{i}", [100 + i] * 9, checkpoint_at=(4,))
        cache.free(f"r{i}")
        cache.check_invariants()
    stats = cache.stats()
    assert stats["slots_cached"] == 2 and stats["checkpoint_evictions"] == 2 and stats["checkpoints_written"] == 4
    assert cache.lookup_prefix([103] * 9).num_tokens == 4 and cache.lookup_prefix([100] * 9).num_tokens == 0
    zero = CacheManager(page_size=PS, num_pages=40, num_state_slots=8, num_checkpoint_slots=0)
    zero.allocate("a", [1] * 9, 9)
    assert zero.reserve_checkpoint("a", [1] * 9, 4) is None  # no budget: never takes a slot


def test_per_path_cap_keeps_the_most_recent_checkpoints_of_a_path():
    cache = CacheManager(page_size=PS, num_pages=40, num_state_slots=8, checkpoint_policy="auto,per_path_cap=2")
    tokens = list(range(1, 18))
    run_request(cache, "a", tokens, checkpoint_at=(4, 8, 12))
    assert cache.stats()["slots_cached"] == 2 and cache.stats()["checkpoint_evictions"] == 1
    assert cache.lookup_prefix(tokens).num_tokens == 12
    assert cache.lookup_prefix(tokens[:6] + [99] * 8).num_tokens == 0  # the shallowest went first


def roll_checkpoints(cache, request_id, tokens, boundaries):
    """Admit `tokens` and save a rolling checkpoint at each boundary, as decode does."""
    cache.allocate(request_id, tokens, len(tokens), cache.lookup_prefix(tokens))
    for boundary in boundaries:
        assert cache.reserve_checkpoint(request_id, tokens, boundary, rolling=True) is not None
        cache.commit(request_id, tokens, boundary)
        cache.check_invariants()
    return tokens


def test_rolling_decode_checkpoint_supersedes_the_previous_one():
    cache = CacheManager(page_size=PS, num_pages=40, num_state_slots=8, checkpoint_policy="auto")
    tokens = roll_checkpoints(cache, "a", list(range(1, 14)), (4, 8, 12))
    assert cache.stats()["slots_cached"] == 1 and cache.stats()["checkpoint_evictions"] == 0
    assert cache.lookup_prefix(tokens + [5]).num_tokens == 12


def test_rolling_checkpoint_at_the_budget_replaces_its_own_and_evicts_nobody():
    cache = CacheManager(
        page_size=PS, num_pages=40, num_state_slots=8, checkpoint_policy="auto", num_checkpoint_slots=2
    )
    run_request(cache, "other", [50] * 9, checkpoint_at=(4,))
    cache.free("other")
    tokens = roll_checkpoints(cache, "a", list(range(1, 14)), (4, 8, 12))
    stats = cache.stats()
    assert stats["slots_cached"] == 2 and stats["checkpoint_evictions"] == 0
    assert cache.lookup_prefix([50] * 9).num_tokens == 4 and cache.lookup_prefix(tokens + [5]).num_tokens == 12
