"""Content-addressed index of full pages (and of GDN state checkpoints) for prefix caching.

A full page is keyed by a hash chained over (parent hash, the page's token ids, extra keys),
so equal tokens after a different prefix never collide. The hash is SHA-256 (stable across
processes; Python's `hash()` is salted). `BlockIndex` maps hash <-> resource id (a page or a
state slot) and keeps the LRU order of the entries nobody references (the evictable ones).
Plain Python, no JAX.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence

BlockHash = bytes

_ROOT_HASH: BlockHash = b"\x00" * 32


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """SHA-256 over (parent hash, token ids as little-endian int64, repr of extra keys)."""
    digest = hashlib.sha256()
    digest.update(parent if parent is not None else _ROOT_HASH)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def hash_full_pages(
    token_ids: Sequence[int],
    page_size: int,
    extra_keys: tuple = (),
    known: list[BlockHash] | None = None,
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full pages among the first `num_tokens` (default: all) tokens.

    Extends `known` (hashes of a prefix of the same tokens) in place and returns it, so a
    request's hashes are computed once however often this is called.
    """
    hashes = known if known is not None else []
    num_tokens = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for page_index in range(len(hashes), num_tokens // page_size):
        parent = hashes[-1] if hashes else None
        start = page_index * page_size
        hashes.append(hash_block(parent, token_ids[start : start + page_size], extra_keys))
    return hashes


class BlockIndex:
    """hash <-> id map plus an LRU of the ids that are indexed but unreferenced (evictable).

    `ids` are pages (prefix cache) or state slots (GDN checkpoints); the owner tracks the
    references and calls `mark_evictable` / `unmark_evictable` as they change.
    """

    def __init__(self) -> None:
        self.id_of_hash: dict[BlockHash, int] = {}
        self.hash_of_id: dict[int, BlockHash] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self.id_of_hash)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def get(self, block_hash: BlockHash) -> int | None:
        return self.id_of_hash.get(block_hash)

    def is_indexed(self, resource_id: int) -> bool:
        return resource_id in self.hash_of_id

    def insert(self, block_hash: BlockHash, resource_id: int) -> bool:
        """Index `resource_id` under `block_hash`; False (and nothing changes) if either is taken."""
        if block_hash in self.id_of_hash or resource_id in self.hash_of_id:
            return False
        self.id_of_hash[block_hash] = resource_id
        self.hash_of_id[resource_id] = block_hash
        return True

    def mark_evictable(self, resource_id: int) -> None:
        """The last reference went away: most recently used end of the LRU."""
        assert resource_id in self.hash_of_id, resource_id
        self.evictable[resource_id] = None
        self.evictable.move_to_end(resource_id)

    def unmark_evictable(self, resource_id: int) -> None:
        self.evictable.pop(resource_id, None)

    def touch(self, resource_id: int) -> None:
        if resource_id in self.evictable:
            self.evictable.move_to_end(resource_id)

    def evict_lru(self, keep: Hashable | None = None) -> int | None:
        """Drop the least recently used evictable entry (never `keep`); returns its id or None."""
        for resource_id in self.evictable:
            if resource_id != keep:
                self.remove(resource_id)
                return resource_id
        return None

    def remove(self, resource_id: int) -> None:
        block_hash = self.hash_of_id.pop(resource_id)
        del self.id_of_hash[block_hash]
        self.evictable.pop(resource_id, None)
