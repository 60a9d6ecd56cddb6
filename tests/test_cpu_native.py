"""pallas_kernels/cpu_native.py: the C++ CPU kernels' build, cache and fallback.

Their numerics are checked against the float64 oracle with the other attention paths in
tests/test_ragged_paged_attention.py (impl "native", float and bit storage, FP8, GQA, window,
soft cap) and, through the engine (the CPU plan's default), against HF in tests/test_engine_hf.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import cpu_native
from test_ragged_paged_attention import make_batch, oracle, run


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
    batch = make_batch(rng, [(1, 40), (1, 130), (1, 7)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16, kv_dtype="bf16", q_dtype=np.float32)
    # a distinct sm_scale: a trace cached from the kernel path must not be reused
    np.testing.assert_allclose(run(batch, sm_scale=0.1234, impl="native"), oracle(batch, sm_scale=0.1234),
                               atol=2e-4, rtol=1e-4)
