"""The host-memory tier's store: evicted KV pages and GDN checkpoints, LRU within a byte cap.

An entry is keyed by (kind, block hash): `("kv", h)` holds one KV page's contents over every
attention layer (FP8 scales included), `("state", h)` one GDN checkpoint (conv + recurrent state
of every linear layer) after the page boundary `h`. Values are opaque to this module (the
engine's host arrays, runtime/engine/host_tier.py); the caller gives each one's bytes. `put`
evicts the least recently used entries until the new one fits; an entry larger than the whole
cap is refused. `get` counts a hit and refreshes the entry, or a failure (a missing entry, or
an injected fault: `fail_next`), and the caller then recomputes. Plain Python, no JAX.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

KV, STATE = "kv", "state"


class HostStore:
    """(kind, hash) -> (value, nbytes), least recently used first, at most `capacity_bytes`."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the host tier needs a positive byte capacity, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.num_puts = 0  # entries stored (offloads)
        self.num_hits = 0  # entries read back for a device hit
        self.num_evictions = 0  # entries dropped for the byte cap
        self.num_failures = 0  # reads that failed (the caller recomputes instead)
        self.num_dropped = 0  # entries dropped because superseded
        self.fail_next = 0  # fault injection: the next N reads fail

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Store `value` (most recently used), evicting LRU entries to fit; False if it never fits."""
        if nbytes > self.capacity_bytes:
            return False
        self.discard(key, superseded=False)
        while self.bytes + nbytes > self.capacity_bytes:
            _, (_, old_bytes) = self.entries.popitem(last=False)
            self.bytes -= old_bytes
            self.num_evictions += 1
        self.entries[key] = (value, nbytes)
        self.bytes += nbytes
        self.num_puts += 1
        return True

    def resize(self, capacity_bytes: int) -> None:
        """A new cap; the least recently used entries go until the rest fit."""
        if capacity_bytes <= 0:
            raise ValueError(f"the host tier needs a positive byte capacity, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        while self.bytes > capacity_bytes:
            _, (_, old_bytes) = self.entries.popitem(last=False)
            self.bytes -= old_bytes
            self.num_evictions += 1

    def nbytes(self, key: Hashable) -> int:
        """An entry's bytes (0 when absent)."""
        entry = self.entries.get(key)
        return 0 if entry is None else entry[1]

    def touch(self, key: Hashable) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def get(self, key: Hashable) -> Any | None:
        """The value (refreshed in the LRU) or None: a miss or a failed read (counted; a failed
        entry is dropped, so the next lookup does not try it again)."""
        if self.fail_next > 0 and key in self.entries:
            self.fail_next -= 1
            self.num_failures += 1
            self.discard(key, superseded=False)
            return None
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        self.num_hits += 1
        return entry[0]

    def discard(self, key: Hashable, superseded: bool = True) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
            self.num_dropped += superseded

    def stats(self) -> dict[str, int]:
        return {
            "host_cache_bytes": self.bytes,
            "host_cache_capacity_bytes": self.capacity_bytes,
            "host_cache_entries": len(self.entries),
            "host_cache_offloads": self.num_puts,
            "host_cache_hits": self.num_hits,
            "host_cache_evictions": self.num_evictions,
            "host_cache_load_failures": self.num_failures,
            "host_cache_superseded": self.num_dropped,
        }

    def check_invariants(self) -> None:
        assert self.bytes == sum(n for _, n in self.entries.values()), "host tier bytes out of sync"
        assert 0 <= self.bytes <= self.capacity_bytes, f"host tier holds {self.bytes} > {self.capacity_bytes} bytes"
