"""Paged KV storage for one attention layer: the `KVPages` pytree and FP8 quantize helpers.

Pages are head-major, `[P, Hkv, ps, D]`, so the minor tile `(ps, D)` stays dense for every
dtype. FP8 pages carry one float32 scale per (page, kv head); the scales are arrays (data,
never static Python floats), so a new scale never recompiles anything.

Bit storage (the jnp CPU paths): XLA:CPU runs a scatter or dynamic-update-slice into a bfloat16
or FP8 buffer by converting the whole buffer, so a KV write into a 1 GiB bf16 pool cost a pass
over the pool every layer of every step (17 ms for 8 MiB of pages, against 0.02 ms for the
same write into float32 or uint16). With `bit_storage=True` the pages hold the raw bits as
uint16 / uint8 (`KVPages.view` names the logical dtype): writes scatter integers, and readers
bitcast only the pages they gathered (`KVPages.load`). The Pallas kernels take float storage.

Token-minor pages (`token_minor=True`, the TPU kernel with head_dim < 128): pages stored
`[P, Hkv, D, ps]`, so the minor (lane) dimension is the page's 128 tokens instead of a head_dim
narrower than TPU's 128 lanes. Head-major pages `[P, Hkv, ps, D]` with D < 128 are lane-padded to
128 / D times their bytes in the kernel's tiled layout while XLA keeps the parameter dense, and
the compiled step copied the whole pool into the padded layout (docs/scaling.md, "head_dim below
128"). `token_minor_fits` is the geometry rule; `logical` / `stored` turn gathered pages between
the two layouts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
SUPPORTED_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), *FP8_DTYPES)


def _bits_dtype(dtype):
    return {1: jnp.uint8, 2: jnp.uint16}[jnp.dtype(dtype).itemsize]


def token_minor_fits(head_dim: int, page_size: int) -> bool:
    """Whether pages of this geometry are stored token-minor on TPU: head_dim narrower than the
    128 lanes and whole 128-token lane rows per page (else the token axis would be padded)."""
    return head_dim < 128 and page_size % 128 == 0


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(jnp.dtype(dtype)).max)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Returns `clip(x / scale, -fmax, fmax)` cast to `dtype`; `scale` broadcasts against `x`.

    The clip matters: float8_e4m3fn has no inf, so an unclipped 500.0 becomes NaN.
    """
    limit = fp8_max(dtype)
    scaled = x.astype(jnp.float32) / scale.astype(jnp.float32)
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def dequantize(x: jax.Array, scale: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """Returns `x * scale` in `dtype` (`scale=None`: plain cast); `scale` broadcasts against `x`."""
    values = x.astype(jnp.float32)
    if scale is not None:
        values = values * scale.astype(jnp.float32)
    return values.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """KV pages of one attention layer.

    k, v:             [P, Hkv, ps, D]  float32 / bfloat16 / float8_e4m3fn / float8_e5m2
                      ([P, Hkv, D, ps] when `token_minor`: see the module docstring)
    k_scale, v_scale: [P, Hkv] float32 for FP8 pages, None otherwise.
    Page 0 is the null page: never owned by a request; padding block-table entries point at it.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    # Logical dtype name when k / v hold raw bits (bit storage); None: k / v are that dtype.
    view: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Pages stored [P, Hkv, D, ps] (the TPU kernel's lane-dense layout for head_dim < 128).
    token_minor: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        bit_storage: bool = False,
        token_minor: bool = False,
    ) -> KVPages:
        """Zero-filled pages; FP8 scales start at 1.0 (a page's first write at offset 0 resets them).

        `bit_storage`: hold bfloat16 / FP8 pages as their raw bits (for the jnp CPU paths; see
        the module docstring). Float32 pages are always stored as float32.
        `token_minor`: store pages [P, Hkv, D, ps] (the TPU kernel's layout for head_dim < 128).
        """
        dtype = jnp.dtype(dtype)
        if dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(f"KV dtype {dtype} not in {[str(d) for d in SUPPORTED_KV_DTYPES]}")
        minor = (head_dim, page_size) if token_minor else (page_size, head_dim)
        shape = (num_pages, num_kv_heads, *minor)
        view = dtype.name if bit_storage and dtype != jnp.float32 else None
        stored = _bits_dtype(dtype) if view else dtype
        k = jnp.zeros(shape, stored)
        v = jnp.zeros(shape, stored)
        if not is_fp8(dtype):
            return cls(k=k, v=v, view=view, token_minor=token_minor)
        # Two arrays, not one shared: the engine donates the caches, and donating one buffer
        # twice is an error.
        k_scale = jnp.ones((num_pages, num_kv_heads), jnp.float32)
        v_scale = jnp.ones((num_pages, num_kv_heads), jnp.float32)
        return cls(k=k, v=v, k_scale=k_scale, v_scale=v_scale, view=view, token_minor=token_minor)

    def logical(self, x: jax.Array) -> jax.Array:
        """(Gathered) pages `x` [..., ps, D] whatever the storage layout (token-minor: transposed)."""
        return jnp.swapaxes(x, -1, -2) if self.token_minor else x

    def stored(self, x: jax.Array) -> jax.Array:
        """Pages `x` [..., ps, D] in the storage layout (the inverse of `logical`)."""
        return jnp.swapaxes(x, -1, -2) if self.token_minor else x

    def with_token_minor(self, token_minor: bool = True) -> KVPages:
        """The same pages in the other storage layout (copies the arrays; tests, non-TPU readers)."""
        if token_minor == self.token_minor:
            return self
        swap = lambda x: jnp.swapaxes(x, -1, -2)
        return dataclasses.replace(self, k=swap(self.k), v=swap(self.v), token_minor=token_minor)

    def load(self, x: jax.Array) -> jax.Array:
        """Values of (gathered) pages `x` in the logical dtype: a bitcast under bit storage."""
        return x if self.view is None else jax.lax.bitcast_convert_type(x, self.dtype)

    def store(self, x: jax.Array) -> jax.Array:
        """`x` cast to the logical dtype, in the form the pages hold (bits under bit storage)."""
        x = x.astype(self.dtype)
        return x if self.view is None else jax.lax.bitcast_convert_type(x, self.k.dtype)

    def with_bit_storage(self, bit_storage: bool = True) -> KVPages:
        """The same pages with bit storage switched on or off (copies the arrays; tests, tools)."""
        if bit_storage == (self.view is not None) or self.dtype == jnp.float32:
            return self
        if bit_storage:
            to_bits = lambda x: jax.lax.bitcast_convert_type(x, _bits_dtype(self.dtype))
            return dataclasses.replace(self, k=to_bits(self.k), v=to_bits(self.v), view=self.dtype.name)
        return dataclasses.replace(self, k=self.load(self.k), v=self.load(self.v), view=None)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3 if self.token_minor else 2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[2 if self.token_minor else 3]

    @property
    def dtype(self):
        """The logical dtype of the pages (what `load` returns)."""
        return self.k.dtype if self.view is None else jnp.dtype(self.view)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in these pages (K and V, scales amortised over the page)."""
        values = 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        scales = 2 * self.num_kv_heads * 4 / self.page_size if self.quantized else 0
        return int(values + scales + 0.999999)

    def dequantized(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
        """(k, v) as `dtype`, scales applied: [P, Hkv, ps, D] each (either storage layout). For tests
        and debugging."""
        k_scale = None if self.k_scale is None else self.k_scale[:, :, None, None]
        v_scale = None if self.v_scale is None else self.v_scale[:, :, None, None]
        k, v = self.logical(self.load(self.k)), self.logical(self.load(self.v))
        return dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)
