"""P/D with window-aware paging: which window-layer pages travel, and where they land.

A prefill side that pages its sliding-window layers apart (paged_kv/window_pages.py) holds, after
K tokens, only the window blocks from `first_live_block(K)` up: it ships those for the window
layers (the descriptor's `"window": {"first_block": f, "num_pages": nw}`, those layers' arrays
`[G*nw, Hkv, ps, D]`, blocks f .. f+nw-1 padded) and every block of the full layers. A decode side
with window paging writes the blocks its own window table holds (its admission gave the blocks below
its window no page: `CacheManager.allocate(num_external=K)`); one without window paging needs every
block, so a descriptor whose window starts above block 0 is refused (TransferError: by default the
request is prefilled locally). Without window paging on the prefill side nothing changes: every
block of every layer travels, and a window-paged decode side drops the blocks below its window.
Plain numpy.
"""

from __future__ import annotations

import numpy as np

from runtime.kv_transfer.base import TransferError


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def window_layers(cfg, num_positions: int, paged: bool) -> tuple[bool, ...]:
    """Per position j of the layer pattern: whether its pages live in the window pool."""
    return tuple(paged and cfg.sliding_window(j) is not None for j in range(num_positions))


def first_window_block(cfg, num_tokens: int, page_size: int) -> int:
    """The lowest block a query at position >= num_tokens sees in any window layer (as
    `WindowPages.first_live_block` with the engine's window, the largest)."""
    window = max(w for j in range(cfg.num_layers) if (w := cfg.sliding_window(j)) is not None)
    return max(0, num_tokens - window + 1) // page_size


def window_descriptor(first_block: int, num_blocks: int) -> dict:
    """The descriptor's `window` entry for blocks first_block .. num_blocks - 1."""
    return {"first_block": first_block, "num_pages": _pow2(num_blocks - first_block)}


def window_pages_of(desc: dict) -> int:
    """How many pages a window layer's arrays carry (all of them without a `window` entry)."""
    window = desc.get("window")
    return desc["num_pages"] if window is None else window["num_pages"]


def check_window(desc: dict, cfg, paged: bool) -> None:
    """TransferError unless the descriptor's `window` entry is well formed, covers every key a
    query at position >= num_tokens sees, and this side (`paged`: window paging on) can use it."""
    window = desc.get("window")
    if window is None:
        return
    num_tokens, page_size = desc["num_tokens"], desc["page_size"]
    num_blocks = -(-num_tokens // page_size)
    if not isinstance(window, dict) or set(window) != {"first_block", "num_pages"}:
        raise TransferError(f"descriptor window {str(window)[:200]} must be {{first_block: int, num_pages: int}}")
    first, pages = window["first_block"], window["num_pages"]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (first, pages)):
        raise TransferError(f"descriptor window {window!r} must be {{first_block: int, num_pages: int}}")
    if not 0 <= first < max(num_blocks, 1) or pages != _pow2(num_blocks - first):
        raise TransferError(f"descriptor window {window!r} does not fit {num_tokens} tokens in {page_size}-token pages")
    if all(cfg.sliding_window(j) is None for j in range(cfg.num_layers)):
        raise TransferError("the descriptor carries window pages; this model has no sliding-window layers")
    if first > first_window_block(cfg, num_tokens, page_size):
        raise TransferError(
            f"descriptor window starts at block {first}: keys this model's windows still see are missing"
        )
    if first > 0 and not paged:
        raise TransferError(
            "the prefill side sent only the live window's pages of its sliding-window layers; this side keeps "
            "full-length KV there (set cache.window_paging the same on both sides)"
        )


def window_mappings(
    desc: dict, window_block_table, *, page_size: int, num_window_pages: int, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where the window layers' sent pages land in this side's window pool: (page_mapping [G*nw]
    for a verbatim copy, slot_mapping [G*nw*src_ps] token by token); out of range / -1: dropped
    (padding, and blocks below this side's window, whose table entry is the null page)."""
    window = desc.get("window") or {"first_block": 0}
    first, nw, src_ps = window["first_block"], window_pages_of(desc), desc["page_size"]
    K, G, P = desc["num_tokens"], num_groups, num_window_pages
    table = np.asarray(list(window_block_table) + [0], np.int64)
    blocks = first + np.arange(nw)  # the sent blocks (same page size: this side's blocks too)
    own = np.where(blocks * src_ps < K, table[np.minimum(blocks, len(table) - 1)], 0)
    own = np.where(own > 0, own, P * G)
    page_mapping = np.where(own[None] < P * G, (np.arange(G) * P)[:, None] + own[None], P * G)
    positions = first * src_ps + np.arange(nw * src_ps)  # the sent tokens
    page = table[np.minimum(positions // page_size, len(table) - 1)]
    live = (positions < K) & (page > 0)
    local = page * page_size + positions % page_size
    slots = np.where(live[None], (np.arange(G) * P * page_size)[:, None] + local[None], -1)
    return page_mapping.astype(np.int32).reshape(-1), slots.astype(np.int32).reshape(-1)
