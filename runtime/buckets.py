"""Every rounding rule of the runtime: each step is padded to one of a fixed, precompiled set of sizes.

Token buckets are powers of two from `minimum` up to the limit, and the limit itself is always
a bucket (padding a 16,640-token chunk up to 32,768 wastes half the step). `fine_until` adds
the 1.5x steps (6, 12, 24, ...) up to that size: on CPU a step's cost follows its rows, and a
decode batch of 9-12 sequences padded to 16 rows wasted a quarter of the step. Which minimum and
which fine steps a backend gets is decided by `runtime/steps/execution_plan.py`; the arithmetic is here.

Other rules: the sequence bucket of the sampler (`seq_bucket`), the power-of-two widths of the
sampling metadata's token-id matrices (`penalty_width`, `banned_width`), the page count of a
token count (`pages_for`), and the reference paths' sequence padding (`models/padding.py`,
re-exported here because models/ cannot import runtime/). A size above the largest bucket is a
loud `BucketMiss`, never a silent recompile.
"""

from __future__ import annotations

import bisect

from models.padding import SEQUENCE_PAD_MIN, BucketMiss, ceil_div, pow2_bucket

__all__ = [
    "BANNED_WIDTH_MIN",
    "PENALTY_WIDTH_MIN",
    "SEQUENCE_PAD_MIN",
    "BucketMiss",
    "banned_width",
    "bucket_for",
    "ceil_div",
    "pages_for",
    "penalty_width",
    "pow2_bucket",
    "pow2_buckets",
    "seq_bucket",
]

PENALTY_WIDTH_MIN = 16  # smallest non-zero width of the sampler's output / prompt / logit-bias id matrices
BANNED_WIDTH_MIN = 4  # smallest non-zero width of the banned-token matrix (min_tokens bans a few stop ids)


def pow2_buckets(
    limit: int, minimum: int = 16, explicit: tuple[int, ...] | None = None, fine_until: int = 0
) -> tuple[int, ...]:
    """Sorted bucket sizes: `explicit` (plus `limit`) when given, else powers of two from `minimum`
    plus, up to `fine_until`, the 1.5x sizes between them."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    if explicit:
        sizes = {int(b) for b in explicit if 0 < int(b) <= limit}
    else:
        sizes, b = set(), max(1, min(minimum, limit))
        while b < limit:
            sizes.add(b)
            if b % 2 == 0 and b * 3 // 2 <= min(fine_until, limit - 1):
                sizes.add(b * 3 // 2)
            b *= 2
    sizes.add(limit)
    return tuple(sorted(sizes))


def bucket_for(n: int, buckets: tuple[int, ...], what: str = "size") -> int:
    """Smallest bucket >= n; BucketMiss naming `what` beyond the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise BucketMiss(f"{what} {n} exceeds the largest compiled bucket {buckets[-1]} (buckets: {list(buckets)})")
    return buckets[i]


def seq_bucket(num_seqs: int, seq_buckets: tuple[int, ...]) -> int:
    """Rows of the sampler for a step sampling `num_seqs` sequences."""
    return bucket_for(num_seqs, seq_buckets, what="sequence count")


def penalty_width(n: int, minimum: int = PENALTY_WIDTH_MIN) -> int:
    """Width of a token-id matrix holding at most `n` ids per row: 0 for 0, else a power of two >= minimum."""
    return pow2_bucket(n, minimum)


def banned_width(n: int) -> int:
    """Width of the banned-token matrix for at most `n` banned ids per row."""
    return pow2_bucket(n, BANNED_WIDTH_MIN)


def pages_for(num_tokens: int, page_size: int) -> int:
    """KV pages that hold `num_tokens` tokens."""
    return ceil_div(num_tokens, page_size)
