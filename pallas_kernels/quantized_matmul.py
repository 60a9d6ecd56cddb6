"""Weight-quantized matmul: x [M, K] @ dequantize(codes, scale, offset) [K, N] -> [M, N].

The codes hold the weight in the layout of `models.quantization.QuantizedWeight` (groups run
along K, the input dim):
  bits 8: q int8 / float8_e4m3fn [K, N], w = q * scale
  bits 4: q uint8 [K/2, N], row 2i in the low nibble and row 2i+1 in the high nibble;
          w = q * scale + offset, or (q - 8) * scale when offset is None
  scale, offset: float32 [K/g, N] for group size g, or [1, N] per output channel (g = 0).

`dequantize_codes` + a dot is the spec (`quantized_matmul_reference`) and the CPU serving path.
The kernels dequantize one weight tile at a time in VMEM (TPU, Mosaic) or registers / shared
memory (GPU, Triton) and accumulate in float32, so HBM carries only the codes. For 4-bit codes
the wrapper reorders each K block of x to [even rows | odd rows] (an activation-sized copy) so
that the low and high nibbles of a code tile multiply contiguous halves of the x tile.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kernel_impls import Kernel

F32 = jnp.float32


def unpack_int4(packed):
    """uint8 [..., K/2, N] -> uint8 codes [..., K, N] (row 2i low nibble, 2i+1 high nibble)."""
    both = jnp.stack([packed & 15, packed >> 4], axis=-2)  # [..., K/2, 2, N]
    return both.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def dequantize_codes(q, scale, offset, *, bits, group_size, dtype=F32):
    """Codes [..., K(/2), N] -> float weight [..., K, N] in `dtype` (see the module docstring)."""
    codes = unpack_int4(q).astype(F32) if bits == 4 else q.astype(F32)
    *lead, k, n = codes.shape
    g = group_size or k
    codes = codes.reshape(*lead, k // g, g, n)
    scale = scale[..., :, None, :]
    if offset is not None:
        deq = codes * scale + offset[..., :, None, :]
    else:
        deq = (codes - 8.0 if bits == 4 else codes) * scale
    return deq.reshape(*lead, k, n).astype(dtype)


def quantized_matmul_reference(x, q, scale, offset=None, *, bits, group_size):
    """The spec: dequantize, then one float32 matmul. x [M, K] -> [M, N] in x.dtype."""
    w = dequantize_codes(q, scale, offset, bits=bits, group_size=group_size)
    y = jnp.dot(x.astype(F32), w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)


# ---- shared tile math -----------------------------------------------------------------------------
def _scale_rows(w, scale, offset, rows_per_group, symmetric_int4):
    """w [R, bn] f32 codes of consecutive groups of `rows_per_group` rows; scale/offset [R/rpg, bn]."""
    r, bn = w.shape
    w = w.reshape(r // rows_per_group, rows_per_group, bn)
    if offset is not None:
        w = w * scale[:, None, :] + offset[:, None, :]
    else:
        w = (w - 8.0 if symmetric_int4 else w) * scale[:, None, :]
    return w.reshape(r, bn)


def _tile_product(x, codes, scale, offset, *, bits, group_size):
    """x [bm, bk] (4-bit: [even | odd] rows of the block) times the dequantized code tile, f32.
    Per-channel tiles (group_size 0) are left unscaled: the caller scales the accumulator."""
    dot = functools.partial(jnp.dot, preferred_element_type=F32)
    if bits == 8:
        w = codes.astype(F32)
        if group_size:
            w = _scale_rows(w, scale, offset, group_size, False)
        return dot(x, w.astype(x.dtype))
    codes = codes.astype(jnp.int32)
    half = x.shape[1] // 2
    acc = None
    for part, nibble in enumerate((codes & 15, codes >> 4)):
        w = nibble.astype(F32)
        if group_size:
            w = _scale_rows(w, scale, offset, group_size // 2, offset is None)
        elif offset is None:
            w = w - 8.0
        term = dot(x[:, part * half : (part + 1) * half], w.astype(x.dtype))
        acc = term if acc is None else acc + term
    return acc


def _even_odd_blocks(x, block_k):
    """x [M, K] -> each K block of `block_k` columns reordered to [even columns | odd columns]."""
    m, k = x.shape
    return x.reshape(m, k // block_k, block_k // 2, 2).swapaxes(-1, -2).reshape(m, k)


def _check(x, q, scale, offset, bits, group_size):
    if x.ndim != 2 or q.ndim != 2:
        raise ValueError(f"x must be [M, K] and q 2-D, got {x.shape} and {q.shape}")
    k = x.shape[1]
    if q.shape[0] * (2 if bits == 4 else 1) != k:
        raise ValueError(f"codes {q.shape} do not hold K={k} rows at {bits} bits")
    groups = k // group_size if group_size else 1
    if group_size and k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={k}")
    for name, a in (("scale", scale), ("offset", offset)):
        if a is not None and a.shape != (groups, q.shape[1]):
            raise ValueError(f"{name} must be [{groups}, {q.shape[1]}], got {a.shape}")
    if bits == 4 and group_size % 2:
        raise ValueError("4-bit groups must have an even size")


def _pad_to(a, axis, multiple):
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


# ---- TPU (Mosaic) ------------------------------------------------------------------------------
def _tpu_kernel(x_ref, q_ref, s_ref, *rest, bits, group_size, has_offset, num_k):
    off_ref = rest[0] if has_offset else None
    out_ref, acc_ref = rest[-2], rest[-1]
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    grouped = group_size > 0
    scale = s_ref[...] if grouped else None
    offset = off_ref[...] if has_offset and grouped else None
    acc_ref[...] += _tile_product(x_ref[...], q_ref[...], scale, offset, bits=bits, group_size=group_size)

    @pl.when(k == num_k - 1)
    def _():
        acc = acc_ref[...]
        if not grouped:
            acc = acc * s_ref[...]
        out_ref[...] = acc.astype(out_ref.dtype)


def _padded_operands(x, q, scale, offset, *, bits, block_m, block_n, block_k):
    """4-bit activations reordered to the packed codes' even/odd halves; M padded to block_m and
    the weight columns (codes, scales, offsets) to block_n."""
    if bits == 4:
        x = _even_odd_blocks(x, block_k)
    x = _pad_to(x, 0, block_m)
    q, scale = _pad_to(q, 1, block_n), _pad_to(scale, 1, block_n)
    offset = None if offset is None else _pad_to(offset, 1, block_n)
    return x, q, scale, offset


def _tpu_call(x, q, scale, offset, *, bits, group_size, block_m, block_n, block_k, interpret):
    m, k = x.shape
    n = q.shape[1]
    rows_per_k = 2 if bits == 4 else 1
    block_k = min(block_k, k)
    if k % block_k or (group_size and block_k % group_size):
        raise ValueError(f"block_k={block_k} must divide K={k} and be a multiple of group_size={group_size}")
    x, q, scale, offset = _padded_operands(
        x, q, scale, offset, bits=bits, block_m=block_m, block_n=block_n, block_k=block_k
    )
    mp, np_ = x.shape[0], q.shape[1]
    num_k = k // block_k
    in_specs = [
        pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((block_k // rows_per_k, block_n), lambda i, j, kk: (kk, j)),
    ]
    operands = [x, q]
    if group_size:  # [K/g, N] -> [K/bk, bk/g, N]: one full-height scale tile per K block
        g_per_block = block_k // group_size
        scale_spec = pl.BlockSpec((None, g_per_block, block_n), lambda i, j, kk: (kk, 0, j))
        operands += [a.reshape(num_k, g_per_block, np_) for a in (scale,) + ((offset,) if offset is not None else ())]
        in_specs += [scale_spec] * (1 + (offset is not None))
    else:
        operands.append(scale)
        in_specs.append(pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j)))
    kernel = functools.partial(
        _tpu_kernel, bits=bits, group_size=group_size, has_offset=offset is not None, num_k=num_k
    )
    out = pl.pallas_call(
        kernel,
        grid=(mp // block_m, np_ // block_n, num_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


# ---- GPU (Triton) ------------------------------------------------------------------------------
def _gpu_kernel(x_ref, q_ref, s_ref, *rest, bits, group_size, has_offset, block_k):
    off_ref = rest[0] if has_offset else None
    out_ref = rest[-1]
    k = x_ref.shape[1]
    rows = block_k // 2 if bits == 4 else block_k
    grouped = group_size > 0

    def body(t, acc):
        codes = q_ref[pl.ds(t * rows, rows), :]
        scale = s_ref[pl.ds(t, 1), :] if grouped else None  # block_k == group_size: one scale row
        offset = off_ref[pl.ds(t, 1), :] if has_offset and grouped else None
        if bits == 4:  # two loads instead of slicing a value: [even | odd] halves of the x block
            halves = [x_ref[:, pl.ds(t * block_k + h * rows, rows)] for h in (0, 1)]
            return acc + _gpu_int4_product(halves, codes, scale, offset)
        w = codes.astype(F32)
        if grouped:
            w = w * scale if offset is None else w * scale + offset
        return acc + jnp.dot(x_ref[:, pl.ds(t * block_k, block_k)], w.astype(x_ref.dtype), preferred_element_type=F32)

    acc = jax.lax.fori_loop(0, k // block_k, body, jnp.zeros(out_ref.shape, F32))
    if not grouped:
        acc = acc * s_ref[...]
    out_ref[...] = acc.astype(out_ref.dtype)


def _gpu_int4_product(halves, codes, scale, offset):
    codes = codes.astype(jnp.int32)
    acc = None
    for x_half, nibble in zip(halves, (codes & 15, codes >> 4)):
        w = nibble.astype(F32)
        w = (w - 8.0) * scale if offset is None else w * scale + offset
        term = jnp.dot(x_half, w.astype(x_half.dtype), preferred_element_type=F32)
        acc = term if acc is None else acc + term
    return acc


def _gpu_call(x, q, scale, offset, *, bits, group_size, block_m, block_n, block_k, interpret):
    m, k = x.shape
    n = q.shape[1]
    if not group_size and (bits == 4):
        raise ValueError("the GPU kernel needs 4-bit codes in groups")
    block_k = group_size or min(block_k, k)
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 for the Triton kernel")
    if k % block_k:
        raise ValueError(f"block_k={block_k} must divide K={k}")
    x, q, scale, offset = _padded_operands(
        x, q, scale, offset, bits=bits, block_m=block_m, block_n=block_n, block_k=block_k
    )
    mp, np_ = x.shape[0], q.shape[1]
    operands = [x, q, scale] + ([offset] if offset is not None else [])
    in_specs = [
        pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
        pl.BlockSpec((q.shape[0], block_n), lambda i, j: (0, j)),
    ]
    in_specs += [pl.BlockSpec((a.shape[0], block_n), lambda i, j: (0, j)) for a in operands[2:]]
    kernel = functools.partial(
        _gpu_kernel, bits=bits, group_size=group_size, has_offset=offset is not None, block_k=block_k
    )
    out = pl.pallas_call(
        kernel,
        grid=(mp // block_m, np_ // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def _largest_divisor(total: int, cap: int, ok) -> int | None:
    return next((b for b in range(min(cap, total), 0, -1) if total % b == 0 and ok(b)), None)


def default_blocks(k: int, n: int, group_size: int, gpu: bool) -> tuple[int, int]:
    """(block_n, block_k) that divide N and K where possible (no weight padding per call).
    TPU: block_n a multiple of 128 dividing N, else N itself up to 2048 (else 128, padded);
    block_k <= 512, dividing K, a multiple of the group (even). GPU: powers of two (Triton)."""
    pow2 = lambda b: b >= 16 and b & (b - 1) == 0
    if gpu:
        block_n = _largest_divisor(n, 128, pow2) or 64
        block_k = group_size or _largest_divisor(k, 128, pow2) or k
        return block_n, block_k
    block_n = _largest_divisor(n, 512, lambda b: b % 128 == 0) or (n if n <= 2048 else 128)
    block_k = _largest_divisor(k, 512, lambda b: b % 2 == 0 and (not group_size or b % group_size == 0)) or k
    return block_n, block_k


@functools.partial(
    jax.jit, static_argnames=("bits", "group_size", "impl", "interpret", "block_m", "block_n", "block_k")
)
def quantized_matmul(
    x,
    q,
    scale,
    offset=None,
    *,
    bits,
    group_size,
    impl="reference",
    interpret=False,
    block_m=None,
    block_n=None,
    block_k=None,
):
    """x [M, K] (float) @ dequantized codes -> [M, N] in x.dtype, float32 accumulation.

    q: int8 / float8_e4m3fn [K, N] (bits 8) or uint8 [K/2, N] (bits 4); scale, offset: float32
    [K/g, N] for group_size g, or [1, N] per output channel (group_size 0; offset only with groups).
    impl: a name of `KERNELS`: "reference" (jnp), "pallas" (the kernel of the default backend),
    "pallas_tpu", "pallas_gpu".
    block_m defaults to M rounded up to 16 (at most 256); block_n / block_k to `default_blocks`;
    block_k (TPU) is a multiple of group_size; the GPU kernel steps K one group at a time.
    """
    _check(x, q, scale, offset, bits, group_size)
    if offset is not None and not group_size:
        raise ValueError("offsets need group-wise scales (group_size > 0)")
    if impl not in KERNELS:
        raise ValueError(f"impl must be one of {tuple(KERNELS)}, got {impl!r}")
    blocks = dict(block_m=block_m, block_n=block_n, block_k=block_k)
    return KERNELS[impl](x, q, scale, offset, bits=bits, group_size=group_size, interpret=interpret, **blocks)


def _reference(x, q, scale, offset, *, bits, group_size, interpret, **blocks):
    return quantized_matmul_reference(x, q, scale, offset, bits=bits, group_size=group_size)


def _kernel(x, q, scale, offset, *, bits, group_size, interpret, block_m, block_n, block_k, gpu: bool):
    m = x.shape[0]
    if block_m is None:
        block_m = min(256, max(16, 1 << (m - 1).bit_length()))
    auto_n, auto_k = default_blocks(x.shape[1], q.shape[1], group_size, gpu)
    call = _gpu_call if gpu else _tpu_call
    blocks = dict(block_m=block_m, block_n=block_n or auto_n, block_k=block_k or auto_k)
    return call(x, q, scale, offset, bits=bits, group_size=group_size, interpret=interpret, **blocks)


def _pallas(*args, **options):
    return _kernel(*args, **options, gpu=jax.default_backend() == "gpu")


# The implementations, by `impl` name (pallas_kernels/kernel_impls.py): "auto" is the jnp spec on
# CPU (models.ops.linear), the kernel of the platform elsewhere.
KERNELS = {
    "reference": Kernel(_reference, auto=("cpu",)),
    "pallas": Kernel(_pallas, per_shard=True, auto=("tpu", "gpu", "interpret")),
    "pallas_tpu": Kernel(functools.partial(_kernel, gpu=False), per_shard=True),
    "pallas_gpu": Kernel(functools.partial(_kernel, gpu=True), per_shard=True),
}
