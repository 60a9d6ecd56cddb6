"""pallas_kernels/quantized_matmul.py: the TPU and GPU kernels against the jnp reference.

On CPU the kernels run in interpret mode over awkward shapes (M not a multiple of the block,
N padded, several K blocks, every code type); the TPU kernel is compiled by the real Mosaic
compiler for v5e / v6e ahead of time (tests/test_kernels_tpu_aot.py's method) and the GPU
kernel lowered for CUDA (Triton), as the attention and GDN kernels are.
"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.quantization import quantize_weight
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference

# (scheme, group): int8 / fp8 per channel, int8 groups (GGUF Q8_0), int4 symmetric and with offsets
CODES = [("int8", 0), ("fp8", 0), ("int8", 32), ("int4-sym", 32), ("int4-sym", 64), ("int4-zp", 32), ("int4-zp", 128)]


def _codes(scheme, group, k, n, seed=0):
    w = np.random.default_rng(seed).normal(size=(k, n)).astype(np.float32) * 0.05
    if scheme == "int8" and group:  # Q8_0-style groups of int8
        scale = np.abs(w.reshape(k // group, group, n)).max(1) / 127
        q = np.clip(np.round(w / np.repeat(scale, group, 0)), -127, 127).astype(np.int8)
        return q, scale.astype(np.float32), None, 8
    qw = quantize_weight(w, scheme, group_size=group or 32)
    return qw.q, qw.scale, qw.offset, qw.bits


def _args(scheme, group, m, k, n, dtype=np.float32):
    q, scale, offset, bits = _codes(scheme, group, k, n)
    x = np.random.default_rng(1).normal(size=(m, k)).astype(dtype)
    return (jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), None if offset is None else jnp.asarray(offset)), bits


@pytest.mark.parametrize("scheme,group", CODES)
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_matches_reference_interpret(scheme, group, impl):
    m, k, n = 19, 256, 200  # M and N awkward (padded to the blocks); K two blocks of 128
    block_k = 128
    if impl == "pallas_gpu" and not group:  # the per-channel GPU loop: K three steps of 64
        k, block_k = 192, 64
    args, bits = _args(scheme, group, m, k, n)
    ref = quantized_matmul_reference(*args, bits=bits, group_size=group)
    got = quantized_matmul(
        *args, bits=bits, group_size=group, impl=impl, interpret=True, block_k=block_k, block_n=128, block_m=16
    )
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_bf16_activations_interpret():
    args, bits = _args("int4-zp", 64, 8, 512, 256)
    args = (args[0].astype(jnp.bfloat16),) + args[1:]
    ref = quantized_matmul_reference(*args, bits=bits, group_size=64)
    got = quantized_matmul(*args, bits=bits, group_size=64, impl="pallas_tpu", interpret=True, block_k=256)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), np.float32(ref), rtol=2e-2, atol=2e-2)


def test_reference_equals_hand_dequantized_product():
    args, bits = _args("int4-sym", 32, 5, 96, 40)
    x, q, scale, _ = (np.asarray(a) if a is not None else None for a in args)
    codes = np.empty((96, 40), np.float64)
    codes[0::2], codes[1::2] = q & 15, q >> 4
    w = (codes - 8) * np.repeat(scale, 32, axis=0)
    got = np.asarray(quantized_matmul(*args, bits=bits, group_size=32))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise():
    args, bits = _args("int4-sym", 32, 4, 96, 40)
    with pytest.raises(ValueError, match="group_size"):
        quantized_matmul(*args, bits=bits, group_size=40)
    with pytest.raises(ValueError, match="scale must be"):
        quantized_matmul(args[0], args[1], args[2][:1], bits=bits, group_size=32)
    with pytest.raises(ValueError, match="impl"):
        quantized_matmul(*args, bits=bits, group_size=32, impl="cuda")


# ---- real compilers -----------------------------------------------------------------------------
SERVED = [
    ("int4-sym", 128, 4096, 4096, 8),
    ("int4-zp", 64, 2048, 1536, 256),
    ("int8", 0, 2048, 2048, 16),
    ("fp8", 0, 1024, 4096, 64),
    ("int8", 32, 1024, 1024, 8),
]


def _abstract(scheme, group, m, k, n, sharding=None):
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    bits = 4 if scheme.startswith("int4") else 8
    code_dtype = {"int4-sym": np.uint8, "int4-zp": np.uint8, "int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}[scheme]
    groups = k // group if group else 1
    offset = sd((groups, n), jnp.float32) if scheme == "int4-zp" else None
    return (
        sd((m, k), jnp.bfloat16),
        sd((k // (2 if bits == 4 else 1), n), code_dtype),
        sd((groups, n), jnp.float32),
        offset,
    ), bits


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu_sharding(request):
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    topology = topologies.get_topology_desc(f"{request.param}=1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())


@pytest.mark.parametrize("scheme,group,k,n,m", SERVED)
def test_tpu_kernel_compiles_aot(tpu_sharding, scheme, group, k, n, m):
    args, bits = _abstract(scheme, group, m, k, n, tpu_sharding)
    fn = lambda x, q, s, o: quantized_matmul(
        x,
        q,
        s,
        o,
        bits=bits,
        group_size=group,
        impl="pallas_tpu",
        block_n=256,
        block_k=512,
    )
    compiled = jax.jit(fn).trace(*args).lower().compile()
    assert compiled.out_info.shape == (m, n)


@pytest.mark.parametrize("scheme,group,k,n,m", SERVED)
def test_gpu_kernel_lowers_for_cuda(scheme, group, k, n, m):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    args, bits = _abstract(scheme, group, m, k, n)
    fn = lambda x, q, s, o: quantized_matmul(x, q, s, o, bits=bits, group_size=group, impl="pallas_gpu")
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
