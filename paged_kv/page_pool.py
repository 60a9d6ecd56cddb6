"""The attention KV page pool: which physical pages are free, and how many holders each has.

Pages 1..P-1 are allocatable; page 0 is the null page that padding entries of block tables
point at, so it is never handed out. A page is *free* (in the deque) or *held* (ref count > 0).
Pages whose ref count drops to 0 while the prefix cache still indexes them are neither: the
prefix cache keeps them as evictable (see prefix_cache.py), and the cache manager decides
where a released page goes. Plain Python, no JAX.
"""

from __future__ import annotations

from collections import deque

NULL_PAGE = 0


class PagePool:
    """Free deque + ref counts over pages 1..num_pages-1."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.free_pages: deque[int] = deque(range(1, num_pages))

    @property
    def num_allocatable(self) -> int:
        """Pages a request could ever hold: all but the null page."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self) -> int:
        """Take a free page with ref count 1; the caller checked `num_free` first."""
        if not self.free_pages:
            raise RuntimeError("page pool is empty: the caller must evict or preempt first")
        page = self.free_pages.popleft()
        assert self.ref_counts[page] == 0, f"free page {page} has ref count {self.ref_counts[page]}"
        self.ref_counts[page] = 1
        return page

    def take(self, page: int) -> None:
        """Re-reference a page that is not in the free deque (a cached page, shared or evictable)."""
        self.ref_counts[page] += 1

    def release(self, page: int) -> int:
        """Drop one reference; returns the remaining count (0: the caller must place the page)."""
        if self.ref_counts[page] <= 0:
            raise RuntimeError(f"page {page} released more often than it was taken")
        self.ref_counts[page] -= 1
        return self.ref_counts[page]

    def put_free(self, page: int) -> None:
        """Return an unreferenced page (uncached, or just evicted from the prefix cache)."""
        assert page != NULL_PAGE and self.ref_counts[page] == 0, page
        self.free_pages.append(page)
