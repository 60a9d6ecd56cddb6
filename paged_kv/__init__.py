"""jaxserve paged_kv: device-free bookkeeping for KV pages (two pools with window-aware paging),
prefix caching and GDN state slots."""

from paged_kv.cache_manager import Admission, CacheManager, PrefixHit, SequenceAllocation
from paged_kv.checkpoint_policy import CheckpointPolicy, num_checkpoint_slots
from paged_kv.page_pool import NULL_PAGE, PagePool
from paged_kv.prefix_cache import BlockHash, BlockIndex, hash_block, hash_full_pages
from paged_kv.state_slots import NULL_SLOT, StateSlotPool
from paged_kv.window_pages import WindowPages, window_pages_per_sequence, window_pool_pages

__all__ = [
    "NULL_PAGE",
    "NULL_SLOT",
    "Admission",
    "BlockHash",
    "BlockIndex",
    "CacheManager",
    "CheckpointPolicy",
    "PagePool",
    "PrefixHit",
    "SequenceAllocation",
    "StateSlotPool",
    "WindowPages",
    "hash_block",
    "hash_full_pages",
    "num_checkpoint_slots",
    "window_pages_per_sequence",
    "window_pool_pages",
]
