"""pallas_kernels/cpu_native.py: the C++ CPU kernels' build, cache and fallback.

Their numerics are checked against the float64 oracle with the other attention paths in
tests/test_ragged_paged_attention.py (impl "native", float and bit storage, FP8, GQA, window,
soft cap) and, through the engine (the CPU plan's default), against HF in tests/test_engine_hf.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_ragged_paged_attention import make_batch, oracle, run

from pallas_kernels import cpu_native


def test_kernels_build_here():
    """The CI machine has g++: the native path must build, not fall back silently."""
    assert cpu_native.available(), cpu_native._state.get("error")
    assert cpu_native._state["path"].parent == cpu_native.cache_dir()


def test_build_is_cached_and_keyed_by_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path / "a"))
    first = cpu_native._build()
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "a" and cpu_native._build() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp files left behind
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path / "b"))
    assert cpu_native._build().parent == tmp_path / "b"


def test_build_failure_names_the_compiler_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_native, "SOURCE", broken)
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native._build()
    assert not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("reason", ["JAXSERVE_NATIVE=0", "no compiler"])
def test_unavailable_means_the_jnp_decode_pass(reason, monkeypatch):
    """Without the kernels impl="native" is the jnp chunked path: same answers, no error."""
    monkeypatch.setattr(cpu_native, "_state", {})
    if reason == "no compiler":
        monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
        monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", "/nonexistent-never-used")
    else:
        monkeypatch.setenv("JAXSERVE_NATIVE", "0")
    assert not cpu_native.available()
    rng = np.random.default_rng(3)
    batch = make_batch(
        rng,
        [(1, 40), (1, 130), (1, 7)],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        kv_dtype="bf16",
        q_dtype=np.float32,
    )
    # a distinct sm_scale: a trace cached from the kernel path must not be reused
    np.testing.assert_allclose(
        run(batch, sm_scale=0.1234, impl="native"), oracle(batch, sm_scale=0.1234), atol=2e-4, rtol=1e-4
    )


# ---- jaxserve_bf16_matmul: x [M, K] bf16 @ a packed bf16 weight ---------------------------------
MATMUL_SHAPES = [(1, 7, 5), (5, 64, 48), (16, 576, 192), (17, 577, 1537), (40, 130, 33)]


def _bf16(rng, shape, scale=1.0):
    import ml_dtypes

    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


def _check_matmul(call, m, k, n, seed=0):
    """`call(x, wp, n, out_dtype)` against the float64 product of the same bf16 values: float32
    output within float32 accumulation error, bf16 output within one bf16 rounding of it."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (k, n), 0.1)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))  # the sum of |terms|
    wp = cpu_native.pack_bf16_weight(jnp.asarray(w))
    got32 = np.asarray(call(jnp.asarray(x), wp, n, jnp.float32), np.float64)
    assert got32.shape == (m, n)
    assert (np.abs(got32 - ref) <= 1e-5 * bound + 1e-30).all()
    got16 = np.asarray(call(jnp.asarray(x), wp, n, jnp.bfloat16).astype(jnp.float32), np.float64)
    assert (np.abs(got16 - ref) <= 2.0**-8 * np.abs(ref) + 1e-5 * bound).all()
    return got16


@pytest.mark.parametrize("m,k,n", MATMUL_SHAPES)
def test_bf16_matmul_matches_float64(m, k, n):
    """Odd K (the last row pairs with zero), N not a multiple of 16 (masked stores), row tails."""
    import jax

    assert cpu_native.available()
    call = jax.jit(cpu_native.bf16_matmul, static_argnums=(2, 3))
    _check_matmul(call, m, k, n)


def test_bf16_matmul_scalar_loop_matches_float64(tmp_path):
    """The loop a CPU without AVX512-BF16 runs: the same source built with -mno-avx512bf16,
    registered under a name of its own, against the same oracle."""
    import ctypes
    import subprocess

    import jax

    cmd = [
        cpu_native._compiler(),
        *cpu_native.FLAGS,
        "-mno-avx512bf16",
        "-I",
        jax.ffi.include_dir(),
        str(cpu_native.SOURCE),
        "-o",
        str(tmp_path / "scalar.so"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    lib = ctypes.cdll.LoadLibrary(str(tmp_path / "scalar.so"))
    assert lib.JaxserveBf16MatmulSimd() == 0
    jax.ffi.register_ffi_target(
        "jaxserve_bf16_matmul_scalar_test", jax.ffi.pycapsule(lib.JaxserveBf16Matmul), platform="cpu"
    )

    def call(x, wp, n, out_dtype):
        ffi = jax.ffi.ffi_call("jaxserve_bf16_matmul_scalar_test", jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
        return ffi(x, wp, np.array([x.shape[0]], np.int32))

    for m, k, n in MATMUL_SHAPES[:3]:
        _check_matmul(call, m, k, n, seed=1)


@pytest.mark.parametrize("valid", [0, 1, 15, 16, 17, 33, 40, 41, -3])
def test_bf16_matmul_valid_rows(valid):
    """`valid_rows`: rows before it as the float64 product (each row's result does not depend on
    the others), rows from it on exactly zero; out-of-range counts clamp to [0, M]."""
    import jax
    import jax.numpy as jnp

    m, k, n = 40, 130, 33
    full = _check_matmul(jax.jit(cpu_native.bf16_matmul, static_argnums=(2, 3)), m, k, n, seed=5)
    rng = np.random.default_rng(5)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (k, n), 0.1)
    wp = cpu_native.pack_bf16_weight(jnp.asarray(w))
    call = jax.jit(cpu_native.bf16_matmul, static_argnums=(2, 3))
    for out_dtype in (jnp.bfloat16, jnp.float32):
        got = np.asarray(call(jnp.asarray(x), wp, n, out_dtype, jnp.int32(valid)).astype(jnp.float32))
        v = min(max(valid, 0), m)
        if out_dtype == jnp.bfloat16:
            assert (got[:v] == full[:v]).all()  # bit-identical to the full call's rows
        else:
            ref = x.astype(np.float64) @ w.astype(np.float64)
            assert np.allclose(got[:v], ref[:v], rtol=1e-5, atol=1e-5)
        assert (got[v:] == 0).all()


def test_valid_rows_reach_the_native_matmul_through_the_linear_op():
    """`ops.linear(x, w, opts, valid_rows=count)` on a packed bf16 weight, with a traced count
    (the forward pass passes its batch's `ForwardBatch.num_valid_rows`), computes the first `count`
    rows and leaves the rest zeros; without it (a logits head over R rows) every row is computed."""
    import jax
    import jax.numpy as jnp

    from models import ops
    from models.batch import single_sequence_batch
    from models.quantization import packed

    rng = np.random.default_rng(6)
    x, w = jnp.asarray(_bf16(rng, (24, 64))), jnp.asarray(_bf16(rng, (64, 32), 0.1))
    wp = packed(w)
    opts = ops.KernelOptions()

    @jax.jit
    def f(x, batch):
        return ops.linear(x, wp, opts, valid_rows=batch.num_valid_rows), ops.linear(x[:8], wp, opts)

    plain = np.asarray(cpu_native.bf16_matmul(x, wp.p, 32).astype(jnp.float32))
    batch = single_sequence_batch(list(range(10)), page_size=4, pad_to=24)
    assert int(batch.num_valid_rows) == 10
    tokens, head = (np.asarray(a.astype(jnp.float32)) for a in f(x, batch))
    assert (tokens[:10] == plain[:10]).all() and (tokens[10:] == 0).all()
    assert (head == plain[:8]).all()


def test_pack_round_trip_and_leading_axes():
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    w = jnp.asarray(_bf16(rng, (3, 37, 50)))  # stacked layer groups [G, K, N]
    wp = cpu_native.pack_bf16_weight(w)
    assert wp.shape == (3, 4, 19, 32)
    assert (cpu_native.unpack_bf16_weight(wp, 50, 37) == w).all()
    t = jnp.swapaxes(w, -1, -2)
    assert (cpu_native.pack_bf16_weight(t, out_in=True) == wp).all()
    assert (cpu_native.unpack_bf16_weight(wp, 50, 37, out_in=True) == t).all()


def test_qdot_packed_weight_matches_xla_dot():
    """`qdot` on a PackedWeight: the kernel for bf16 rows, the unpacked weight (XLA's dot) for a
    float32 x, both against XLA's dot on the plain weight."""
    import jax
    import jax.numpy as jnp

    from models.quantization import OutInWeight, PackedWeight, packed, qdot

    rng = np.random.default_rng(4)
    w = jnp.asarray(_bf16(rng, (96, 40), 0.1))
    p = packed(w)
    assert isinstance(p, PackedWeight) and p.shape == (96, 40) and packed(p) is p
    assert isinstance(packed(OutInWeight(w.T)), PackedWeight) and (packed(OutInWeight(w.T)).p == p.p).all()
    assert packed(w.astype(jnp.float32)).dtype == jnp.float32  # float32 weights stay as they are
    for x in (jnp.asarray(_bf16(rng, (6, 96))), jnp.asarray(rng.standard_normal((6, 96)), jnp.float32)):
        got = np.asarray(jax.jit(qdot)(x, p).astype(jnp.float32))
        want = np.asarray(qdot(x, w).astype(jnp.float32))
        np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=1e-6)
