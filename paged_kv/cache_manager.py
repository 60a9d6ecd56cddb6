"""The hybrid cache manager: pages (and, for GDN hybrids, a state slot) per request, atomically.

Owns the page pool, the prefix-cache index of full pages, and the state-slot pool with its
checkpoints. A request's resources are one `SequenceAllocation` (block table, running state
slot, a pending checkpoint); the manager keeps them by request id and frees them together.

Prefix caching: full pages are published under their chained block hash once their KV has
been computed (`commit`); a released published page stays cached and evictable (LRU), and
allocation takes free uncached pages first, then evicts the LRU cached ones. On hybrids a hit
is only usable up to the deepest page boundary that has a *checkpoint slot* (the GDN state
after exactly that many tokens); admission then restores it with `copy_before` (checkpoint ->
running slot), and `reserve_checkpoint` + `commit` save one with `copy_after`. Which
boundaries are saved is the `CheckpointPolicy`'s decision (paged_kv/checkpoint_policy.py);
checkpoints (published or being written) never exceed `num_checkpoint_slots` (None: no
budget, they share the pool with running slots): at the budget the least recently used one
is evicted first. The policy's per-path cap bounds the checkpoints along one token path.

Window-aware paging (`window`): the sliding-window layers' pages are a second group with a second
block table per request (paged_kv/window_pages.py); allocation takes from both groups or neither.

Accounting (see `stats`): every allocatable page is exactly one of free (uncached), used
(referenced by running requests) or cached (referenced by nobody, evictable); every state
slot is free, used (running or being written as a checkpoint) or cached (a checkpoint).
Plain Python, no JAX.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_kv.checkpoint_policy import CheckpointPolicy
from paged_kv.page_pool import NULL_PAGE, PagePool
from paged_kv.prefix_cache import BlockHash, BlockIndex, hash_full_pages
from paged_kv.state_slots import NULL_SLOT, StateSlotPool
from paged_kv.window_pages import WindowPages


@dataclass
class SequenceAllocation:
    """What one request holds. `block_table[i]` is the physical page of logical block i."""

    request_id: str
    block_table: list[int] = field(default_factory=list)
    state_slot: int = NULL_SLOT
    extra_keys: tuple = ()
    block_hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full pages seen
    num_published_pages: int = 0  # leading pages already in the prefix index (hits or committed)
    pending_checkpoint: tuple[int, int] | None = None  # (slot, boundary in tokens) written this step
    pending_is_rolling: bool = False  # the pending checkpoint supersedes `rolling_checkpoint`
    rolling_checkpoint: BlockHash | None = None  # the newest decode checkpoint this request wrote
    divergence: int = 0  # hybrids: its hit's KV reached this deep, deeper than any checkpoint
    window_block_table: list[int] = field(default_factory=list)  # window paging: the window layers' pages
    window_low: int = 0  # window paging: blocks below this are released (null page)


@dataclass(frozen=True)
class PrefixHit:
    """The longest usable cached prefix of a prompt; `num_tokens` is a multiple of page_size."""

    num_tokens: int = 0
    pages: tuple[int, ...] = ()
    checkpoint_slot: int | None = None  # hybrids: holds the state after `num_tokens` tokens
    block_hashes: tuple[BlockHash, ...] = ()  # hashes computed during the lookup, reused later
    kv_num_tokens: int = 0  # cached KV pages reach this deep (hybrids: maybe past the checkpoint)
    window_pages: tuple[int, ...] = ()  # window paging: the live window's cached pages at num_tokens


@dataclass
class Admission:
    """A successful `allocate`: the allocation plus device slot copies to run before the step."""

    allocation: SequenceAllocation
    copy_before: list[tuple[int, int]]  # (src_slot, dst_slot)


class CacheManager:
    """Pages + state slots + prefix cache for all requests.

    num_pages and num_state_slots include the null page / null slot; num_state_slots == 0
    means a pure-attention model (no GDN state). `window`: window-aware paging for layers of that
    sliding window, in a second pool of `num_window_pages` pages (None: no window pool).
    """

    def __init__(
        self,
        *,
        page_size: int,
        num_pages: int,
        num_state_slots: int = 0,
        enable_prefix_caching: bool = True,
        checkpoint_policy: CheckpointPolicy | str = "page",
        num_checkpoint_slots: int | None = None,
        window: int | None = None,
        num_window_pages: int = 0,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_checkpoint_slots is not None and num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0 or None, got {num_checkpoint_slots}")
        self.page_size = page_size
        self.pages = PagePool(num_pages)
        self.page_index = BlockIndex()
        self.slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.enable_prefix_caching = enable_prefix_caching
        self.checkpoint_policy = CheckpointPolicy.parse(checkpoint_policy)
        self.checkpoint_policy.check_page_size(page_size)
        self.num_checkpoint_slots = num_checkpoint_slots
        self.allocations: dict[str, SequenceAllocation] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_page_evictions = 0
        self.num_checkpoints_written = 0
        self.num_checkpoint_evictions = 0  # for the budget or the per-path cap (not superseded ones)
        self.num_pending_checkpoints = 0
        self.window = WindowPages(num_window_pages, page_size, window) if window else None

    # ---- properties -------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return self.slots is not None

    @property
    def checkpoints_enabled(self) -> bool:
        """Hybrid prefix caching: chunks are cut at page boundaries and states checkpointed."""
        return self.is_hybrid and self.enable_prefix_caching

    @property
    def num_allocatable_pages(self) -> int:
        return self.pages.num_allocatable

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix lookup ------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> PrefixHit:
        """Longest chain of cached pages for `token_ids`, leaving at least one token to compute.

        Read-only: takes no references and counts no statistics (`allocate` does both).
        """
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return PrefixHit()
        max_pages = (len(token_ids) - 1) // self.page_size
        hashes = hash_full_pages(token_ids, self.page_size, extra_keys, num_tokens=max_pages * self.page_size)
        pages: list[int] = []
        for block_hash in hashes:
            page = self.page_index.get(block_hash)
            if page is None:
                break
            pages.append(page)
        kv_num_tokens, checkpoint_slot, window_pages = len(pages) * self.page_size, None, None
        while pages and (
            (
                self.slots is not None
                and (checkpoint_slot := self.slots.lookup_checkpoint(hashes[len(pages) - 1])) is None
            )
            or (self.window is not None and (window_pages := self.window.hit_pages(hashes, len(pages))) is None)
        ):  # hybrids: the state at that depth; window paging: the window's pages below it
            pages.pop()
        checkpoint_slot, window_pages = (checkpoint_slot, window_pages or ()) if pages else (None, ())
        hit = (len(pages) * self.page_size, tuple(pages), checkpoint_slot, tuple(hashes), kv_num_tokens, window_pages)
        return PrefixHit(*hit)

    def hit_tokens(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        """Tokens `lookup_prefix` would hit, read-only (a tiered manager counts its host tier too)."""
        return self.lookup_prefix(token_ids, extra_keys).num_tokens

    # ---- allocation -------------------------------------------------------------------
    def _num_obtainable_pages(self, excluding_hits: Sequence[int] = ()) -> int:
        evictable_hits = sum(1 for page in excluding_hits if page in self.page_index.evictable)
        return self.pages.num_free + self.page_index.num_evictable - evictable_hits

    def _new_page(self) -> int:
        if not self.pages.num_free:
            evicted = self.page_index.evict_lru()
            assert evicted is not None, "caller checked the obtainable page count"
            self.num_page_evictions += 1
            self.pages.put_free(evicted)
        return self.pages.allocate()

    def _take_cached_page(self, page: int) -> None:
        self.page_index.unmark_evictable(page)
        self.pages.take(page)

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        hit: PrefixHit = PrefixHit(),
        extra_keys: tuple = (),
        num_external: int = 0,
    ) -> Admission | None:
        """Pages for the first `num_tokens` tokens (reusing `hit`) and a running slot, or None.

        All or nothing: on None nothing changed. `hit` must come from `lookup_prefix` with no cache
        mutation in between. `num_external`: leading tokens whose KV arrives from elsewhere (P/D)."""
        if request_id in self.allocations:
            raise ValueError(f"request {request_id!r} already holds an allocation")
        num_new_pages = max(0, self.pages_needed(num_tokens) - len(hit.pages))
        if self._num_obtainable_pages(hit.pages) < num_new_pages:
            return None
        if self.slots is not None and hit.checkpoint_slot is None and self.slots.num_obtainable() < 1:
            return None
        num_blocks = self.pages_needed(num_tokens)
        known, window = max(hit.num_tokens, num_external), self.window
        if window is not None and not window.can_allocate(hit, num_blocks, known):
            return None
        allocation = SequenceAllocation(request_id, extra_keys=extra_keys, block_hashes=list(hit.block_hashes))
        if self.checkpoints_enabled and self.checkpoint_policy.divergence and hit.kv_num_tokens > hit.num_tokens:
            allocation.divergence = hit.kv_num_tokens
        for page in hit.pages:
            self._take_cached_page(page)
        allocation.block_table = list(hit.pages) + [self._new_page() for _ in range(num_new_pages)]
        allocation.num_published_pages = len(hit.pages)
        if window is not None:
            window.allocate(allocation, hit.window_pages, len(hit.pages), num_blocks, known)
        copy_before: list[tuple[int, int]] = []
        if self.slots is not None:
            checkpoint = hit.checkpoint_slot
            if checkpoint is not None:
                self.slots.checkpoints.touch(checkpoint)
            slot = self.slots.acquire(keep=checkpoint)
            if slot is None:  # the only obtainable slot is the checkpoint itself: continue in it
                self.slots.adopt_checkpoint(checkpoint)
                slot = checkpoint
            elif checkpoint is not None:
                copy_before.append((checkpoint, slot))
            allocation.state_slot = slot
        self.allocations[request_id] = allocation
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += hit.num_tokens
        return Admission(allocation, copy_before)

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make the block table cover `num_tokens` tokens; False (no change) if pages run out."""
        allocation = self.allocations[request_id]
        missing = self.pages_needed(num_tokens) - len(allocation.block_table)
        if missing <= 0:
            return True
        if self._num_obtainable_pages() < missing:
            return False
        if self.window is not None and self.window.num_obtainable() < missing:
            return False
        allocation.block_table.extend(self._new_page() for _ in range(missing))
        if self.window is not None:
            allocation.window_block_table.extend(self.window.new_page() for _ in range(missing))
        return True

    def reserve_checkpoint(
        self,
        request_id: str,
        token_ids: Sequence[int],
        boundary: int,
        rolling: bool = False,
        last_token_known: bool = True,
    ) -> tuple[int, int] | None:
        """Reserve a slot to save the running state after `boundary` tokens (page aligned).

        Returns the `copy_after` pair (running slot, checkpoint slot), or None when that
        boundary is already checkpointed or no slot can be had within the checkpoint budget
        without preempting anyone. A `rolling` checkpoint, once published, replaces the
        request's previous rolling one. `last_token_known=False` (asynchronous scheduling: the
        boundary's last token is still being sampled) skips the already-checkpointed lookup,
        which would hash it; `commit` hashes the real tokens and drops a duplicate then.
        """
        allocation = self.allocations[request_id]
        if not self.checkpoints_enabled or boundary <= 0 or boundary % self.page_size:
            return None
        if allocation.pending_checkpoint is not None:
            raise RuntimeError(f"request {request_id!r} already writes a checkpoint this step")
        if last_token_known:
            hashes = hash_full_pages(
                token_ids, self.page_size, allocation.extra_keys, allocation.block_hashes, boundary
            )
            existing = self.slots.lookup_checkpoint(hashes[boundary // self.page_size - 1])
            if existing is not None:
                self.slots.checkpoints.touch(existing)
                return None
        if rolling and allocation.rolling_checkpoint is not None and self._checkpoints_at_budget():
            self._drop_checkpoint(allocation.rolling_checkpoint)  # replace it in place: evict nobody
            allocation.rolling_checkpoint = None
        if not self._make_room_for_checkpoint():
            return None
        slot = self.slots.acquire()
        if slot is None:
            return None
        allocation.pending_checkpoint = (slot, boundary)
        allocation.pending_is_rolling = rolling
        self.num_pending_checkpoints += 1
        return allocation.state_slot, slot

    def _checkpoints_at_budget(self) -> bool:
        return (
            self.num_checkpoint_slots is not None
            and self.slots.num_checkpoints + self.num_pending_checkpoints >= self.num_checkpoint_slots
        )

    def _make_room_for_checkpoint(self) -> bool:
        """Within the budget, one more checkpoint fits (evicting the LRU one if needed)."""
        while self._checkpoints_at_budget():
            if not self._evict_checkpoint(self.slots.checkpoints.evict_lru()):
                return False
        return True

    def _evict_checkpoint(self, slot: int | None) -> bool:
        """`slot` was just removed from the checkpoint index: free it (False if there was none)."""
        if slot is None:
            return False
        self.slots.free_slots.append(slot)
        self.num_checkpoint_evictions += 1
        return True

    def _drop_checkpoint(self, block_hash: BlockHash) -> None:
        slot = self.slots.lookup_checkpoint(block_hash)
        if slot is not None:
            self.slots.checkpoints.remove(slot)
            self.slots.free_slots.append(slot)

    def _publish_checkpoint(self, allocation: SequenceAllocation, hashes: list[BlockHash]) -> None:
        slot, boundary = allocation.pending_checkpoint
        allocation.pending_checkpoint = None
        self.num_pending_checkpoints -= 1
        block_hash = hashes[boundary // self.page_size - 1]
        if not self.slots.publish_checkpoint(slot, block_hash):
            return
        self.num_checkpoints_written += 1
        if allocation.pending_is_rolling:
            if allocation.rolling_checkpoint is not None:
                self._drop_checkpoint(allocation.rolling_checkpoint)
            allocation.rolling_checkpoint = block_hash
        cap = self.checkpoint_policy.per_path_cap
        if cap:
            path = {s for h in hashes[: boundary // self.page_size] if (s := self.slots.lookup_checkpoint(h))}
            for victim in [s for s in self.slots.checkpoints.evictable if s in path][: max(0, len(path) - cap)]:
                self.slots.checkpoints.remove(victim)
                self._evict_checkpoint(victim)

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The first `num_computed_tokens` tokens now have KV (and state): publish full pages
        and a checkpoint written this step; window paging: release the window blocks slid past."""
        allocation = self.allocations[request_id]
        if self.enable_prefix_caching:
            self._publish(allocation, token_ids, num_computed_tokens)
        if self.window is not None:
            self.window.slide(allocation, num_computed_tokens)

    def _publish(self, allocation: SequenceAllocation, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        num_full = num_computed_tokens // self.page_size
        hashes = hash_full_pages(
            token_ids, self.page_size, allocation.extra_keys, allocation.block_hashes, num_computed_tokens
        )
        for page_index in range(allocation.num_published_pages, num_full):
            self.page_index.insert(hashes[page_index], allocation.block_table[page_index])  # dup: stays private
        if self.window is not None:
            self.window.publish(hashes, allocation.window_block_table, allocation.num_published_pages, num_full)
        allocation.num_published_pages = max(allocation.num_published_pages, num_full)
        if allocation.pending_checkpoint is not None and allocation.pending_checkpoint[1] <= num_computed_tokens:
            self._publish_checkpoint(allocation, hashes)

    def free(self, request_id: str) -> None:
        """Release everything the request holds; published pages stay cached and evictable."""
        allocation = self.allocations.pop(request_id)
        for page in reversed(allocation.block_table):  # the tail becomes least recently used
            if self.pages.release(page) == 0:
                if self.page_index.is_indexed(page):
                    self.page_index.mark_evictable(page)
                else:
                    self.pages.put_free(page)
        if self.window is not None:
            self.window.free(allocation.window_block_table)
        if self.slots is not None:
            if allocation.state_slot != NULL_SLOT:
                self.slots.release(allocation.state_slot)
            if allocation.pending_checkpoint is not None:
                self.slots.release(allocation.pending_checkpoint[0])
                self.num_pending_checkpoints -= 1

    # ---- preemption: a tiered manager may swap instead (paged_kv/preempt_swap.py) -------------
    def preempt(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> bool:
        """Free a preempted request; True when its state is kept to resume from (never here)."""
        self.free(request_id)
        return False

    def resume_point(self, request_id: str) -> tuple[int, int] | None:
        return None  # no swap records: a preempted request recomputes

    def drop_swap(self, request_id: str) -> None:
        pass

    # ---- accounting ---------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counts exclude the null page/slot.

        pages_free: allocatable without evicting anything; pages_cached: held only by the
        prefix cache (evictable); pages_used: referenced by requests. Same for slots, where
        slots_cached are GDN checkpoints. prefix_cache_hit_rate = hit tokens / queried tokens
        over all admissions.
        """
        pages_total = self.pages.num_allocatable
        pages_free, pages_cached = self.pages.num_free, self.page_index.num_evictable
        slots_total = self.slots.num_allocatable if self.slots else 0
        slots_free = self.slots.num_free if self.slots else 0
        slots_cached = self.slots.num_checkpoints if self.slots else 0
        return {
            "pages_total": pages_total,
            "pages_free": pages_free,
            "pages_cached": pages_cached,
            "pages_used": pages_total - pages_free - pages_cached,
            "slots_total": slots_total,
            "slots_free": slots_free,
            "slots_cached": slots_cached,
            "slots_used": slots_total - slots_free - slots_cached,
            "prefix_cache_queried_tokens": self.num_queried_tokens,
            "prefix_cache_hit_tokens": self.num_hit_tokens,
            "prefix_cache_hit_rate": self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0,
            "page_evictions": self.num_page_evictions,
            "checkpoints_written": self.num_checkpoints_written,
            "checkpoint_evictions": self.num_checkpoint_evictions + (self.slots.num_evictions if self.slots else 0),
            **(self.window.stats() if self.window is not None else {}),
        }

    def check_invariants(self) -> None:
        """Assert that every page and slot is in exactly one state and ref counts match tables."""
        refs: Counter[int] = Counter()
        for allocation in self.allocations.values():
            assert len(set(allocation.block_table)) == len(allocation.block_table), allocation
            refs.update(allocation.block_table)
        assert NULL_PAGE not in refs and self.pages.ref_counts[NULL_PAGE] == 0, "null page in use"
        free = list(self.pages.free_pages)
        assert len(free) == len(set(free)), "page freed twice"
        free_set = set(free)
        for page_id, block_hash in self.page_index.hash_of_id.items():
            assert self.page_index.id_of_hash[block_hash] == page_id, "prefix index out of sync"
        assert len(self.page_index.id_of_hash) == len(self.page_index.hash_of_id)
        for page in range(1, self.pages.num_pages):
            count = self.pages.ref_counts[page]
            assert count == refs[page], f"page {page}: ref count {count}, block tables hold it {refs[page]}x"
            states = (page in free_set) + (count > 0) + (page in self.page_index.evictable)
            assert states == 1, f"page {page} is in {states} states (free/used/cached)"
            if page in free_set:
                assert not self.page_index.is_indexed(page), f"free page {page} still indexed"
            if page in self.page_index.evictable:
                assert self.page_index.is_indexed(page)
        if self.window is not None:
            self.window.check_invariants(self.allocations.values())
        if self.slots is None:
            assert all(a.state_slot == NULL_SLOT and a.pending_checkpoint is None for a in self.allocations.values())
            return
        held = [a.state_slot for a in self.allocations.values()]
        held += [a.pending_checkpoint[0] for a in self.allocations.values() if a.pending_checkpoint is not None]
        assert len(held) == len(set(held)), f"a state slot is held twice: {sorted(held)}"
        assert set(held) == self.slots.held, f"held slots {sorted(self.slots.held)} != requests' {sorted(held)}"
        free_slots = list(self.slots.free_slots)
        assert len(free_slots) == len(set(free_slots)), "slot freed twice"
        checkpoints = set(self.slots.checkpoints.hash_of_id)
        assert checkpoints == set(self.slots.checkpoints.evictable), "a checkpoint is not evictable"
        assert NULL_SLOT not in self.slots.held and NULL_SLOT not in free_slots and NULL_SLOT not in checkpoints
        pending = sum(a.pending_checkpoint is not None for a in self.allocations.values())
        assert pending == self.num_pending_checkpoints, "pending checkpoint count out of sync"
        if self.num_checkpoint_slots is not None:
            assert len(checkpoints) + pending <= self.num_checkpoint_slots, "checkpoints exceed their budget"
        total = len(free_slots) + len(self.slots.held) + len(checkpoints)
        union = set(free_slots) | self.slots.held | checkpoints
        assert total == len(union) == self.slots.num_allocatable, "state slots leaked or in two states"
