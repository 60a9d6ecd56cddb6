"""Every rounding rule (runtime/buckets.py, models/padding.py): a table of inputs -> buckets, and
a BucketMiss (or a precise ValueError for nonsense sizes) from every entry point. The expected
values are written out by hand."""

import pytest

from models.padding import SEQUENCE_PAD_MIN
from runtime import buckets as B
from runtime.buckets import BucketMiss


def test_pow2_buckets_include_limit():
    assert B.pow2_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert B.pow2_buckets(600) == (16, 32, 64, 128, 256, 512, 600)
    assert B.pow2_buckets(8, minimum=16) == (8,)
    assert B.pow2_buckets(64, minimum=1) == (1, 2, 4, 8, 16, 32, 64)
    assert B.pow2_buckets(100, explicit=(48, 16, 200)) == (16, 48, 100)
    assert B.pow2_buckets(256, minimum=4, fine_until=16) == (4, 6, 8, 12, 16, 32, 64, 128, 256)
    assert B.pow2_buckets(16, minimum=4, fine_until=64) == (4, 6, 8, 12, 16)
    assert B.pow2_buckets(512, fine_until=16) == B.pow2_buckets(512)  # nothing below the minimum
    with pytest.raises(ValueError, match="bucket limit must be >= 1, got 0"):
        B.pow2_buckets(0)


# (rule, argument, expected bucket)
TABLE = [
    (lambda n: B.bucket_for(n, (16, 32, 64, 128, 256, 512, 600)), 1, 16),
    (lambda n: B.bucket_for(n, (16, 32, 64, 128, 256, 512, 600)), 17, 32),
    (lambda n: B.bucket_for(n, (16, 32, 64, 128, 256, 512, 600)), 513, 600),
    (lambda n: B.bucket_for(n, (4, 6, 8, 12, 16)), 5, 6),
    (lambda n: B.bucket_for(n, (4, 6, 8, 12, 16)), 9, 12),
    (lambda n: B.seq_bucket(n, (8, 16, 32, 64)), 1, 8),
    (lambda n: B.seq_bucket(n, (8, 16, 32, 64)), 33, 64),
    (B.penalty_width, 0, 0),
    (B.penalty_width, 1, 16),
    (B.penalty_width, 16, 16),
    (B.penalty_width, 17, 32),
    (B.banned_width, 0, 0),
    (B.banned_width, 1, 4),
    (B.banned_width, 5, 8),
    (lambda n: B.pow2_bucket(n, SEQUENCE_PAD_MIN), 1, 16),
    (lambda n: B.pow2_bucket(n, SEQUENCE_PAD_MIN), 33, 64),
    (lambda n: B.pages_for(n, 16), 0, 0),
    (lambda n: B.pages_for(n, 16), 1, 1),
    (lambda n: B.pages_for(n, 16), 16, 1),
    (lambda n: B.pages_for(n, 16), 2049, 129),
]


@pytest.mark.parametrize("rule,n,expected", TABLE)
def test_rounding_table(rule, n, expected):
    assert rule(n) == expected


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: B.bucket_for(601, (16, 512, 600)), "size 601 exceeds the largest compiled bucket 600"),
        (lambda: B.bucket_for(9, (4, 8), what="token count"), "token count 9 exceeds the largest compiled bucket 8"),
        (lambda: B.seq_bucket(65, (8, 16, 32, 64)), "sequence count 65 exceeds the largest compiled bucket 64"),
        (lambda: B.pow2_bucket(33, 16, limit=32), "size 33 needs the power-of-two bucket 64, above the limit 32"),
    ],
)
def test_every_entry_point_misses_with_bucket_miss(call, message):
    with pytest.raises(BucketMiss, match=message):
        call()


def test_nonsense_sizes_are_value_errors():
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        B.penalty_width(-1)
    with pytest.raises(ValueError, match="unit size must be >= 1, got 0"):
        B.pages_for(5, 0)


def test_the_sampling_metadata_and_engine_use_these_rules():
    """No second copy of a rule: the sampler's widths and the engine's sequence bucket are these."""
    import runtime.engine.construction as construction
    import runtime.engine.step_inputs as step_inputs
    import runtime.steps.sampling_metadata as sm

    assert sm.pow2_bucket is B.penalty_width and sm.banned_width is B.banned_width
    assert step_inputs.seq_bucket is B.seq_bucket and construction.pages_for is B.pages_for
