"""Preemption by swap: a preempted request's whole state to host memory and back (vLLM's swap vs recompute).

`PreemptSwap` is the part of `TieredCacheManager` (paged_kv/tiered_cache.py) that keeps a preempted
request resumable at exactly its `num_computed_tokens` with nothing recomputed. `preempt` frees the
request as `CacheManager.free` does and, when the cost rule prefers it, leaves a *swap record*
under the request id: its full pages by block hash (they are in the prefix index already and reach
the host the usual way when the device evicts them), and two host entries it owns — the partial
last page (KV of every attention layer, FP8 scales included) and the running GDN state slot (conv +
recurrent, at the exact token) — queued as offloads on the same ordered transfer queue
(runtime/engine/host_tier.py gathers them before the next step writes anything). `swap_in`, at
re-admission, takes the device's pages of the chain, places host pages, the partial page and the
state in fresh pages and a fresh running slot and queues their loads; the request resumes at
`num_computed_tokens`. Admission waits while the device lacks the room (never when nothing runs).

A record's entries are ordinary host-store entries (`(KV | STATE, ("swap", request id, serial,
part))`): counted in the byte cap and evicted by its LRU like pages and checkpoints. A record whose
entries or chain pages are gone (evicted, a failed read, an offload not gathered yet) is dropped
and the request recomputes from the prefix cache as without the tier: never wrong output. A finished
or aborted request's record is dropped with its entries (`drop_swap`).

The cost rule (`SwapCost`): swap when loading the record's own bytes (partial page + state) is
cheaper than recomputing the tokens a recompute would redo (those past the deepest boundary whose
pages and, on hybrids, checkpoint stay cached), else recompute. The record's entries are ordinary
KV / state entries: the engine's transfers (runtime/engine/host_tier.py) move the MTP layer's K/V
and hidden carry and a draft model's K/V with them. Plain Python, no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paged_kv.cache_manager import Admission, SequenceAllocation
from paged_kv.host_tier import KV, STATE
from paged_kv.prefix_cache import BlockHash, hash_full_pages


@dataclass
class SwapRecord:
    """What `swap_in` needs to resume a request at `num_computed` tokens."""

    num_computed: int
    block_hashes: list[BlockHash]  # the chain of its full pages (all computed)
    keys: dict[str, tuple]  # "page" / "state" -> its host-store key
    extra_keys: tuple
    divergence: int
    rolling_checkpoint: BlockHash | None


class PreemptSwap:
    """Mixed into TieredCacheManager: `preempt`, `resume_point`, `swap_in`, `drop_swap`."""

    def _init_swap(self) -> None:
        self.swapped: dict[str, SwapRecord] = {}
        self.entry_bytes: dict[str, int] = {}  # KV: one page's bytes, STATE: one slot's (the engine's)
        self._swap_serial = 0
        self.num_swap_outs = 0  # preempted requests swapped out (records made)
        self.num_swap_ins_preempted = 0  # records restored: resumed with nothing recomputed
        self.num_swap_fallbacks = 0  # records dropped at re-admission (evicted, failed): recomputed
        self.num_swap_declined = 0  # preemptions the cost rule left to recompute
        self.swap_preempted = True  # False: preemption recomputes as without the tier (benchmarks)

    # ---- out ----------------------------------------------------------------------------------
    def preempt(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> bool:
        """Free `request_id`'s resources; True when a swap record keeps its state to resume from."""
        allocation = self.allocations[request_id]
        record = self._swap_record(allocation, token_ids, num_computed)
        if record is not None:
            self._swap_serial += 1
            key = ("swap", request_id, self._swap_serial)
            num_full = num_computed // self.page_size
            if num_computed % self.page_size:
                record.keys["page"] = (KV, (*key, "page"))
                self.offloads.append((KV, allocation.block_table[num_full], (*key, "page")))
            if self.slots is not None:
                record.keys["state"] = (STATE, (*key, "state"))
                self.offloads.append((STATE, allocation.state_slot, (*key, "state")))
            self.swapped[request_id] = record
            self.num_swap_outs += 1
        self.free(request_id)
        return record is not None

    def _swap_record(self, allocation: SequenceAllocation, token_ids: Sequence[int], num_computed: int):
        """A record for the allocation, or None when recompute costs no more (by the cost rule)."""
        if num_computed <= 0 or not self.swap_preempted:
            return None
        hashes = hash_full_pages(
            token_ids, self.page_size, allocation.extra_keys, allocation.block_hashes, num_computed
        )[: num_computed // self.page_size]
        depth = len(hashes)  # what a lookup would give back: the chain, down to a checkpoint on hybrids
        while self.slots is not None and depth and not self._has_checkpoint(hashes[depth - 1]):
            depth -= 1
        if self.slots is None and depth * self.page_size == num_computed:
            return None  # attention only, on a page boundary: the prefix cache holds it all
        # a checkpoint may be evicted before re-admission: a hybrid's record saves at least a page
        saved = max(num_computed - depth * self.page_size, self.page_size if self.slots is not None else 0)
        nbytes = self.entry_bytes.get(KV, 0) * bool(num_computed % self.page_size)
        nbytes += self.entry_bytes.get(STATE, 0) * (self.slots is not None)
        if self.swap_cost is not None and not self.swap_cost.prefers_load(nbytes, saved):
            self.num_swap_declined += 1
            return None
        rolling = allocation.rolling_checkpoint
        return SwapRecord(num_computed, list(hashes), {}, allocation.extra_keys, allocation.divergence, rolling)

    # ---- in -----------------------------------------------------------------------------------
    def resume_point(self, request_id: str) -> tuple[int, int] | None:
        """(tokens computed, divergence) a swapped-out request resumes at, or None (no record)."""
        record = self.swapped.get(request_id)
        return None if record is None else (record.num_computed, record.divergence)

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Admission | None:
        """Restore the record: pages for `num_tokens` tokens and a running slot, loads queued. None:
        no room yet (the record stays; admission waits) or the record is unusable (dropped: the
        caller recomputes; `resume_point` is None then)."""
        record = self.swapped[request_id]
        hashes = record.block_hashes
        device = [self.page_index.get(h) for h in hashes]
        missing = [i for i, page in enumerate(device) if page is None]
        absent = [key for key in record.keys.values() if key not in self.host]
        absent += [(KV, hashes[i]) for i in missing if (KV, hashes[i]) not in self.host]
        queued = {(kind, key) for kind, _, key in self.offloads}  # evicted this schedule: on host after it
        if any(key not in queued for key in absent):
            return self._fallback(request_id)
        pinned = [p for p in device if p is not None]
        evictable = sum(1 for p in pinned if p in self.page_index.evictable)
        num_new = self.pages_needed(num_tokens) - len(pinned)
        room = self.pages.num_free + self.page_index.num_evictable - evictable >= num_new
        if absent or not room or (self.slots is not None and self.slots.num_obtainable() < 1):
            return None if self.allocations else self._fallback(request_id)  # nothing runs: never waits
        values = {i: self.host.get((KV, hashes[i])) for i in missing}
        values.update({part: self.host.get(key) for part, key in record.keys.items()})
        if any(v is None for v in values.values()):
            return self._fallback(request_id)
        for page in pinned:
            self._take_cached_page(page)
        table = []
        for i, page in enumerate(device):
            if page is None:
                page = self._new_page()
                self.page_index.insert(hashes[i], page)
                self.loads[(KV, page)] = (hashes[i], values[i])
                self.num_materialized_pages += 1
            table.append(page)
        table += [self._new_page() for _ in range(num_new - len(missing))]
        if "page" in values:
            self.loads[(KV, table[len(hashes)])] = (None, values["page"])
        allocation = SequenceAllocation(request_id, table, extra_keys=record.extra_keys, block_hashes=list(hashes))
        allocation.num_published_pages, allocation.divergence = len(hashes), record.divergence
        allocation.rolling_checkpoint = record.rolling_checkpoint
        if self.slots is not None:
            allocation.state_slot = self.slots.acquire()
            self.loads[(STATE, allocation.state_slot)] = (None, values["state"])
        self.allocations[request_id] = allocation
        self.drop_swap(request_id)
        self.num_swap_ins_preempted += 1
        return Admission(allocation, [])

    def _fallback(self, request_id: str) -> None:  # -> None: the caller recomputes
        self.drop_swap(request_id)
        self.num_swap_fallbacks += 1
        return None

    def drop_swap(self, request_id: str) -> None:
        """Forget `request_id`'s record (restored, finished, aborted or unusable): its host entries
        and any of its offloads not gathered yet."""
        record = self.swapped.pop(request_id, None)
        if record is None:
            return
        keys = set(record.keys.values())
        self.offloads = [o for o in self.offloads if (o[0], o[2]) not in keys]
        for key in keys:
            self.host.discard(key, superseded=False)

    def keeps_swap_entry(self, kind: str, key) -> bool:
        """A gathered offload of a record's part is stored only while that record lives."""
        record = self.swapped.get(key[1]) if isinstance(key, tuple) and key[:1] == ("swap",) else None
        return record is not None and (kind, key) in record.keys.values()

    def swap_stats(self) -> dict[str, int]:
        return {
            "host_cache_swap_outs": self.num_swap_outs,
            "host_cache_swap_ins": self.num_swap_ins_preempted,
            "host_cache_swap_fallbacks": self.num_swap_fallbacks,
            "host_cache_swap_declined": self.num_swap_declined,
            "host_cache_swapped_requests": len(self.swapped),
        }

    def check_swap_invariants(self) -> None:
        assert not set(self.swapped) & set(self.allocations), "a swapped-out request holds an allocation"
        owned = {key for record in self.swapped.values() for key in record.keys.values()}
        orphans = [key for key in self.host.entries if isinstance(key[1], tuple) and key[1][:1] == ("swap",)]
        assert set(orphans) <= owned, f"host entries of no swap record: {set(orphans) - owned}"
