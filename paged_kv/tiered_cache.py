"""The prefix cache over two tiers: device pages / checkpoint slots, and a host-memory store behind them.

`TieredCacheManager` is a `CacheManager` whose evictions are not lost: every cached page or GDN
checkpoint evicted from the device (the LRU page a new allocation takes, a checkpoint evicted for
the budget, the per-path cap or a running slot) is queued for an *offload* to the host store
(paged_kv/host_tier.py) under its block hash, unless the host holds that hash already (the tiers
are inclusive: a host hit copies, it does not move). A superseded rolling checkpoint is dropped
from both tiers. A lookup searches both: the usable depth is the deepest page boundary whose
pages all sit on either tier and whose checkpoint (hybrids) sits on either; if that is deeper
than the device hit, the host part is *materialized* — fresh device pages and a checkpoint slot
are allocated, indexed under their hashes, and a *load* of each host entry into them is queued —
and the lookup then answers from the device as usual. The engine drains both queues before it
dispatches the step that follows (`take_transfers`: offloads first, they read the device state
the evictions left, then loads; runtime/engine/host_tier.py). A host read that fails (a missing
entry or an injected fault) leaves the hit at the device's depth: the request recomputes the rest.

Swap or recompute, by cost (`SwapCost`, its constants from the execution plan,
runtime/steps/execution_plan.py): a host hit is taken — materialized, and admission waits for the
device room it needs — only when loading its bytes is cheaper than recomputing its tokens;
otherwise the lookup answers the device hit and the request recomputes the rest. Counted in
`stats`: `host_cache_hits_taken` (host hits taken), `host_cache_recomputes` (declined by cost),
`host_cache_admission_waits` (lookups whose taken hit had no device room yet).

A page or slot evicted again before its load ran takes its load back (the host still has the
entry, or gets it back from the load). Bitwise: the device state a host hit restores is the one
the evicted page or slot held. Plain Python, no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paged_kv.cache_manager import CacheManager, PrefixHit
from paged_kv.host_tier import KV, STATE, HostStore
from paged_kv.preempt_swap import PreemptSwap
from paged_kv.prefix_cache import BlockHash, BlockIndex
from paged_kv.state_slots import StateSlotPool


@dataclass(frozen=True)
class SwapCost:
    """A host hit's load vs its recompute, in seconds: load = `load_latency_s` (one load batch's
    fixed cost) + bytes / `load_bytes_per_s`; recompute = tokens / `recompute_tokens_per_s`."""

    load_bytes_per_s: float
    load_latency_s: float
    recompute_tokens_per_s: float

    def __post_init__(self):
        if self.load_bytes_per_s <= 0 or self.recompute_tokens_per_s <= 0 or self.load_latency_s < 0:
            raise ValueError(f"swap cost constants must be positive (latency >= 0), got {self}")

    def load_seconds(self, nbytes: int) -> float:
        return self.load_latency_s + nbytes / self.load_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.recompute_tokens_per_s

    def prefers_load(self, nbytes: int, num_tokens: int) -> bool:
        return self.load_seconds(nbytes) < self.recompute_seconds(num_tokens)


class _TrackedIndex(BlockIndex):
    """A BlockIndex that reports every removal (id, hash) to `on_remove`."""

    def __init__(self, kind: str, on_remove) -> None:
        super().__init__()
        self.kind, self.on_remove = kind, on_remove

    def remove(self, resource_id: int) -> None:
        block_hash = self.hash_of_id[resource_id]
        super().remove(resource_id)
        self.on_remove(self.kind, resource_id, block_hash)


class TieredCacheManager(PreemptSwap, CacheManager):
    """CacheManager + host store. `host_bytes`: the host tier's capacity; `swap_cost`: the rule that
    takes or declines a host hit and a preemption's swap (None: always take / swap; the engine sets the
    plan's). Preemption by swap: paged_kv/preempt_swap.py."""

    def __init__(self, *, host_bytes: int, swap_cost: SwapCost | None = None, **kwargs):
        super().__init__(**kwargs)
        if not self.enable_prefix_caching:
            raise ValueError("the host-memory tier (kv_offloading_size) needs prefix caching on")
        if self.window is not None:
            raise ValueError("the host-memory tier does not support window-aware paging yet (cache.window_paging)")
        self.host = HostStore(host_bytes)
        self.page_index = _TrackedIndex(KV, self._on_remove)
        if self.slots is not None:
            self.slots.checkpoints = _TrackedIndex(STATE, self._on_remove)
        self.offloads: list[tuple[str, int, BlockHash]] = []  # (kind, page or slot, hash) to copy to host
        self.loads: dict[tuple[str, int], tuple[BlockHash, object]] = {}  # (kind, id) -> (hash, host value)
        self._superseding = self._adopting = False
        self._restore: list[tuple[tuple[str, BlockHash], object]] = []
        self._wait_for_room = False  # the last lookup's host hit had no room: the next allocate declines
        self._pinned: set[int] = set()  # materialized checkpoints not evictable before their load ran
        if self.slots is not None:
            self.slots.adopt_checkpoint = self._adopt_checkpoint
        self.num_materialized_pages = 0
        self.num_materialized_checkpoints = 0
        self.swap_cost = swap_cost
        self.num_hits_taken = 0  # host hits taken (materialized)
        self.num_recomputes = 0  # host hits declined: recomputing was cheaper
        self.num_admission_waits = 0  # host hits taken with no device room yet: admission waited
        self.wait_for_room = True  # False: such a hit is recomputed instead (benchmarks/preemption_swap.py)
        self._init_swap()

    # ---- eviction -> offload ------------------------------------------------------------------
    def _on_remove(self, kind: str, resource_id: int, block_hash: BlockHash) -> None:
        key = (kind, block_hash)
        if kind == STATE:
            self._pinned.discard(resource_id)
        pending = self.loads.get((kind, resource_id))
        if pending is not None and not self._adopting:  # the id gets other contents: its load is void
            del self.loads[(kind, resource_id)]
        if self._superseding:
            self.host.discard(key)
            return
        if pending is not None:  # the device never held it yet: the host keeps (or gets back) the value
            if key not in self.host:
                self._restore.append((key, pending[1]))
            return
        if key in self.host:
            self.host.touch(key)
            return
        self.offloads.append((kind, resource_id, block_hash))

    def _adopt_checkpoint(self, slot: int) -> None:
        """A checkpoint becomes a request's running state in place: its pending load must stay."""
        self._adopting = True
        try:
            StateSlotPool.adopt_checkpoint(self.slots, slot)
        finally:
            self._adopting = False

    def _drop_checkpoint(self, block_hash: BlockHash) -> None:
        self._superseding = True
        try:
            super()._drop_checkpoint(block_hash)
            self.host.discard((STATE, block_hash))  # evicted to host before it was superseded
        finally:
            self._superseding = False

    def take_transfers(self) -> tuple[list[tuple[str, int, BlockHash]], list[tuple[str, int, object]], list]:
        """-> (offloads: (kind, id, hash) to gather from the device and `store`, loads: (kind, id,
        host value) to scatter into the device, restores: ((kind, hash), value) to `store` as is);
        the queues are empty afterwards. Offloads must read the device before loads write it."""
        for slot in self._pinned:  # loaded by the time anything reads it again: evictable from now on
            self.slots.checkpoints.mark_evictable(slot)
        self._pinned.clear()
        if self.num_checkpoint_slots is not None:  # a host hit's checkpoint may have gone above the budget
            over = self.slots.num_checkpoints + self.num_pending_checkpoints - self.num_checkpoint_slots
            idle = [s for s in self.slots.checkpoints.evictable if (STATE, s) not in self.loads]
            for slot in idle[: max(0, over)]:  # least recently used first; never one being loaded
                self.slots.checkpoints.remove(slot)
                self._evict_checkpoint(slot)
        offloads = self.offloads
        loads = [(kind, rid, value) for (kind, rid), (_, value) in self.loads.items()]
        restores = list(self._restore)
        self.offloads, self.loads, self._restore = [], {}, []
        return offloads, loads, restores

    def store(self, kind: str, block_hash: BlockHash, value: object, nbytes: int) -> None:
        """The engine gathered an offload: keep it on the host (LRU within the byte cap); a swap
        record's part only while its record lives."""
        if isinstance(block_hash, tuple) and not self.keeps_swap_entry(kind, block_hash):
            return
        self.host.put((kind, block_hash), value, nbytes)

    # ---- lookup over both tiers ---------------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> PrefixHit:
        self._wait_for_room = False
        hit = super().lookup_prefix(token_ids, extra_keys)
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return hit
        hashes = hit.block_hashes
        depth = 0
        while depth < len(hashes) and (
            self.page_index.get(hashes[depth]) is not None or (KV, hashes[depth]) in self.host
        ):
            depth += 1
        while self.slots is not None and depth and not self._has_checkpoint(hashes[depth - 1]):
            depth -= 1
        if depth * self.page_size <= hit.num_tokens:
            return hit
        if self.swap_cost is not None and not self.swap_cost.prefers_load(
            self._host_bytes(hashes[:depth]), depth * self.page_size - hit.num_tokens
        ):
            self.num_recomputes += 1
            return hit
        if not self._materialize(hashes[:depth]):
            self.num_admission_waits += self._wait_for_room
            return hit
        self.num_hits_taken += 1
        return super().lookup_prefix(token_ids, extra_keys)

    def _host_bytes(self, hashes: Sequence[BlockHash]) -> int:
        """Bytes a host hit over the chain `hashes` loads: its pages not on the device, and its
        last boundary's checkpoint when the device lacks it."""
        keys = [(KV, h) for h in hashes if self.page_index.get(h) is None]
        if self.slots is not None and self.slots.lookup_checkpoint(hashes[-1]) is None:
            keys.append((STATE, hashes[-1]))
        return sum(self.host.nbytes(key) for key in keys)

    def hit_tokens(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        """Tokens a lookup would hit over both tiers, read-only (nothing materialized): attention
        DP's placement asks every rank (runtime/scheduling/dp_scheduler.py)."""
        hit = super().lookup_prefix(token_ids, extra_keys)
        hashes, depth = hit.block_hashes, 0
        while depth < len(hashes) and (
            self.page_index.get(hashes[depth]) is not None or (KV, hashes[depth]) in self.host
        ):
            depth += 1
        while self.slots is not None and depth and not self._has_checkpoint(hashes[depth - 1]):
            depth -= 1
        return max(hit.num_tokens, depth * self.page_size)

    def allocate(self, *args, **kwargs):
        """`CacheManager.allocate`, or None (wait) right after a lookup whose host hit found no room:
        a chunk of recompute would fit now, but the hit is worth more once running requests finish."""
        if self._wait_for_room:
            self._wait_for_room = False
            return None
        return super().allocate(*args, **kwargs)

    def _has_checkpoint(self, block_hash: BlockHash) -> bool:
        return self.slots.lookup_checkpoint(block_hash) is not None or (STATE, block_hash) in self.host

    def _materialize(self, hashes: Sequence[BlockHash]) -> bool:
        """Bring the host's pages of the chain `hashes` (and its last boundary's checkpoint) onto
        the device: allocate, index and queue their loads. False (nothing materialized) when
        the device has no room or a host read fails."""
        device = [self.page_index.get(h) for h in hashes]
        missing = [i for i, page in enumerate(device) if page is None]
        pinned = [p for p in device if p is not None]
        evictable = sum(1 for p in pinned if p in self.page_index.evictable)
        if self.pages.num_free + self.page_index.num_evictable - evictable < len(missing):
            # admission waits until running requests free pages
            self._wait_for_room = self.wait_for_room and bool(self.allocations)
            return False
        state_hash = hashes[-1] if self.slots is not None and self.slots.lookup_checkpoint(hashes[-1]) is None else None
        values = {}
        for i in missing:
            values[i] = self.host.get((KV, hashes[i]))
            if values[i] is None:
                return False
        state = None
        if state_hash is not None:
            state = self.host.get((STATE, state_hash))
            if state is None:
                return False
            self._make_room_for_checkpoint()  # within the budget if it can; else above it until loaded
            slot = self.slots.acquire()  # at worst the slot the request is about to run in (it adopts it)
            if slot is None:
                return False
            self.loads[(STATE, slot)] = (state_hash, state)
            self.slots.publish_checkpoint(slot, state_hash)
            # this schedule may read it (a hit's copy_before) after evicting it: it stays until loaded
            self.slots.checkpoints.unmark_evictable(slot)
            self._pinned.add(slot)
            self.num_materialized_checkpoints += 1
        for page in pinned:  # not evicted while the host pages are placed
            self._take_cached_page(page)
        placed = []
        for i in missing:
            page = self._new_page()
            self.page_index.insert(hashes[i], page)
            self.loads[(KV, page)] = (hashes[i], values[i])
            placed.append(page)
        self.num_materialized_pages += len(placed)
        for page in reversed(pinned + placed):
            if self.pages.release(page) == 0:
                self.page_index.mark_evictable(page)
        return True

    # ---- accounting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            **super().stats(),
            **self.host.stats(),
            "host_cache_pages_loaded": self.num_materialized_pages,
            "host_cache_checkpoints_loaded": self.num_materialized_checkpoints,
            "host_cache_hits_taken": self.num_hits_taken,
            **self.swap_stats(),
            "host_cache_recomputes": self.num_recomputes,
            "host_cache_admission_waits": self.num_admission_waits,
        }

    def check_invariants(self) -> None:
        budget = self.num_checkpoint_slots
        for slot in self._pinned:  # evictable once loaded, and back within the budget then
            self.slots.checkpoints.evictable[slot] = None
        if budget is not None:
            self.num_checkpoint_slots = budget + len(self._pinned) + sum(k == STATE for k, _ in self.loads)
        try:
            super().check_invariants()
        finally:
            self.num_checkpoint_slots = budget
            for slot in self._pinned:
                self.slots.checkpoints.unmark_evictable(slot)
        self.host.check_invariants()
        self.check_swap_invariants()
