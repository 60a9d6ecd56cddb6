"""The host-memory tier's device side: copies evicted KV pages / GDN checkpoints to host memory and
host hits back into the device caches, before the step that follows the schedule that asked.

`HostTierTransfers.run(caches)` drains the cache manager's queues (paged_kv/tiered_cache.py
`take_transfers`): first the *offloads* — one jitted gather of the evicted pages' rows of every
KV leaf (K, V, FP8 scales) and the evicted slots' rows of every conv / recurrent state leaf, split
per entry and moved to host memory (`jax.device_put` to the `pinned_host` memory kind on TPU/GPU;
on CPU a device array already lives in host memory, and stays as it is) — then the *loads*: one
jitted scatter (caches donated) of the host entries into the freshly allocated pages and slots.
Everything is dispatched in program order on the caches value before the step's own programs, on
the engine's thread (no background thread: multi-host TPU queues stay in step), so a gather reads
the state the eviction left and a load lands before the step reads it; nothing waits for the
device. Layout: a layer group g's page p is row g x num_pages + p of its KV arrays, its slot s
row g x num_slots + s of its state arrays (Model.init_caches).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.host_tier import KV, STATE

_PARTS = {KV: ("kv",), STATE: ("conv", "rec")}


def _pad(n: int) -> int:
    """Entries per program, padded to a power of two (few compiled variants)."""
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("num",))
def _gather(tree, rows, rank, *, num: int):
    """rows [num, G] -> a tuple of `num` trees, each leaf's rows of one entry [G, ...]; `rank`
    (attention DP, caches [D, ...]): those rows of that rank's caches; None: one rank's caches."""
    if rank is not None:
        return tuple(jax.tree.map(lambda x, j=j: x[rank, rows[j]], tree) for j in range(num))
    return tuple(jax.tree.map(lambda x, j=j: x[rows[j]], tree) for j in range(num))


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(tree, rows, values, rank):
    """Write `values` (a tuple of entry trees, leaves [G, ...]) into rows [num, G] of `tree` (of
    rank `rank`'s caches under attention DP)."""
    flat = rows.reshape(-1)

    def put(x, *entries):
        value = jnp.concatenate(entries, axis=0).astype(x.dtype)
        return x.at[flat].set(value) if rank is None else x.at[rank, flat].set(value)

    return jax.tree.map(put, tree, *values)


def host_memory_kind() -> str | None:
    """'pinned_host' where the device offers it (TPU, GPU); None on CPU (device memory is host memory)."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


class HostTierTransfers:
    """Drains a TieredCacheManager's offload and load queues against the engine's caches."""

    def __init__(self, cache, num_groups: int, num_pages: int, num_slots: int, rank: int | None = None):
        self.cache = cache
        self.rank = rank  # attention DP: this tier's rank (the caches carry a leading rank axis)
        self.num_groups = num_groups
        self.size = {KV: num_pages, STATE: max(num_slots, 2)}
        self.memory_kind = host_memory_kind()
        self.num_offload_batches = 0
        self.num_load_batches = 0
        self.load_seconds: list[float] = []  # host -> device dispatch time per load batch

    def _rows(self, kind: str, ids: list[int], num: int) -> np.ndarray:
        ids = ids + [ids[0]] * (num - len(ids))  # padding repeats the first entry: same row, same value
        groups = np.arange(self.num_groups, dtype=np.int32) * self.size[kind]
        return (np.asarray(ids, np.int32)[:, None] + groups[None, :]).astype(np.int32)

    def _subtree(self, caches, kind: str) -> dict:
        return {part: caches[part] for part in _PARTS[kind]}

    def run(self, caches):
        offloads, loads, restores = self.cache.take_transfers()
        for key, value in restores:
            self.cache.store(*key, value, _nbytes(value))
        for kind in (KV, STATE):
            batch = [(rid, h) for k, rid, h in offloads if k == kind]
            if batch:
                self._offload(caches, kind, batch)
        for kind in (KV, STATE):
            batch = [(rid, value) for k, rid, value in loads if k == kind]
            if batch:
                caches = self._load(caches, kind, batch)
        return caches

    def _offload(self, caches, kind: str, batch: list) -> None:
        num = _pad(len(batch))
        rows = self._rows(kind, [rid for rid, _ in batch], num)
        entries = _gather(self._subtree(caches, kind), rows, self._rank(), num=num)
        self.num_offload_batches += 1
        for (_, block_hash), entry in zip(batch, entries):
            if self.memory_kind is not None:
                entry = jax.device_put(
                    entry, jax.tree.map(lambda x: x.sharding.with_memory_kind(self.memory_kind), entry)
                )
            self.cache.store(kind, block_hash, entry, _nbytes(entry))

    def _load(self, caches, kind: str, batch: list):
        start = time.perf_counter()
        num = _pad(len(batch))
        values = [value for _, value in batch]
        values += [values[0]] * (num - len(values))
        sub = self._subtree(caches, kind)
        if self.memory_kind is not None and self.rank is None:  # back to device memory, laid out as the caches are
            shardings = jax.tree.map(lambda x: x.sharding, sub)
            values = [jax.device_put(v, shardings) for v in values]
        elif self.memory_kind is not None:  # a rank's entry: back where it was gathered from
            values = [
                jax.device_put(v, jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), v)) for v in values
            ]
        sub = _scatter(sub, self._rows(kind, [rid for rid, _ in batch], num), tuple(values), self._rank())
        self.num_load_batches += 1
        self.load_seconds.append(time.perf_counter() - start)
        return {**caches, **sub}

    def _rank(self):
        return None if self.rank is None else np.int32(self.rank)

    def stats(self) -> dict:
        seconds = self.load_seconds[-1024:]
        return {
            "host_cache_load_batches": self.num_load_batches,
            "host_cache_load_seconds_mean": float(np.mean(seconds)) if seconds else 0.0,
        }


class RankHostTiers:
    """Attention DP: one tier per rank (each rank's cache manager has its own host store, of
    cache.kv_offloading_size / data), drained in rank order against the rank-stacked caches."""

    def __init__(self, tiers: list[HostTierTransfers]):
        self.tiers = tiers

    def run(self, caches):
        for tier in self.tiers:
            caches = tier.run(caches)
        return caches

    def stats(self) -> dict:
        seconds = [s for t in self.tiers for s in t.load_seconds[-1024:]]
        return {
            "host_cache_load_batches": sum(t.num_load_batches for t in self.tiers),
            "host_cache_load_seconds_mean": float(np.mean(seconds)) if seconds else 0.0,
        }


def build_host_tier(engine) -> HostTierTransfers | RankHostTiers | None:
    """The engine's transfers when its cache manager(s) have a host tier (cache.kv_offloading_size),
    else None; under attention DP one per rank."""
    from paged_kv.tiered_cache import TieredCacheManager

    config, groups = engine.cache_config, engine.model.num_groups
    sizes = (config.num_pages, config.num_state_slots)
    if engine.dp is not None:
        ranks = engine.scheduler.ranks
        if not all(isinstance(s.cache, TieredCacheManager) for s in ranks):
            return None
        return RankHostTiers([HostTierTransfers(s.cache, groups, *sizes, rank=r) for r, s in enumerate(ranks)])
    if not isinstance(engine.scheduler.cache, TieredCacheManager):
        return None
    return HostTierTransfers(engine.scheduler.cache, groups, *sizes)


def refuse_host_tier(config, window: int | None) -> None:
    """Start-up check: the combinations the host tier does not support yet, refused by name."""
    if not config.kv_offloading_size:
        return
    why = [
        (not config.enable_prefix_caching, "needs cache.enable_prefix_caching"),
        (window is not None, "does not support window-aware paging yet (set cache.window_paging: false)"),
    ]
    for refused, reason in why:
        if refused:
            raise ValueError(f"cache.kv_offloading_size (the host-memory tier) {reason}")


def _nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
