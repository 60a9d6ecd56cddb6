"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi) over a paged latent cache.

MLA caches one row per token and layer instead of K and V per head: the compressed latent
`c_kv` (`kv_lora_rank` = L channels, after its RMSNorm) followed by the decoupled RoPE key `k_pe`
(`qk_rope_head_dim` = R channels, RoPE applied), W = L + R channels in all. With the key and value
up-projections absorbed into the query and the output (`q_nope @ W_UK` per head, `o @ W_UV` per
head), every query head attends to that one row as its key, and to its first L channels as its
value:

    q:   [T, H, W]   absorbed query: (q_nope @ W_UK_h) ++ rope(q_pe)
    out: [T, H, L]   softmax(q . row * sm_scale) @ row[:, :L]

so MLA is multi-query attention with one KV head of width W whose value is a prefix of its key.
Sequence, causality and padding semantics are those of `ragged_paged_attention` (see its module).

`LatentPages` holds the rows: [P, ps, W] (FP8 pages carry one f32 scale per page, [P]). Page 0
is the null page, as for `KVPages`. `mla_ragged_paged_attention` dispatches by `impl` through
`KERNELS`; the jnp implementations run the ragged paged attention paths over the same array as
both K and V (a view: no copy) and keep the first L output channels; the Pallas kernels
(mla_kernel_tpu.py, mla_kernel_gpu.py) copy each latent page once for all H heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kernel_impls import Kernel, by_backend
from pallas_kernels.kv_cache import SUPPORTED_KV_DTYPES, KVPages, _bits_dtype, dequantize, is_fp8
from pallas_kernels.rpa_common import true_num_seqs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentPages:
    """Latent rows of one MLA layer.

    c:       [P, ps, W]  float32 / bfloat16 / float8_e4m3fn / float8_e5m2 (W = kv_lora_rank + rope dim)
    c_scale: [P] float32 for FP8 pages, None otherwise.
    view:    logical dtype name when `c` holds raw bits (bit storage, the jnp CPU paths); None otherwise.
    """

    c: jax.Array
    c_scale: jax.Array | None = None
    view: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(cls, num_pages: int, page_size: int, width: int, dtype=jnp.bfloat16, bit_storage: bool = False):
        """Zero-filled pages; FP8 scales start at 1.0."""
        dtype = jnp.dtype(dtype)
        if dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(f"KV dtype {dtype} not in {[str(d) for d in SUPPORTED_KV_DTYPES]}")
        view = dtype.name if bit_storage and dtype != jnp.float32 else None
        c = jnp.zeros((num_pages, page_size, width), _bits_dtype(dtype) if view else dtype)
        scale = jnp.ones((num_pages,), jnp.float32) if is_fp8(dtype) else None
        return cls(c=c, c_scale=scale, view=view)

    @property
    def num_pages(self) -> int:
        return self.c.shape[0]

    @property
    def page_size(self) -> int:
        return self.c.shape[1]

    @property
    def width(self) -> int:
        return self.c.shape[2]

    @property
    def dtype(self):
        return self.c.dtype if self.view is None else jnp.dtype(self.view)

    @property
    def quantized(self) -> bool:
        return self.c_scale is not None

    def load(self, x: jax.Array) -> jax.Array:
        return x if self.view is None else jax.lax.bitcast_convert_type(x, self.dtype)

    def store(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        return x if self.view is None else jax.lax.bitcast_convert_type(x, self.c.dtype)

    def bytes_per_token(self) -> int:
        """Bytes one token occupies (its one row; an FP8 page's scale amortised over the page)."""
        scales = 4 / self.page_size if self.quantized else 0
        return int(self.width * self.dtype.itemsize + scales + 0.999999)

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """The rows as `dtype`, scales applied: [P, ps, W]. For tests and debugging."""
        scale = None if self.c_scale is None else self.c_scale[:, None, None]
        return dequantize(self.load(self.c), scale, dtype)

    def as_kv_pages(self) -> KVPages:
        """The same rows as one-head `KVPages` whose K and V are both the rows ([P, 1, ps, W])."""
        rows = self.c[:, None]
        scale = None if self.c_scale is None else self.c_scale[:, None]
        return KVPages(k=rows, v=rows, k_scale=scale, v_scale=scale, view=self.view)


def _via_rpa(impl: str):
    def run(q, latent, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, v_dim, interpret):
        from pallas_kernels.ragged_paged_attention import KERNELS as RPA

        out = RPA[impl](
            q, latent.as_kv_pages(), kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale, interpret=interpret
        )
        return out[..., :v_dim]

    return run


def _pallas_tpu(*args, **options):
    from pallas_kernels.mla_kernel_tpu import mla_ragged_paged_attention_tpu

    return mla_ragged_paged_attention_tpu(*args, **options)


def _pallas_gpu(*args, **options):
    from pallas_kernels.mla_kernel_gpu import mla_ragged_paged_attention_gpu

    return mla_ragged_paged_attention_gpu(*args, **options)


_pallas = by_backend(_pallas_tpu, _pallas_gpu, check_interpret=True)


# The implementations, by `impl` name (pallas_kernels/kernel_impls.py); the same names as
# ragged_paged_attention.KERNELS. The Pallas kernels (mla_kernel_tpu.py, mla_kernel_gpu.py) read
# each latent page once for all H heads, as key and value; "pallas" picks one by backend.
KERNELS = {
    "reference": Kernel(_via_rpa("reference"), kv_bits=True),
    "chunked": Kernel(_via_rpa("chunked"), kv_bits=True),
    "native": Kernel(_via_rpa("native"), kv_bits=True, per_shard=True, auto=("cpu",)),
    "pallas": Kernel(_pallas, per_shard=True, auto=("tpu", "gpu", "interpret")),
    "pallas_tpu": Kernel(_pallas_tpu, per_shard=True),
    "pallas_gpu": Kernel(_pallas_gpu, per_shard=True),
}


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_dim", "impl", "interpret"))
def mla_ragged_paged_attention(
    q: jax.Array,
    latent: LatentPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    v_dim: int,
    impl: str = "reference",
    interpret=False,
) -> jax.Array:
    """Causal MLA of a ragged batch over paged latent rows (see the module docstring).

    q:        [T, H, W] absorbed queries, W = latent.width
    latent:   LatentPages, rows [P, ps, W]
    kv_lens, block_tables, cu_q_lens, num_seqs: as for `ragged_paged_attention`
    v_dim:    L, the value channels (the first L of each row); L <= W
    Returns [T, H, v_dim] in q's dtype; rows of padding tokens are unspecified.
    """
    if impl not in KERNELS:
        raise ValueError(f"impl must be one of {tuple(KERNELS)}, got {impl!r}")
    if q.ndim != 3 or q.shape[-1] != latent.width:
        raise ValueError(f"q must be [T, H, W={latent.width}], got {q.shape}")
    if not 0 < v_dim <= latent.width:
        raise ValueError(f"v_dim must be in (0, {latent.width}], got {v_dim}")
    if latent.view is not None and not KERNELS[impl].kv_bits:
        raise ValueError(f"latent pages in bit storage are for {[n for n, k in KERNELS.items() if k.kv_bits]}")
    args = (
        q,
        latent,
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        true_num_seqs(num_seqs),
    )
    return KERNELS[impl](*args, sm_scale=sm_scale, v_dim=v_dim, interpret=interpret)
