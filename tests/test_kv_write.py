"""write_kv: scatter round trip, FP8 scale rules (fresh at offset 0, only grow, requantize),
clipping, and no recompilation when scales change. Checked against a numpy model of the pages.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.kv_cache import KVPages, dequantize, quantize
from pallas_kernels.kv_write import write_kv

P, HKV, PS, D = 9, 2, 8, 16
FP8 = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 3, 2.0**-9), "float8_e5m2": (ml_dtypes.float8_e5m2, 2, 2.0**-16)}


class PageModel:
    """float64 truth of what each slot should hold, and each page's expected FP8 scale."""

    def __init__(self, fmax=None):
        self.values = {"k": np.zeros((P, HKV, PS, D)), "v": np.zeros((P, HKV, PS, D))}
        self.amax = {"k": np.zeros((P, HKV)), "v": np.zeros((P, HKV))}
        self.filled = np.zeros((P, PS), bool)
        self.fmax = fmax

    def write(self, k, v, slots):
        restart = {s // PS for s in slots if s >= 0 and s % PS == 0}
        for page in restart:
            self.filled[page] = False
            for name in "kv":
                self.amax[name][page] = 0.0
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            page, offset = divmod(slot, PS)
            self.filled[page, offset] = True
            for name, new in (("k", k), ("v", v)):
                self.values[name][page, :, offset] = new[t]
                self.amax[name][page] = np.maximum(self.amax[name][page], np.abs(new[t]).max(-1))

    def expected_scale(self, name):
        return self.amax[name] / self.fmax


def random_tokens(rng, n, spread):
    k = rng.normal(size=(n, HKV, D)) * spread
    v = rng.normal(size=(n, HKV, D)) * spread * 0.5
    return k.astype(np.float32), v.astype(np.float32)


def step_slots(rng):
    """Slot mappings of a few steps: a 2-page sequence grown by prefill chunks and decodes,
    a second sequence, padding (-1), several tokens per page per step, page reuse at offset 0."""
    seq_a = [3 * PS + i for i in range(PS)] + [7 * PS + i for i in range(PS)]
    seq_b = [5 * PS + i for i in range(PS)]
    return [
        seq_a[:5] + seq_b[:3] + [-1, -1],  # prefill chunks, padding
        seq_a[5:11] + [-1],  # chunk crossing into page 7
        [seq_a[11], seq_b[3], -1],  # decodes
        [seq_a[12], seq_b[4]],
        [5 * PS + 0, 5 * PS + 1, -1],  # page 5 freed and reused: restart at 0
        [seq_a[13], 5 * PS + 2],
    ]


# (whole_pages, max_seqs): "scatter" is the CPU / GPU write, "whole-pages" the TPU one; there
# max_seqs=0 bounds the pages gathered at once below what a step writes, so the writes go in
# several rounds (none may be dropped).
WRITE_MODES = {"scatter": (False, None), "whole-pages": (True, None), "whole-pages-in-rounds": (True, 0)}


# token-minor: pages stored [P, Hkv, D, ps] (the TPU kernel's layout for head_dim < 128)
LAYOUTS = pytest.mark.parametrize("token_minor", [False, True], ids=["head-major", "token-minor"])


def _check_layout(kv, token_minor):
    assert kv.token_minor == token_minor and (kv.page_size, kv.head_dim) == (PS, D)
    assert kv.k.shape == ((P, HKV, D, PS) if token_minor else (P, HKV, PS, D))


@LAYOUTS
@pytest.mark.parametrize("mode", sorted(WRITE_MODES))
@pytest.mark.parametrize("bit_storage", [False, True], ids=["float-storage", "bit-storage"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_write_round_trip(dtype, bit_storage, mode, token_minor):
    whole_pages, max_seqs = WRITE_MODES[mode]
    rng = np.random.default_rng(0)
    kv = KVPages.create(P, PS, HKV, D, dtype, bit_storage=bit_storage, token_minor=token_minor)
    stored = jnp.uint16 if bit_storage and dtype == "bfloat16" else jnp.dtype(dtype)
    model = PageModel()
    for slots in step_slots(rng):
        k, v = random_tokens(rng, len(slots), 3.0)
        slots_ = jnp.asarray(slots, jnp.int32)
        kv = write_kv(kv, jnp.asarray(k), jnp.asarray(v), slots_, whole_pages=whole_pages, max_seqs=max_seqs)
        model.write(k.astype(jnp.dtype(dtype)).astype(np.float64), v.astype(jnp.dtype(dtype)).astype(np.float64), slots)
    assert kv.k_scale is None and kv.dtype == jnp.dtype(dtype) and kv.k.dtype == stored
    _check_layout(kv, token_minor)
    got_k, got_v = (np.asarray(x, np.float64) for x in kv.dequantized())
    # Untouched slots stay zero; written slots hold exactly what was written (in dtype).
    np.testing.assert_array_equal(got_k, model.values["k"])
    np.testing.assert_array_equal(got_v, model.values["v"])


@LAYOUTS
@pytest.mark.parametrize("mode", sorted(WRITE_MODES))
@pytest.mark.parametrize("bit_storage", [False, True], ids=["float-storage", "bit-storage"])
@pytest.mark.parametrize("dtype", list(FP8))
def test_fp8_write_round_trip_and_scales(dtype, bit_storage, mode, token_minor):
    whole_pages, max_seqs = WRITE_MODES[mode]
    storage, mantissa_bits, min_subnormal = FP8[dtype]
    fmax = float(ml_dtypes.finfo(storage).max)
    rng = np.random.default_rng(1)
    kv = KVPages.create(P, PS, HKV, D, dtype, bit_storage=bit_storage, token_minor=token_minor)
    assert kv.k.dtype == (jnp.uint8 if bit_storage else jnp.dtype(dtype))
    model = PageModel(fmax)
    previous_scale = np.asarray(kv.k_scale)
    for step, slots in enumerate(step_slots(rng)):
        # Growing magnitudes force scale growth and requantization of earlier entries.
        k, v = random_tokens(rng, len(slots), 2.0**step)
        slots_ = jnp.asarray(slots, jnp.int32)
        kv = write_kv(kv, jnp.asarray(k), jnp.asarray(v), slots_, whole_pages=whole_pages, max_seqs=max_seqs)
        model.write(k.astype(np.float64), v.astype(np.float64), slots)
        for name, scale in (("k", kv.k_scale), ("v", kv.v_scale)):
            scale = np.asarray(scale)
            live = model.filled.any(axis=1)
            np.testing.assert_allclose(scale[live], model.expected_scale(name)[live], rtol=1e-6)
        # Scales never shrink while a page lives (page 5 restarts at step 4).
        restarted = {s // PS for s in slots if s >= 0 and s % PS == 0}
        keep = np.array([p not in restarted for p in range(P)])
        assert (np.asarray(kv.k_scale)[keep] >= previous_scale[keep]).all()
        previous_scale = np.asarray(kv.k_scale)

    _check_layout(kv, token_minor)
    got = dict(zip("kv", (np.asarray(x, np.float64) for x in kv.dequantized())))
    assert all(np.isfinite(g).all() for g in got.values())
    filled = model.filled[:, None, :, None]  # [P, 1, ps, 1]
    half_ulp = 2.0 ** -(mantissa_bits + 1)
    for name in "kv":
        want = model.values[name]
        scale = model.expected_scale(name)[:, :, None, None]
        # Each of up to 3 re-roundings (write, requantizations) adds half an ulp.
        bound = 3 * half_ulp * np.abs(want) + 3 * scale * min_subnormal
        error = np.where(filled, np.abs(got[name] - want) - bound, 0.0)
        assert (error <= 1e-6).all(), f"{name}: worst excess {error.max()}"


def test_offset_zero_resets_scale():
    kv = KVPages.create(P, PS, HKV, D, "float8_e4m3fn")
    big = jnp.full((2, HKV, D), 1000.0)
    kv = write_kv(kv, big, big, jnp.asarray([2 * PS, 2 * PS + 1], jnp.int32))
    np.testing.assert_allclose(np.asarray(kv.k_scale[2]), 1000.0 / 448.0, rtol=1e-6)
    small = jnp.full((1, HKV, D), 0.5)
    kv = write_kv(kv, small, small, jnp.asarray([2 * PS], jnp.int32))
    np.testing.assert_allclose(np.asarray(kv.k_scale[2]), 0.5 / 448.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.dequantized()[0][2, :, 0]), 0.5, rtol=1e-6)


def test_clip_prevents_nan():
    x = jnp.asarray([500.0, -1000.0, 1e6, 3.0])
    q = quantize(x, jnp.float32(1.0), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(dequantize(q, None)), [448.0, -448.0, 448.0, 3.0])
    q = quantize(x, jnp.float32(1.0), jnp.float8_e5m2)
    assert np.isfinite(np.asarray(dequantize(q, None))).all()
    # Through write_kv: a page whose scale stays small while a later token is huge.
    kv = KVPages.create(P, PS, HKV, D, "float8_e4m3fn")
    tokens = jnp.asarray(np.linspace(-5000, 5000, 2 * HKV * D, dtype=np.float32).reshape(2, HKV, D))
    kv = write_kv(kv, tokens, tokens, jnp.asarray([PS, PS + 1], jnp.int32))
    got = np.asarray(kv.dequantized()[0][1, :, :2].transpose(1, 0, 2))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(tokens), rtol=0.07, atol=5000 / 448 * 2**-9)


def test_new_scales_do_not_recompile():
    kv = KVPages.create(P, PS, HKV, D, "float8_e5m2")
    rng = np.random.default_rng(3)
    compiled = []
    for step in range(3):
        k, v = random_tokens(rng, 4, 10.0**step)
        kv = write_kv(
            kv,
            jnp.asarray(k),
            jnp.asarray(v),
            jnp.asarray([PS * 2 + step, PS * 4 + step, -1, PS * 6 + step], jnp.int32),
        )
        compiled.append(write_kv._cache_size())
    assert compiled[0] == compiled[1] == compiled[2]
    assert float(kv.k_scale[2, 0]) > 10.0 / 57344.0  # the scales did change


def test_bytes_per_token_and_validation():
    assert KVPages.create(4, 16, 2, 128, "bfloat16").bytes_per_token() == 2 * 2 * 128 * 2
    assert KVPages.create(4, 16, 2, 128, "float8_e4m3fn").bytes_per_token() == 2 * 2 * 128 + 1
    with pytest.raises(ValueError):
        KVPages.create(4, 16, 2, 128, "int8")
    kv = KVPages.create(P, PS, HKV, D, "bfloat16")
    with pytest.raises(ValueError):
        write_kv(kv, jnp.zeros((2, HKV + 1, D)), jnp.zeros((2, HKV + 1, D)), jnp.zeros(2, jnp.int32))
