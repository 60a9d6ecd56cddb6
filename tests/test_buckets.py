import pytest

from runtime.buckets import BucketMiss, bucket_for, pow2_buckets


def test_pow2_buckets_include_limit():
    assert pow2_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert pow2_buckets(600) == (16, 32, 64, 128, 256, 512, 600)
    assert pow2_buckets(8, minimum=16) == (8,)
    assert pow2_buckets(64, minimum=1) == (1, 2, 4, 8, 16, 32, 64)
    assert pow2_buckets(100, explicit=(48, 16, 200)) == (16, 48, 100)
    assert pow2_buckets(256, minimum=4, fine_until=16) == (4, 6, 8, 12, 16, 32, 64, 128, 256)
    assert pow2_buckets(16, minimum=4, fine_until=64) == (4, 6, 8, 12, 16)
    assert pow2_buckets(512, fine_until=16) == pow2_buckets(512)  # nothing below the minimum


def test_bucket_for_rounds_up_and_misses_loudly():
    b = pow2_buckets(600)
    assert [bucket_for(n, b) for n in (1, 16, 17, 511, 512, 513, 600)] == [16, 16, 32, 512, 512, 600, 600]
    with pytest.raises(BucketMiss, match="601 exceeds the largest compiled bucket 600"):
        bucket_for(601, b)
