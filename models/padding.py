"""Rounding rules models/ needs itself, as pure functions (no JAX, no other jaxserve imports).

`runtime/buckets.py` re-exports everything here and owns every other rounding rule; models/
cannot import runtime/, so the few rules both need live here. A size beyond a rule's limit is a
`BucketMiss`, never a silent new shape.
"""

from __future__ import annotations

# Model.logits / Model.greedy pad one sequence's prompt to a power of two of at least this many
# tokens: few shapes, few compiles of the reference paths.
SEQUENCE_PAD_MIN = 16


class BucketMiss(RuntimeError):
    """A size has no bucket: it exceeds the largest compiled (or allowed) size."""


def pow2_bucket(n: int, minimum: int = 1, limit: int | None = None) -> int:
    """0 for n == 0, else the smallest power of two >= n, at least `minimum`.
    BucketMiss when it would exceed `limit`; ValueError for a negative n."""
    if n < 0:
        raise ValueError(f"a bucketed size must be >= 0, got {n}")
    if n == 0:
        return 0
    bucket = max(minimum, 1 << (n - 1).bit_length())
    if limit is not None and bucket > limit:
        raise BucketMiss(f"size {n} needs the power-of-two bucket {bucket}, above the limit {limit}")
    return bucket


def ceil_div(n: int, d: int) -> int:
    """How many `d`-sized units hold `n` (pages for tokens, chunks for rows)."""
    if d < 1:
        raise ValueError(f"a unit size must be >= 1, got {d}")
    return -(-n // d)
