"""Native CPU kernels (C++ through XLA's typed FFI) for the steps XLA:CPU runs badly.

    from pallas_kernels import cpu_native
    cpu_native.available()                      # builds csrc/cpu_kernels.cc once, then cached
    out = cpu_native.ragged_paged_attention(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=...)

Why: on the CPU test bench the decode pass of ragged paged attention (one query token per
sequence against its pages) is a batch of [G, D] x [D, L] dots, gathers and selects that
XLA:CPU runs at ~10 GFLOP/s: ~0.9 ms a layer for 16 sequences of ~200 tokens, a third of a
SmolLM2-135M bf16 decode step. vLLM's CPU backend runs a C++ kernel there; so do we. TPU and
GPU never load this: they run the Pallas kernels.

Build: on first use `g++ -O3 -march=native` compiles `csrc/cpu_kernels.cc` against
`jax.ffi.include_dir()` into a cache directory (`$JAXSERVE_NATIVE_CACHE`, else
`$XDG_CACHE_HOME/jaxserve/native`, else `~/.cache/jaxserve/native`), keyed by the source, the
compiler, the flags, jaxlib and the CPU's flags, and written atomically, so concurrent processes
(multi-host tests, data-parallel ranks) share one build safely. `pip install` compiles nothing;
with no C++ compiler, or `JAXSERVE_NATIVE=0`, `available()` is False and every caller takes its
pure-jnp path (the same function the kernel is tested against), with one warning.

Each kernel has a reference it is tested against: `ragged_paged_attention` the float64
oracle and `ragged_paged_attention(impl="reference")` (tests/test_ragged_paged_attention.py),
`bf16_matmul` the float64 product (tests/test_cpu_native.py),
`gdn_recurrent` `gated_delta_rule(impl="reference")` (tests/test_gdn.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs import environment
from pallas_kernels.kv_cache import KVPages, is_fp8

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cc"
# No -ffinite-math-only: masked scores and empty rows must keep IEEE semantics. Reassociation
# lets the dot products vectorize.
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-freciprocal-math",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
TARGETS = {
    "jaxserve_ragged_attention": "JaxserveRaggedAttention",
    "jaxserve_gdn_recurrent": "JaxserveGdnRecurrent",
    "jaxserve_bf16_matmul": "JaxserveBf16Matmul",
}
KV_FORMATS = {"float32": 0, "bfloat16": 1}  # FP8 pages: 2, through a 256-entry table
_NO_SCALE = np.ones((1, 1), np.float32)
_NO_SINKS = np.zeros((1,), np.float32)
# Under jax.vmap (attention data parallelism maps the forward over ranks) a call per rank.
VMAP_METHOD = "sequential"

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, once decided; "path", "error"


def cache_dir() -> Path:
    if environment.native_cache_dir():
        return Path(environment.native_cache_dir())
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxserve" / "native"


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    """Compiles the kernels (or finds the cached build); raises RuntimeError on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), cxx, version, " ".join(FLAGS), jax.__version__, platform.machine(), _cpu_flags()]
        ).encode()
    ).hexdigest()[:20]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def available() -> bool:
    """Whether the native kernels are built and registered (builds them on the first call)."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if not environment.native_kernels_enabled():
            _state.update(ok=False, error="JAXSERVE_NATIVE=0")
            return False
        try:
            path = _build()
            lib = ctypes.cdll.LoadLibrary(str(path))
            for name, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            lib.JaxserveBf16MatmulSimd.restype = ctypes.c_int32
            _state.update(ok=True, path=path, lib=lib, matmul_simd=bool(lib.JaxserveBf16MatmulSimd()))
        except Exception as e:
            log.warning("native CPU kernels unavailable, using the jnp paths: %s", e)
            _state.update(ok=False, error=str(e))
        return _state["ok"]


def _fp8_table(dtype) -> np.ndarray:
    """The 256 values of an FP8 dtype's bytes, as float32 (NaN bytes stay NaN)."""
    return np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype)).astype(np.float32)


def ragged_paged_attention(
    q: jax.Array,
    kv: KVPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention (`pallas_kernels.ragged_paged_attention`'s arguments and semantics)
    in C++: decode tokens and prefill chunks of one batch in one call.

    q [T, Hq, D] (any float dtype), kv pages [P, Hkv, ps, D] (float32, bf16 or FP8; float or
    bit storage), kv_lens [S], block_tables [S, MB], cu_q_lens [S+1] int32, num_seqs [] or [1],
    sinks None or [Hq] f32 (one extra softmax logit per query head).
    Returns [T, Hq, D] float32, zeros for tokens no live sequence owns. Call only when `available()`.
    """
    T, Hq, D = q.shape
    dtype = jnp.dtype(kv.dtype)
    if is_fp8(dtype):
        kv_format, table = 2, _fp8_table(dtype)
    else:
        kv_format, table = KV_FORMATS[dtype.name], np.zeros((1,), np.float32)
    scaled = kv.k_scale is not None
    k_scale = kv.k_scale if scaled else _NO_SCALE
    v_scale = kv.v_scale if scaled else _NO_SCALE
    call = jax.ffi.ffi_call(
        "jaxserve_ragged_attention", jax.ShapeDtypeStruct((T, Hq, D), jnp.float32), vmap_method=VMAP_METHOD
    )
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    return call(
        q.astype(jnp.float32),
        kv.k,
        kv.v,
        k_scale,
        v_scale,
        jnp.asarray(table),
        i32(block_tables),
        i32(kv_lens),
        i32(cu_q_lens),
        jnp.reshape(i32(num_seqs), (1,)),
        _NO_SINKS if sinks is None else sinks.astype(jnp.float32),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int32(sliding_window or 0),
        kv_format=np.int32(kv_format),
        scaled=np.int32(scaled),
        has_sinks=np.int32(sinks is not None),
    )


def gdn_recurrent(q, k, v, g, beta, state, cu_q_lens, state_slot_ids, has_initial_state, rows):
    """The gated delta rule token by token for the sequences with `rows[s]` set, from and back to
    their state slots (updated in place when the engine donates the pool).

    Arguments as `pallas_kernels.gdn.gated_delta_rule` (q, k [T, Hk, K], v [T, H, V], g / beta
    [T, H], state [N, H, K, V] float32, cu_q_lens [S+1], state_slot_ids [S], has_initial_state
    [S]) plus rows [S] bool. Returns (o [T, H, V] float32, zero outside the selected rows'
    tokens; the state pool). Call only when `available()`.
    """
    f32 = lambda x: x.astype(jnp.float32)
    i32 = lambda x: x.astype(jnp.int32)
    call = jax.ffi.ffi_call(
        "jaxserve_gdn_recurrent",
        (jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={5: 1},
        vmap_method=VMAP_METHOD,
    )
    return call(
        f32(q),
        f32(k),
        f32(v),
        f32(g),
        f32(beta),
        state,
        i32(cu_q_lens),
        i32(state_slot_ids),
        i32(has_initial_state),
        i32(rows),
    )


def matmul_simd() -> bool:
    """Whether `bf16_matmul` runs its AVX512-BF16 loop here (else a scalar float32 loop: correct,
    slow; the CPU plan then keeps XLA's dot). Builds the kernels on the first call."""
    return available() and _state.get("matmul_simd", False)


def pack_bf16_weight(w: jax.Array, *, out_in: bool = False) -> jax.Array:
    """A bf16 weight [..., K, N] (or [..., N, K] with `out_in`) in `bf16_matmul`'s packed layout
    [..., ceil(N/16), ceil(K/2), 32]: 16 output columns x 2 input rows per 64-byte vector, zero
    padded. A new array; done once when the weights are loaded (Model.hold_packed)."""
    t = w if out_in else jnp.swapaxes(w, -1, -2)  # [..., N, K]
    *lead, n, k = t.shape
    t = jnp.pad(t.astype(jnp.bfloat16), [(0, 0)] * len(lead) + [(0, -n % 16), (0, k % 2)])
    t = t.reshape(*lead, (n + 15) // 16, 16, (k + 1) // 2, 2)
    return jnp.swapaxes(t, -3, -2).reshape(*lead, (n + 15) // 16, (k + 1) // 2, 32)


def unpack_bf16_weight(wp: jax.Array, n: int, k: int, *, out_in: bool = False) -> jax.Array:
    """`pack_bf16_weight`'s inverse: [..., NB, KP, 32] -> [..., K, N] (or [..., N, K] with `out_in`)."""
    *lead, nb, kp, _ = wp.shape
    t = jnp.swapaxes(wp.reshape(*lead, nb, kp, 16, 2), -3, -2).reshape(*lead, nb * 16, kp * 2)[..., :n, :k]
    return t if out_in else jnp.swapaxes(t, -1, -2)


def bf16_matmul(x: jax.Array, wp: jax.Array, n: int, out_dtype=jnp.bfloat16, valid_rows=None) -> jax.Array:
    """x [..., K] bf16 @ the packed weight `wp` [NB, KP, 32] -> [..., n] in `out_dtype` (bf16:
    the float32 accumulation rounded to nearest even, as XLA's bf16 dot with preferred float32
    then a convert; or float32). Rows of x (flattened) from `valid_rows` on (an int32 scalar,
    traced or not; default: all rows) come out as zeros without being computed: a 150-token step
    compiled as 256 spends matmul time on 150 (the forward pass passes its batch's
    `ForwardBatch.num_valid_rows`). Call only when `available()`."""
    *lead, k = x.shape
    rows = int(np.prod(lead)) if lead else 1
    if valid_rows is None:
        valid_rows = rows
    call = jax.ffi.ffi_call(
        "jaxserve_bf16_matmul", jax.ShapeDtypeStruct((rows, n), jnp.dtype(out_dtype)), vmap_method=VMAP_METHOD
    )
    valid = jnp.asarray(valid_rows, jnp.int32).reshape(1)
    return call(x.reshape(rows, k).astype(jnp.bfloat16), wp, valid).reshape(*lead, n)
