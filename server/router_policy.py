"""The router's choice of replica: prompt block hashes, a per-replica LRU index of them, policies.

A prompt's tokens are cut into `block_size` blocks; block i's hash covers blocks 0..i (chained),
so one hash names a whole prefix, as the replicas' own prefix caches do with pages. The index
remembers, per replica, the hashes of the prompts recently routed there (LRU, capped): an
estimate of what its prefix cache holds, never asked of the replica. Plain Python, no I/O.

cache_aware (SGLang's rule): the replica with the longest leading run of known blocks wins if
that run covers at least `cache_threshold` of the prompt, unless its outstanding requests exceed
the least loaded replica's by more than `balance_abs` and more than `balance_rel` times; otherwise
(and for prompts shorter than one block) the least loaded wins, among equals the one whose
index is smallest (SGLang's spreading of new prefixes).
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full `block_size` blocks of `tokens` (a partial last block: none)."""
    out, previous = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        out.append(previous)
    return out


class BlockIndex:
    """Per replica, the most recently routed block hashes (at most `capacity` each)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: dict[int, collections.OrderedDict[bytes, None]] = {}

    def match(self, backend_id: int, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the replica is believed to hold."""
        known = self._blocks.get(backend_id)
        if not known:
            return 0
        # chained hashes: the longest known block implies its prefix; binary search for it
        low, high = 0, len(hashes)
        while low < high:
            mid = (low + high + 1) // 2
            if hashes[mid - 1] in known:
                low = mid
            else:
                high = mid - 1
        return low

    def insert(self, backend_id: int, hashes: Sequence[bytes]) -> None:
        known = self._blocks.setdefault(backend_id, collections.OrderedDict())
        for h in reversed(hashes):  # a prefix's first blocks are the most recent: evicted last
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.capacity:
            known.popitem(last=False)

    def forget(self, backend_id: int) -> None:
        """The replica died or left: whatever it cached is gone."""
        self._blocks.pop(backend_id, None)

    def size(self, backend_id: int) -> int:
        return len(self._blocks.get(backend_id, ()))


@dataclass(frozen=True)
class Candidate:
    backend_id: int
    load: int  # outstanding requests through this router


@dataclass(frozen=True)
class Decision:
    backend_id: int
    by_affinity: bool = False
    matched_blocks: int = 0


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """Fewest outstanding requests; ties: the first listed."""
    return min(candidates, key=lambda c: c.load)


def imbalanced(load: int, least: int, abs_threshold: int, rel_threshold: float) -> bool:
    return load - least > abs_threshold and load > least * rel_threshold


@dataclass
class CacheAware:
    index: BlockIndex
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5

    def choose(self, candidates: Sequence[Candidate], hashes: Sequence[bytes]) -> Decision:
        # ties in load: the replica believed to cache least (it has the most room), then the first
        least = min(candidates, key=lambda c: (c.load, self.index.size(c.backend_id)))
        if not hashes:
            return Decision(least.backend_id)
        matches = [(self.index.match(c.backend_id, hashes), -c.load, -i, c) for i, c in enumerate(candidates)]
        matched, _, _, best = max(matches, key=lambda m: m[:3])
        if (
            matched > 0
            and matched >= self.cache_threshold * len(hashes)
            and not imbalanced(best.load, least.load, self.balance_abs, self.balance_rel)
        ):
            return Decision(best.backend_id, by_affinity=True, matched_blocks=matched)
        chosen_match = next(m for m, _, _, c in matches if c is least)
        return Decision(least.backend_id, matched_blocks=chosen_match)


class LeastLoad:
    def choose(self, candidates: Sequence[Candidate], hashes: Sequence[bytes]) -> Decision:
        return Decision(least_loaded(candidates).backend_id)


class RoundRobin:
    """Each request to the next replica by id after the previous one's."""

    def __init__(self):
        self._last = -1

    def choose(self, candidates: Sequence[Candidate], hashes: Sequence[bytes]) -> Decision:
        ids = sorted(c.backend_id for c in candidates)
        chosen = next((i for i in ids if i > self._last), ids[0])
        self._last = chosen
        return Decision(chosen)


def make_policy(name: str, index: BlockIndex, cache_threshold: float, balance_abs: int, balance_rel: float):
    if name == "cache_aware":
        return CacheAware(index, cache_threshold, balance_abs, balance_rel)
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}")
