"""Static-shape buckets: every step is padded to one of a fixed, precompiled set of sizes.

Token buckets are powers of two from `minimum` up to the limit, and the limit itself is always
a bucket (padding a 16,640-token chunk up to 32,768 wastes half the step). `fine_until` adds
the 1.5x steps (6, 12, 24, ...) up to that size: on CPU a step's cost follows its rows, and a
decode batch of 9-12 sequences padded to 16 rows wasted a quarter of the step. A size above
the largest bucket is a loud `BucketMiss`, never a silent recompile.
"""

from __future__ import annotations

import bisect


class BucketMiss(RuntimeError):
    """A step needed a shape that was not compiled ahead of time."""


def pow2_buckets(limit: int, minimum: int = 16, explicit: tuple[int, ...] | None = None,
                 fine_until: int = 0) -> tuple[int, ...]:
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


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise BucketMiss(f"size {n} exceeds the largest compiled bucket {buckets[-1]} (buckets: {list(buckets)})")
    return buckets[i]
