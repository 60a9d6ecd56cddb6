"""The sliding-window layers' page group: window-aware paging (issue 34).

A sliding-window layer's query at position p sees keys p - window < k <= p, so once a request has
computed c tokens, every later query sees keys >= c - window + 1 only: the logical blocks wholly
below that (`first_live_block`) are dead for it. Window layers keep their KV in a second page
pool, and a request's second block table (`SequenceAllocation.window_block_table`, indexed by the
same logical block as the full one) points at the null page for its dead blocks, whose pages go
back to this pool (`slide`). A long context then costs window-sized KV on those layers.

Prefix caching: a window page is published under the same block hash as the full page of that
block (its own `BlockIndex`) and stays cached (evictable, LRU) when its request slides past it.
A hit at depth N on a window model also needs the window pages of blocks
`first_live_block(N) .. N / page_size - 1` (`hit_pages`); the cache manager accepts a hit only up
to the deepest boundary whose window pages are all still cached.
Plain Python, no JAX.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from paged_kv.page_pool import NULL_PAGE, PagePool
from paged_kv.prefix_cache import BlockHash, BlockIndex


def window_pages_per_sequence(window: int, page_size: int, max_chunk: int) -> int:
    """The most window pages one request holds: the live blocks of a window plus one chunk."""
    return -(-(window + max_chunk) // page_size) + 1


def window_pool_pages(
    window: int, page_size: int, max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0
) -> int:
    """Window pages (with the null page) that never make a running request wait: each of
    `max_num_seqs` requests holds at most ceil((window + k) / page_size) + 1 pages between steps
    (k = `num_speculative_tokens`: a rejected draft's pages stay allocated past the committed
    position), plus one boundary page when it is scheduled, and a step's chunks add at most
    ceil(max_num_batched_tokens / page_size) more."""
    per_sequence = -(-(window + num_speculative_tokens) // page_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // page_size) + 1


class WindowPages:
    """Free pages, ref counts and a prefix index for the sliding-window layers' pool."""

    def __init__(self, num_pages: int, page_size: int, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.pool = PagePool(num_pages)
        self.index = BlockIndex()
        self.page_size, self.window = page_size, window
        self.num_evictions = 0

    @property
    def num_allocatable(self) -> int:
        return self.pool.num_allocatable

    def first_live_block(self, num_computed: int) -> int:
        """The lowest logical block a query at position >= num_computed can see."""
        return max(0, num_computed - self.window + 1) // self.page_size

    def num_obtainable(self, excluding_hits: Iterable[int] = ()) -> int:
        evictable_hits = sum(1 for page in excluding_hits if page in self.index.evictable)
        return self.pool.num_free + self.index.num_evictable - evictable_hits

    def new_page(self) -> int:
        if not self.pool.num_free:
            evicted = self.index.evict_lru()
            assert evicted is not None, "caller checked the obtainable window page count"
            self.num_evictions += 1
            self.pool.put_free(evicted)
        return self.pool.allocate()

    def hit_pages(self, hashes: Sequence[BlockHash], num_blocks: int) -> tuple[int, ...] | None:
        """The cached window pages a hit of `num_blocks` full blocks needs, or None if one is gone."""
        pages = []
        for block in range(self.first_live_block(num_blocks * self.page_size), num_blocks):
            page = self.index.get(hashes[block])
            if page is None:
                return None
            pages.append(page)
        return tuple(pages)

    def can_allocate(self, hit, num_blocks: int, num_known: int = 0) -> bool:
        """Whether `allocate` finds its new pages for a `PrefixHit`: blocks from the hit's end (or
        the first block live after `num_known` tokens, if above) up to `num_blocks`."""
        need = num_blocks - max(len(hit.pages), self.first_live_block(num_known))
        return self.num_obtainable(hit.window_pages) >= need

    def allocate(
        self, allocation, hit_pages: Sequence[int], num_hit_blocks: int, num_blocks: int, num_known: int = 0
    ) -> None:
        """A new `SequenceAllocation`'s window block table: null below the hit's window, its cached
        pages `hit_pages`, then new pages up to `num_blocks`; the caller checked `num_obtainable`.
        `num_known` tokens (a hit and KV that arrives from elsewhere, P/D) are not computed here:
        the blocks below their window get no page."""
        for page in hit_pages:
            self.index.unmark_evictable(page)
            self.pool.take(page)
        allocation.window_low = num_hit_blocks - len(hit_pages)
        start = max(num_hit_blocks, self.first_live_block(num_known))
        table = [NULL_PAGE] * allocation.window_low + list(hit_pages) + [NULL_PAGE] * (start - num_hit_blocks)
        allocation.window_block_table = table + [self.new_page() for _ in range(start, num_blocks)]
        self.slide(allocation, num_known)

    def release(self, page: int) -> None:
        if self.pool.release(page) == 0:
            if self.index.is_indexed(page):
                self.index.mark_evictable(page)
            else:
                self.pool.put_free(page)

    def slide(self, allocation, num_computed: int) -> None:
        """`allocation` has computed `num_computed` tokens: release its window blocks below the
        first live one (null entries from `window_low` up)."""
        table, low = allocation.window_block_table, allocation.window_low
        live = min(self.first_live_block(num_computed), len(table))
        for block in range(low, live):
            if table[block] != NULL_PAGE:
                self.release(table[block])
                table[block] = NULL_PAGE
        allocation.window_low = max(low, live)

    def publish(self, hashes: Sequence[BlockHash], table: Sequence[int], start: int, end: int) -> None:
        for block in range(start, end):
            if table[block] != NULL_PAGE:
                self.index.insert(hashes[block], table[block])  # a duplicate stays private

    def free(self, table: Sequence[int]) -> None:
        for page in reversed(table):  # the tail becomes least recently used
            if page != NULL_PAGE:
                self.release(page)

    def stats(self) -> dict[str, int]:
        total, free, cached = self.num_allocatable, self.pool.num_free, self.index.num_evictable
        return {
            "window_pages_total": total,
            "window_pages_free": free,
            "window_pages_cached": cached,
            "window_pages_used": total - free - cached,
            "window_page_evictions": self.num_evictions,
        }

    def check_invariants(self, allocations: Iterable) -> None:
        """Every page free, used (ref count = the window tables holding it) or cached; every
        request's window table as long as its full one, null below its `window_low`."""
        refs: Counter[int] = Counter()
        for allocation in allocations:
            table, low = allocation.window_block_table, allocation.window_low
            assert len(table) == len(allocation.block_table), f"window table out of step: {allocation}"
            held = [page for page in table if page != NULL_PAGE]
            assert len(set(held)) == len(held), f"a window page is held twice by one request: {table}"
            assert all(page == NULL_PAGE for page in table[:low]), f"released window block still held: {table}"
            refs.update(held)
        free = list(self.pool.free_pages)
        assert len(free) == len(set(free)), "window page freed twice"
        free_set = set(free)
        assert self.pool.ref_counts[NULL_PAGE] == 0, "null window page in use"
        for page_id, block_hash in self.index.hash_of_id.items():
            assert self.index.id_of_hash[block_hash] == page_id, "window prefix index out of sync"
        for page in range(1, self.pool.num_pages):
            count = self.pool.ref_counts[page]
            assert count == refs[page], f"window page {page}: ref count {count}, tables hold it {refs[page]}x"
            states = (page in free_set) + (count > 0) + (page in self.index.evictable)
            assert states == 1, f"window page {page} is in {states} states (free/used/cached)"
            if page in free_set:
                assert not self.index.is_indexed(page), f"free window page {page} still indexed"
