"""Quantized weights: the `QuantizedWeight` pytree, the matmuls that accept it, and the schemes.

    w = quantize_weight(np_w, "int4", group_size=32)   # np_w [..., K, N] -> host QuantizedWeight
    y = qdot(x, w)                                      # x [T, K] -> [T, N], also for plain arrays

A `QuantizedWeight` stands wherever a float `[..., K, N]` weight goes (projections, MoE expert
stacks, the tied embedding / lm_head); leading axes are the stacked layer groups, so `lax.scan`
and `unstack_layers` slice it like an array. Fields (groups run along K, the input dim):

- `q`: int8 `[..., K, N]` (int8 schemes), float8_e4m3fn `[..., K, N]` (fp8), or uint8
  `[..., K/2, N]` holding two unsigned 4-bit values per byte (int4: row 2i in the low nibble,
  row 2i+1 in the high nibble), so int4 is half a byte per weight on every backend;
- `scale`: float32 `[..., K/g, N]` (`g = group_size`, or K for per-channel: `[..., 1, N]`;
  8-bit codes are per-channel except GGUF Q8_0's blocks of 32);
- `offset`: float32 `[..., K/g, N]` or None. int4 dequantizes as `q * scale + offset`
  (AWQ/GPTQ's `(q - z) * s` is `offset = -z * s`, GGUF Q4_1's `d * q + m` is `offset = m`);
  None means the symmetric code `(q - 8) * scale`. 8-bit codes are symmetric: `q * scale`;
- `perm`: int32 `[..., K]` or None (GPTQ act-order): the rows of `q` are the input rows
  `perm[0], perm[1], ...`, so `qdot` multiplies `x[:, perm]`;
- static `bits` (4 or 8), `group_size` (0: per output channel), `act` (`"none"`, or
  `"int8"` / `"fp8"`: W8A8, activations quantized per token with a dynamic scale);
- static `block_n` (0: scales per output column as above): 2-D blocks of `group_size` input rows
  x `block_n` output columns, one float32 scale each, `scale` `[..., ceil(K/g), ceil(N/block_n)]`,
  the last block of either dim partial when it does not divide (HF fine-grained FP8, DeepSeek-V3's
  128 x 128 blocks: models/prequantized.py); 8-bit codes, `w = q * scale[block]`.

`qdot` is the jnp path (dequantize inside the jitted step; XLA fuses the convert into the dot)
that `pallas_kernels/quantized_matmul.py` mirrors tile by tile on accelerators.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from pallas_kernels import cpu_native
from pallas_kernels.quantized_matmul import dequantize_codes, quantized_matmul

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
ACTS = ("none", "int8", "fp8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    q: Any
    scale: Any
    offset: Any = None
    perm: Any = None
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))
    act: str = dataclasses.field(default="none", metadata=dict(static=True))
    block_n: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical float shape [..., K, N]."""
        *lead, k, n = self.q.shape
        return (*lead, k * 2 if self.bits == 4 else k, n)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def host(self) -> QuantizedWeight:
        return jax.tree.map(np.asarray, self)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutInWeight:
    """A float `[..., K, N]` weight held as its transpose `t` `[..., N, K]` (torch's [out, in]).

    The CPU plan's weight layout (runtime/steps/execution_plan.py): XLA:CPU's XNNPACK dot takes an [N, K]
    right-hand side faster than [K, N] (SmolLM2-135M's 30 layers of projections at 16 rows, bf16:
    26-28 -> 19-21 ms; float32 43 -> 37 ms). `qdot` contracts `t` in place; leading axes (stacked
    layer groups) slice like an array's.
    """

    t: Any

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, k = self.t.shape
        return (*lead, k, n)

    @property
    def ndim(self) -> int:
        return self.t.ndim

    @property
    def dtype(self):
        return self.t.dtype


def out_in(w):
    """`w` [..., K, N] as an `OutInWeight` (its transpose, a new array); quantized weights and
    OutInWeights unchanged."""
    if isinstance(w, (QuantizedWeight, OutInWeight)):
        return w
    return OutInWeight(jnp.swapaxes(w, -1, -2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A bf16 `[..., K, N]` weight packed once for the native CPU matmul
    (`pallas_kernels.cpu_native.pack_bf16_weight`: `p` `[..., ceil(N/16), ceil(K/2), 32]`).

    The CPU plan's weight layout for bf16 on a CPU with AVX512-BF16 (runtime/steps/execution_plan.py):
    XLA:CPU's dot re-packs its weight operand on every call, which is most of a decode step's
    projection time; this weight is packed at load and streamed once per call. `qdot` runs the
    kernel at every row count: in the engine it beats XLA's dot on prefill-sized steps too
    (SmolLM2-135M bf16, a 512-token prefill step 562 -> 435 ms; decode rows
    `benchmarks/cpu_native.py`). Without the kernel (or for a float32 x) `qdot` unpacks it.
    """

    p: Any
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.p.shape[:-3], self.k, self.n)

    @property
    def ndim(self) -> int:
        return self.p.ndim - 1

    @property
    def dtype(self):
        return self.p.dtype


def packed(w):
    """A bf16 weight `w` [..., K, N] (or an OutInWeight of one) as a `PackedWeight` (a new array);
    anything else (float32, quantized, already packed) unchanged."""
    if isinstance(w, OutInWeight) and w.t.dtype == jnp.bfloat16:
        *_, n, k = w.t.shape
        return PackedWeight(cpu_native.pack_bf16_weight(w.t, out_in=True), k, n)
    if isinstance(w, (QuantizedWeight, OutInWeight, PackedWeight)) or jnp.dtype(w.dtype) != jnp.bfloat16:
        return w
    *_, k, n = w.shape
    return PackedWeight(cpu_native.pack_bf16_weight(w), k, n)


# ---- schemes ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Scheme:
    """One online quantization recipe (`model.quantization`)."""

    name: str
    code: str  # "int8" | "fp8" | "int4"
    act: str = "none"
    grouped: bool = False  # int4: group-wise along K (model.quantization_group_size)
    zero_point: bool = False  # int4: asymmetric (min/max) groups with an offset


SCHEMES = {
    s.name: s
    for s in (
        Scheme("int8", "int8"),
        Scheme("fp8", "fp8"),
        Scheme("w8a8-int8", "int8", act="int8"),
        Scheme("w8a8-fp8", "fp8", act="fp8"),
        # `int4` is the recipe that measured best on SmolLM2 (docs/quantization.md): zero point,
        # as llama.cpp's Q4_1, AWQ and torchao's int4 weight-only; `int4-zp` names it explicitly
        Scheme("int4", "int4", grouped=True, zero_point=True),
        Scheme("int4-zp", "int4", grouped=True, zero_point=True),
        Scheme("int4-sym", "int4", grouped=True),
    )
}
GROUP_SIZES = (32, 64, 128)


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"quantization must be one of {sorted(SCHEMES)}, got {name!r}")
    return SCHEMES[name]


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint codes 0..15 [..., K, N] (K even) -> uint8 [..., K/2, N], row 2i low nibble."""
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)).astype(np.uint8)


def unpack_int4_np(packed: np.ndarray) -> np.ndarray:
    lo, hi = packed & 15, packed >> 4
    return np.stack([lo, hi], axis=-2).reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def _groups(w: np.ndarray, group_size: int) -> np.ndarray:
    """[..., K, N] -> [..., K/g, g, N] (one group per channel when group_size is 0)."""
    *lead, k, n = w.shape
    g = group_size or k
    return w.reshape(*lead, k // g, g, n)


def quantize_weight(w: np.ndarray, scheme: str | Scheme, group_size: int = 128) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [..., K, N] (numpy, on the host)."""
    s = get_scheme(scheme) if isinstance(scheme, str) else scheme
    w = np.asarray(w, np.float32)
    k = w.shape[-2]
    if s.code == "int4":
        if k % 2 or k % group_size:
            raise ValueError(f"int4 group size {group_size} does not divide the input dim {k}")
        grouped = _groups(w, group_size)
        if s.zero_point:
            lo, hi = grouped.min(-2, keepdims=True), grouped.max(-2, keepdims=True)
            scale = np.maximum(hi - lo, 1e-12) / 15.0
            codes = np.clip(np.round((grouped - lo) / scale), 0, 15)
            offset = lo[..., 0, :]
        else:
            scale = np.maximum(np.abs(grouped).max(-2, keepdims=True), 1e-12) / 7.0
            codes = np.clip(np.round(grouped / scale), -8, 7) + 8
            offset = None
        q = pack_int4(codes.reshape(w.shape))
        return QuantizedWeight(q, scale[..., 0, :].astype(np.float32), offset, bits=4, group_size=group_size)
    amax = np.maximum(np.abs(w).max(-2, keepdims=True), 1e-12)  # [..., 1, N] per output channel
    if s.code == "int8":
        scale = amax / INT8_MAX
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    else:
        scale = amax / FP8_MAX
        q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    return QuantizedWeight(q, scale.astype(np.float32), bits=8, act=s.act)


# ---- dequantize / matmuls -----------------------------------------------------------------------
def dequantize(w: QuantizedWeight, dtype=jnp.float32):
    """The float weight [..., K, N] in the rows of `w.q` (act-order rows stay permuted)."""
    if w.block_n:
        return (w.q.astype(jnp.float32) * block_scales(w.scale, w.q.shape, w.group_size, w.block_n)).astype(dtype)
    return dequantize_codes(w.q, w.scale, w.offset, bits=w.bits, group_size=w.group_size, dtype=dtype)


def block_scales(scale, shape, block_k: int, block_n: int, xp=jnp):
    """Block scales [..., ceil(K/bk), ceil(N/bn)] -> one per weight [..., K, N] (partial last blocks cut)."""
    *_, k, n = shape
    return xp.repeat(xp.repeat(scale, block_k, axis=-2)[..., :k, :], block_n, axis=-1)[..., :n]


def per_column(w):
    """A block-scaled QuantizedWeight with one scale per output column within each row block
    (`block_n` 1: columns can then be picked or concatenated freely); anything else unchanged."""
    if not isinstance(w, QuantizedWeight) or w.block_n <= 1:
        return w
    xp = np if isinstance(w.scale, np.ndarray) else jnp
    n = w.q.shape[-1]
    return dataclasses.replace(w, scale=xp.repeat(w.scale, w.block_n, axis=-1)[..., :n], block_n=1)


def quantize_activations(x, act: str):
    """Per-token dynamic quantization of x [T, K] -> (codes, scale [T, 1] float32)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-12)
    if act == "int8":
        scale = amax / INT8_MAX
        return jnp.clip(jnp.round(x32 / scale), -127, 127).astype(jnp.int8), scale
    scale = amax / FP8_MAX
    return (x32 / scale).astype(jnp.float8_e4m3fn), scale


def _permute_input(x, w: QuantizedWeight):
    return x if w.perm is None else jnp.take(x, w.perm, axis=-1)


def qdot(x, w, valid_rows=None):
    """x [T, K] @ w [K, N] -> [T, N] in x's dtype; `w` a float array, an OutInWeight, a
    PackedWeight or a 2-D QuantizedWeight. `valid_rows` (an int32 scalar, may be traced): x's
    first rows that are real, the rest padding whose result is unspecified; the native bf16
    matmul of a PackedWeight skips them (zeros), the other paths compute every row."""
    if isinstance(w, PackedWeight):
        if x.dtype == jnp.bfloat16 and cpu_native.available():
            return cpu_native.bf16_matmul(x, w.p, w.n, valid_rows=valid_rows)
        w = OutInWeight(cpu_native.unpack_bf16_weight(w.p, w.n, w.k, out_in=True))
    if isinstance(w, OutInWeight):
        return lax.dot_general(
            x, w.t, (((x.ndim - 1,), (w.t.ndim - 1,)), ((), ())), preferred_element_type=jnp.float32
        ).astype(x.dtype)
    if not isinstance(w, QuantizedWeight):
        # f32 accumulation, rounded to x's dtype: what x @ w means for bf16, spelled so XLA:CPU's
        # XNNPACK dot takes bf16 operands as they are (a bf16-output dot gets both operands
        # converted to f32 first: 4-5x slower)
        return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(
            x.dtype
        )
    x = _permute_input(x, w)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if w.act != "none":
        xq, x_scale = quantize_activations(x, w.act)
        acc_type = jnp.int32 if w.act == "int8" else jnp.float32
        acc = lax.dot_general(xq, w.q, dims, preferred_element_type=acc_type)
        return (acc.astype(jnp.float32) * x_scale * w.scale[0]).astype(x.dtype)
    if w.bits == 8 and not w.group_size:  # per-channel: scale the output columns instead of every weight
        y = lax.dot_general(x, w.q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * w.scale[0]).astype(x.dtype)
    return lax.dot_general(x, dequantize(w, x.dtype), dims, preferred_element_type=jnp.float32).astype(x.dtype)


def kernel_supports(w) -> bool:
    """Whether `pallas_kernels.quantized_matmul` takes this weight (2-D, weight-only, no act order)."""
    return (
        isinstance(w, QuantizedWeight)
        and w.act == "none"
        and w.perm is None
        and w.q.ndim == 2
        and not w.block_n
        and (w.offset is None or w.group_size > 0)
    )


def qdot_pallas(x, w: QuantizedWeight, *, interpret=False):
    """`qdot` through the Pallas kernel of the default backend (see `kernel_supports`)."""
    return quantized_matmul(
        x, w.q, w.scale, w.offset, bits=w.bits, group_size=w.group_size, impl="pallas", interpret=interpret
    )


def qdot_reference(x, w):
    """The spec: dequantize (activations too, for W8A8) and multiply in float32."""
    x32 = _permute_input(x, w).astype(jnp.float32)
    if w.act != "none":
        xq, x_scale = quantize_activations(x32, w.act)
        x32 = xq.astype(jnp.float32) * x_scale
    return jnp.dot(x32, dequantize(w, jnp.float32), precision=lax.Precision.HIGHEST)


def qragged_dot(x, w, group_sizes):
    """MoE grouped matmul: x [T, K] sorted by expert, w [E, K, N] float or quantized -> [T, N]."""
    if not isinstance(w, QuantizedWeight):
        return lax.ragged_dot(x, w, group_sizes)
    if w.perm is not None:
        raise ValueError("act-order (perm) expert weights are not supported")
    if w.act != "none":
        xq, x_scale = quantize_activations(x, w.act)
        x = (xq.astype(jnp.float32) * x_scale).astype(x.dtype)
    return lax.ragged_dot(x, dequantize(w, x.dtype), group_sizes)


def embed_lookup(embed, ids, dtype):
    """Rows of the embedding for token ids [T] -> [T, H] in `dtype`. A quantized embedding is
    stored transposed ([H, V], one scale per vocab column) so the tied lm_head is a plain `qdot`."""
    if not isinstance(embed, QuantizedWeight):
        return embed[ids]
    cols = QuantizedWeight(
        jnp.take(embed.q, ids, axis=-1),
        jnp.take(embed.scale, ids, axis=-1),
        None if embed.offset is None else jnp.take(embed.offset, ids, axis=-1),
        None,
        bits=embed.bits,
        group_size=embed.group_size,
    )
    return dequantize(cols, dtype).T


def tied_head(embed):
    """The lm_head weight [H, V] of a tied model."""
    return embed if isinstance(embed, QuantizedWeight) else embed.T


def to_device(w: QuantizedWeight) -> QuantizedWeight:
    """A host QuantizedWeight's arrays as jax arrays (codes and float32 scales as stored)."""
    return jax.tree.map(jnp.asarray, w)


def take_columns(w, columns):
    """w[..., columns] for a float weight or a QuantizedWeight (codes, scales, offsets)."""
    if not isinstance(w, QuantizedWeight):
        return w[..., columns]
    w = per_column(w)
    pick = lambda a: None if a is None else a[..., columns]
    return dataclasses.replace(w, q=pick(w.q), scale=pick(w.scale), offset=pick(w.offset))


def param_bytes(params) -> int:
    """Bytes the parameters occupy on their device(s), scales and offsets included."""
    total = 0
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.on_device_size_in_bytes() for s in leaf.addressable_shards)
        else:
            total += np.asarray(leaf).nbytes
    return total
