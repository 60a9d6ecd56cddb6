"""GDN state slots: one running slot per request, plus checkpoint slots for hybrid prefix caching.

Slots 1..N-1 are allocatable; slot 0 is the null slot (padding rows of a batch). Every slot is
exactly one of: free, *held* by a request (its running slot, or a checkpoint it is writing
this step), or a *checkpoint*: a copy of some request's state at a page-aligned boundary,
indexed by that boundary's block hash and evictable (LRU) like a cached page. The device
copies between slots are issued by the runtime; this module only does the bookkeeping.
Plain Python, no JAX.
"""

from __future__ import annotations

from collections import deque

from paged_kv.prefix_cache import BlockHash, BlockIndex

NULL_SLOT = 0


class StateSlotPool:
    """Free deque, held set and checkpoint index over slots 1..num_slots-1."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the null slot), got {num_slots}")
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(1, num_slots))
        self.held: set[int] = set()
        self.checkpoints = BlockIndex()  # every indexed slot is evictable
        self.num_evictions = 0  # checkpoints evicted to give a running request its slot

    @property
    def num_allocatable(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoints)

    def num_obtainable(self, keep: int | None = None) -> int:
        """Slots `acquire(keep=keep)` could hand out: free ones plus evictable checkpoints."""
        evictable = self.checkpoints.num_evictable
        if keep is not None and keep in self.checkpoints.evictable:
            evictable -= 1
        return self.num_free + evictable

    def acquire(self, keep: int | None = None) -> int | None:
        """A free slot, else the LRU checkpoint other than `keep` (evicted); None if neither."""
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            slot = self.checkpoints.evict_lru(keep=keep)
            if slot is None:
                return None
            self.num_evictions += 1
        self.held.add(slot)
        return slot

    def adopt_checkpoint(self, slot: int) -> None:
        """Turn a checkpoint into a held slot in place (its state becomes a request's state)."""
        self.checkpoints.remove(slot)
        self.held.add(slot)

    def release(self, slot: int) -> None:
        self.held.remove(slot)
        self.free_slots.append(slot)

    def lookup_checkpoint(self, block_hash: BlockHash) -> int | None:
        return self.checkpoints.get(block_hash)

    def publish_checkpoint(self, slot: int, block_hash: BlockHash) -> bool:
        """A held slot now holds the state at `block_hash`: index it (evictable).

        Returns False and frees the slot when that boundary is already checkpointed.
        """
        self.held.remove(slot)
        if self.checkpoints.insert(block_hash, slot):
            self.checkpoints.mark_evictable(slot)
            return True
        self.free_slots.append(slot)
        return False
