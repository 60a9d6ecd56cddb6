"""Static-shape buckets: every step is padded to one of a fixed, precompiled set of sizes.

Token buckets are powers of two from `minimum` up to the limit, and the limit itself is always
a bucket (padding a 16,640-token chunk up to 32,768 wastes half the step). A size above the
largest bucket is a loud `BucketMiss`, never a silent recompile.
"""

from __future__ import annotations

import bisect


class BucketMiss(RuntimeError):
    """A step needed a shape that was not compiled ahead of time."""


def pow2_buckets(limit: int, minimum: int = 16, explicit: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Sorted bucket sizes: `explicit` (plus `limit`) when given, else powers of two from `minimum`."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    if explicit:
        sizes = {int(b) for b in explicit if 0 < int(b) <= limit}
    else:
        sizes, b = set(), max(1, min(minimum, limit))
        while b < limit:
            sizes.add(b)
            b *= 2
    sizes.add(limit)
    return tuple(sorted(sizes))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise BucketMiss(f"size {n} exceeds the largest compiled bucket {buckets[-1]} (buckets: {list(buckets)})")
    return buckets[i]
