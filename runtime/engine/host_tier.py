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
row g x num_slots + s of its state arrays (Model.init_caches). With `speculative_config.method:
mtp` the MTP layer's K/V (row p) travels with a page and its carry (row s) with a GDN checkpoint,
so the drafts after a host hit are those after a device hit; with `method: draft_model` a page's
entry carries the draft model's K/V of the page too (its pools share the target's page ids, over
the draft's own layer groups). An entry is a dict of *parts*, each with its own layer-group count
(`_parts`): one gather / scatter program moves every part of a batch.

Batches run in programs of BATCH_SIZES entries (a longer batch in several, the last padded), so
the set is small and fixed: with `aot_compile` every gather and scatter is compiled at start-up
beside the step executables (`compile_all`), and none after (a sealed engine raises
CompileAfterStartup instead). `build_host_tier` also hands the cache manager its swap-or-recompute
rule (paged_kv/tiered_cache.SwapCost) from the execution plan's `host_swap_cost` and the model's
FLOPs per token (2 x parameters), and a host entry's bytes. A preempted request's swap record
(paged_kv/preempt_swap.py: its partial last page and running state slot) travels the same queues
as any page or checkpoint: its parts are offloads and loads of the same two kinds.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.host_tier import KV, STATE
from paged_kv.tiered_cache import SwapCost

log = logging.getLogger(__name__)
_PARTS = {KV: ("kv",), STATE: ("conv", "rec")}
_MTP = {KV: "kv", STATE: "hidden"}  # the MTP layer's K/V pages and carry (models/mtp.py): one row per page / slot
BATCH_SIZES = (1, 4, 16)  # entries per gather / scatter program (a batch is cut and padded to these)


def _chunks(batch: list) -> list[tuple[list, int]]:
    """`batch` cut into (entries, program size) pieces: full programs of the largest size, then
    the rest in the smallest size that holds it."""
    top, out = BATCH_SIZES[-1], []
    while batch:
        piece, batch = batch[:top], batch[top:]
        out.append((piece, next(n for n in BATCH_SIZES if n >= len(piece))))
    return out


@functools.partial(jax.jit, static_argnames=("num",))
def _gather(tree, rows, rank, *, num: int):
    """tree, rows: dicts by part (rows [num, G_part]) -> a tuple of `num` entries, each a dict of
    its parts' rows [G_part, ...]; `rank` (attention DP, caches [D, ...]): those rows of that
    rank's caches; None: one rank's caches."""
    pick = (lambda x, r: x[r]) if rank is None else (lambda x, r: x[rank, r])
    return tuple(
        {part: jax.tree.map(lambda x, r=rows[part][j]: pick(x, r), leaf) for part, leaf in tree.items()}
        for j in range(num)
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(tree, rows, values, rank):
    """Write `values` (a tuple of entries, as `_gather` makes them) into `tree`'s rows (dicts by
    part; of rank `rank`'s caches under attention DP)."""

    def put(flat):
        def one(x, *entries):
            value = jnp.concatenate(entries, axis=0).astype(x.dtype)
            return x.at[flat].set(value) if rank is None else x.at[rank, flat].set(value)

        return one

    return {
        part: jax.tree.map(put(rows[part].reshape(-1)), leaf, *[v[part] for v in values]) for part, leaf in tree.items()
    }


def host_memory_kind() -> str | None:
    """'pinned_host' where the device offers it (TPU, GPU); None on CPU (device memory is host memory)."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


class HostTierTransfers:
    """Drains a TieredCacheManager's offload and load queues against the engine's caches."""

    def __init__(
        self,
        cache,
        num_groups: int,
        num_pages: int,
        num_slots: int,
        rank: int | None = None,
        mtp: bool = False,
        draft_groups: int = 0,
    ):
        """`mtp`: the MTP layer's K/V and carry travel with pages and checkpoints; `draft_groups`:
        the draft model's layer groups, its K/V travels with pages (0: no draft model)."""
        self.cache = cache
        self.rank = rank  # attention DP: this tier's rank (the caches carry a leading rank axis)
        self.size = {KV: num_pages, STATE: max(num_slots, 2)}
        # each kind's parts and their layer-group counts (ungrouped MTP: the page / slot id itself)
        self.parts = {
            kind: {part: num_groups for part in _PARTS[kind]} | ({"mtp": 1} if mtp else {}) for kind in _PARTS
        }
        if draft_groups:
            self.parts[KV]["draft"] = draft_groups
        self.memory_kind = host_memory_kind()
        self.num_offload_batches = 0
        self.num_load_batches = 0
        self.load_seconds: list[float] = []  # host -> device dispatch time per load batch
        self.load_seconds_total = 0.0
        self.executables: dict[tuple[str, str, int], object] = {}  # (gather | scatter, kind, size) -> compiled
        self.sealed = False  # compiled at start-up: a missing program raises instead of compiling
        self.compile_seconds = 0.0

    def compile_all(self, caches, sealed: bool) -> float:
        """Compile every gather and scatter program for `caches`' shapes; -> seconds."""
        start = time.perf_counter()
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), caches)
        kinds = [KV] + ([STATE] if jax.tree.leaves(caches.get("rec", ())) else [])
        ranked = self.rank is not None  # one rank's entry: the caches' leaves without their rank axis
        rank = jax.ShapeDtypeStruct((), jnp.int32) if ranked else None
        for kind in kinds:
            sub, parts = self._subtree(spec, kind), self.parts[kind]
            entry = {
                part: jax.tree.map(
                    lambda x, g=parts[part]: jax.ShapeDtypeStruct(
                        (g, *x.shape[2 if ranked else 1 :]), x.dtype, **({} if ranked else {"sharding": x.sharding})
                    ),
                    leaf,
                )
                for part, leaf in sub.items()
            }
            for num in BATCH_SIZES:
                rows = {part: jax.ShapeDtypeStruct((num, g), jnp.int32) for part, g in parts.items()}
                self.executables["gather", kind, num] = _gather.lower(sub, rows, rank, num=num).compile()
                self.executables["scatter", kind, num] = _scatter.lower(sub, rows, (entry,) * num, rank).compile()
        self.sealed = sealed
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def _program(self, op: str, kind: str, num: int):
        exe = self.executables.get((op, kind, num))
        if exe is not None:
            return exe
        if self.sealed:
            from runtime.steps.executables import CompileAfterStartup

            raise CompileAfterStartup(f"host tier {op} of {num} {kind} entries was not compiled at start-up")
        return functools.partial(_gather, num=num) if op == "gather" else _scatter

    def _rows(self, kind: str, ids: list[int], num: int) -> dict:
        """Each part's rows [num, G_part] of the entries `ids` (group g's row: g x size + id)."""
        ids = np.asarray(ids + [ids[0]] * (num - len(ids)), np.int32)  # padding repeats the first entry: same row
        return {
            part: ids[:, None] + np.arange(g, dtype=np.int32)[None, :] * self.size[kind]
            for part, g in self.parts[kind].items()
        }

    def _subtree(self, caches, kind: str) -> dict:
        """The caches' leaves of each of `kind`'s parts."""
        where = {"mtp": lambda: caches["mtp"][_MTP[kind]], "draft": lambda: caches["draft"]["kv"]}
        return {part: where[part]() if part in where else caches[part] for part in self.parts[kind]}

    def _merge(self, caches, sub: dict, kind: str) -> dict:
        """`caches` with the scattered parts written back (the MTP's inside caches["mtp"], the draft
        model's inside caches["draft"])."""
        out = {**caches, **{k: v for k, v in sub.items() if k not in ("mtp", "draft")}}
        if "mtp" in sub:
            out["mtp"] = {**caches["mtp"], _MTP[kind]: sub["mtp"]}
        if "draft" in sub:
            out["draft"] = {**caches["draft"], "kv": sub["draft"]}
        return out

    def run(self, caches):
        offloads, loads, restores = self.cache.take_transfers()
        for key, value in restores:
            self.cache.store(*key, value, _nbytes(value))
        for kind in (KV, STATE):
            for batch, num in _chunks([(rid, h) for k, rid, h in offloads if k == kind]):
                self._offload(caches, kind, batch, num)
        for kind in (KV, STATE):
            for batch, num in _chunks([(rid, value) for k, rid, value in loads if k == kind]):
                caches = self._load(caches, kind, batch, num)
        return caches

    def _offload(self, caches, kind: str, batch: list, num: int) -> None:
        gather = self._program("gather", kind, num)
        entries = gather(self._subtree(caches, kind), self._rows(kind, [rid for rid, _ in batch], num), self._rank())
        self.num_offload_batches += 1
        for (_, block_hash), entry in zip(batch, entries):
            if self.memory_kind is not None:
                entry = jax.device_put(
                    entry, jax.tree.map(lambda x: x.sharding.with_memory_kind(self.memory_kind), entry)
                )
            self.cache.store(kind, block_hash, entry, _nbytes(entry))

    def _load(self, caches, kind: str, batch: list, num: int):
        start = time.perf_counter()
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
        scatter = self._program("scatter", kind, num)
        sub = scatter(sub, self._rows(kind, [rid for rid, _ in batch], num), tuple(values), self._rank())
        self.num_load_batches += 1
        self.load_seconds.append(time.perf_counter() - start)
        self.load_seconds_total += self.load_seconds[-1]
        del self.load_seconds[:-1024]
        return self._merge(caches, sub, kind)

    def _rank(self):
        return None if self.rank is None else np.int32(self.rank)

    def stats(self) -> dict:
        return transfer_stats([self])


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
        return transfer_stats(self.tiers)


def transfer_stats(tiers: list[HostTierTransfers]) -> dict:
    """The transfers' counters and load latency (the last 1024 load batches of each tier)."""
    seconds = [s for t in tiers for s in t.load_seconds]
    return {
        "host_cache_offload_batches": sum(t.num_offload_batches for t in tiers),
        "host_cache_load_batches": sum(t.num_load_batches for t in tiers),
        "host_cache_load_seconds_total": sum(t.load_seconds_total for t in tiers),
        "host_cache_load_seconds_mean": float(np.mean(seconds)) if seconds else 0.0,
        "host_cache_load_seconds_p90": float(np.percentile(seconds, 90)) if seconds else 0.0,
    }


def build_host_tier(engine) -> HostTierTransfers | RankHostTiers | None:
    """The engine's transfers when its cache manager(s) have a host tier (cache.kv_offloading_size),
    else None; under attention DP one per rank. Each cache manager gets the swap-or-recompute rule."""
    from paged_kv.tiered_cache import TieredCacheManager

    config, groups = engine.cache_config, engine.model.num_groups
    sizes = (config.num_pages, config.num_state_slots)
    ranks = engine.scheduler.ranks if engine.dp is not None else [engine.scheduler]
    if not all(isinstance(s.cache, TieredCacheManager) for s in ranks):
        return None
    bandwidth, latency, flops = engine.plan.host_swap_cost
    flops_per_token = 2 * sum(int(np.size(x)) for x in jax.tree.leaves(engine.model.params))
    tiers = []
    entry_bytes = {kind: _entry_bytes(engine.caches, kind, groups, engine.dp is not None) for kind in _PARTS}
    mtp = "mtp" in engine.caches and engine.dp is None  # method: mtp (refused under attention DP)
    draft_groups = engine.model.draft.num_groups if "draft" in engine.caches else 0  # method: draft_model
    for r, s in enumerate(ranks):
        s.cache.swap_cost = SwapCost(bandwidth, latency, flops / max(flops_per_token, 1))
        s.cache.entry_bytes = entry_bytes  # a preemption's swap-or-recompute (paged_kv/preempt_swap.py)
        rank = r if engine.dp is not None else None
        tier = HostTierTransfers(s.cache, groups, *sizes, rank=rank, mtp=mtp, draft_groups=draft_groups)
        if engine.plan.aot_compile:  # beside the step executables; sealed with them
            seconds = tier.compile_all(engine.caches, sealed=engine.executables.sealed)
            log.info("compiled %d host tier gathers / scatters in %.1fs", len(tier.executables), seconds)
        tiers.append(tier)
    return tiers[0] if engine.dp is None else RankHostTiers(tiers)


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


def _entry_bytes(caches, kind: str, groups: int, ranked: bool) -> int:
    """One page's (KV) or one slot's (STATE) bytes over every layer group: a host entry's size."""
    leaves = [x for part in _PARTS[kind] for x in jax.tree.leaves(caches.get(part, ()))]
    return groups * int(sum(x.nbytes // int(np.prod(x.shape[: 2 if ranked else 1])) for x in leaves))


def _nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
