"""MLA over paged latent rows, Pallas TPU (Mosaic) kernel.

Grid (work items,): a work item is `block_q` query tokens of one sequence (rpa_common's work
list), and all H query heads of those tokens: rows = token * H + head form one [block_q * H, W]
query tile. The item walks the sequence's pages `pages_per_block` at a time with double-buffered
async copies HBM -> VMEM and an online softmax in f32. MLA has one KV head: each latent page
[ps, W] is copied once per item and serves every head, as the key (all W lanes) and as the
value (its first lanes) of the same VMEM tile. FP8 pages are converted exactly to the query
dtype; the per-page scale multiplies the scores (K) and the probabilities (V).

Layouts follow the Mosaic tiling rules (tests/test_kernels_tpu_aot.py): tokens are the leading,
untiled dim of q [T + bq, H, W] and of the output, a key block is [pages_per_block, ps, W] in
VMEM (one page per leading index), FP8 scales are [P, 1, 1] rows copied into SMEM. W need not be
a multiple of 128 (DeepSeek: 576 = 512 + 64): the page is copied whole and VMEM pads its lanes;
pin the pool rows-minor (`pool_format`): TPU's default layout may not be, and XLA then copies
all of it before each call.
The value lanes are the first `value_width(v_dim, W)` (v_dim rounded up to 128, so the slice
is lane-aligned); the wrapper drops the lanes past v_dim. An item writes all `block_q` tokens;
rows past its sequence's end belong to later sequences, which the sequential grid writes after.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.layout import Format, Layout
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.rpa_common import MASK_VALUE, build_work_list, work_item

if TYPE_CHECKING:  # mla.py imports this module lazily, at dispatch
    from pallas_kernels.mla import LatentPages


def _kernel(
    kv_lens_ref,
    block_tables_ref,
    cu_q_lens_ref,
    work_seq_ref,
    work_start_ref,
    num_work_ref,  # SMEM (scalar prefetch)
    q_hbm,
    c_hbm,
    *rest,  # HBM, then scratch
    num_heads,
    block_q,
    pages_per_block,
    max_blocks,
    sm_scale,
    v_width,
    quantized,
):
    if quantized:
        scale_hbm, o_hbm, q_vmem, o_vmem, c_vmem, scale_smem, page_sems, io_sem = rest
    else:
        o_hbm, q_vmem, o_vmem, c_vmem, page_sems, io_sem = rest
    work = pl.program_id(0)
    rows = block_q * num_heads
    page_size, width = c_hbm.shape[1], c_hbm.shape[2]
    keys_per_block = pages_per_block * page_size

    @pl.when(work < num_work_ref[0])
    def _attend():
        seq, q_start, _, kv_len, _, first_pos, last_pos = work_item(
            work, work_seq_ref, work_start_ref, cu_q_lens_ref, kv_lens_ref, block_q
        )
        # lax.div (truncating) rather than //: operands are >= 0 and floor division needs sign.
        num_pages = lax.div(last_pos, page_size) + 1
        num_blocks = lax.div(num_pages + pages_per_block - 1, pages_per_block)

        q_copy = pltpu.make_async_copy(q_hbm.at[pl.ds(q_start, block_q)], q_vmem, io_sem)
        q_copy.start()

        def page_copies(block, slot):
            copies = []
            for i in range(pages_per_block):
                logical = jnp.minimum(block * pages_per_block + i, max_blocks - 1)
                page = block_tables_ref[seq * max_blocks + logical]
                copies.append(pltpu.make_async_copy(c_hbm.at[page], c_vmem.at[slot, i], page_sems.at[slot]))
                if quantized:
                    copies.append(pltpu.make_async_copy(scale_hbm.at[page], scale_smem.at[slot, i], page_sems.at[slot]))
            return copies

        for copy in page_copies(0, 0):
            copy.start()
        q_copy.wait()
        q = q_vmem[...].reshape(rows, width)  # [rows, W], row = token * H + head
        shape = (rows, keys_per_block)
        row_pos = first_pos + lax.div(lax.broadcasted_iota(jnp.int32, shape, 0), num_heads)
        col = lax.broadcasted_iota(jnp.int32, shape, 1)

        def column_scales(slot):
            # [1, keys]: the scale of the page each key column came from.
            page_of_col = lax.div(lax.broadcasted_iota(jnp.int32, (1, keys_per_block), 1), page_size)
            scales = jnp.zeros((1, keys_per_block), jnp.float32)
            for i in range(pages_per_block):
                scales = jnp.where(page_of_col == i, scale_smem[slot, i, 0, 0], scales)
            return scales

        def attend_block(block, carry):
            m_prev, l_prev, acc_prev = carry
            slot = lax.rem(block, 2)
            first_key = block * pages_per_block * page_size

            @pl.when(block + 1 < num_blocks)
            def _prefetch_next():
                for copy in page_copies(block + 1, 1 - slot):
                    copy.start()

            for copy in page_copies(block, slot):
                copy.wait()
            c = c_vmem[slot].reshape(keys_per_block, width)  # [keys, W]
            # Slots past the context (and the null page) may hold NaN, and 0 * NaN = NaN inside
            # the matmuls: zero them once, for the key and the value alike.
            row_key = first_key + lax.broadcasted_iota(jnp.int32, c.shape, 0)
            c = jnp.where(row_key < kv_len, c.astype(q.dtype), jnp.zeros((), q.dtype))
            scores = lax.dot_general(q, c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if quantized:
                scales = column_scales(slot)
                scores = scores * scales
            key_pos = first_key + col  # [rows, keys]
            visible = (key_pos <= row_pos) & (key_pos < kv_len)
            scores = jnp.where(visible, scores * sm_scale, MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # [rows, 1]
            probs = jnp.where(visible, jnp.exp(scores - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
            if quantized:  # a scale of a page past the context may be NaN: keep the where outside
                probs = jnp.where(visible, probs * scales, 0.0)
            values = c if v_width == width else c[:, :v_width]  # [keys, Wv]: the tile's first lanes
            pv = lax.dot_general(
                probs.astype(q.dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )  # [rows, Wv]
            return m_next, l_next, alpha * acc_prev + pv

        init = (
            jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, v_width), jnp.float32),
        )
        _, l_final, acc = lax.fori_loop(0, num_blocks, attend_block, init)
        o_vmem[...] = (acc / l_final).reshape(o_vmem.shape).astype(o_vmem.dtype)
        out_copy = pltpu.make_async_copy(o_vmem, o_hbm.at[pl.ds(q_start, block_q)], io_sem)
        out_copy.start()
        out_copy.wait()


def pool_format(sharding) -> Format:
    """The layout the kernel reads latent pages in, [P, ps, W] with W minor, for `jax.device_put`
    and jit in/out shardings. TPU's default layout for a W that is not a multiple of 128 may put
    another dim minor (it did at W = 576 for ps = 128, and for ps = 64 with 2049 pages:
    benchmarks/mla_kernel_cost.py), and then every call first copies the whole pool into this one."""
    return Format(Layout(major_to_minor=(0, 1, 2)), sharding)


def value_width(v_dim: int, width: int) -> int:
    """Value lanes the kernel reads: v_dim rounded up to a lane multiple (128), at most W."""
    return min(width, -(-v_dim // 128) * 128)


def default_block_q(num_heads: int) -> int:
    """Query tokens per work item: about 128 rows of (token, head); 1 token from H = 128 up."""
    return max(1, 128 // num_heads)


def default_pages_per_block(page_size: int, max_blocks: int) -> int:
    """Pages per key block: about 512 keys (a 576-lane bf16 block is 0.6 MiB per buffer)."""
    return max(1, min(max_blocks, 512 // page_size))


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_dim", "block_q", "pages_per_block", "interpret"))
def mla_ragged_paged_attention_tpu(
    q: jax.Array,
    latent: LatentPages,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    v_dim: int,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret=False,
) -> jax.Array:
    """TPU kernel; arguments as `mla.mla_ragged_paged_attention` (int32 metadata, num_seqs []).

    latent: `mla.LatentPages` in float storage, rows [P, ps, W] (FP8: scales [P] f32).
    Returns [T, H, v_dim] in q's dtype.
    """
    num_tokens, num_heads, width = q.shape
    page_size = latent.c.shape[1]
    num_seqs_padded, max_blocks = block_tables.shape
    v_width = value_width(v_dim, width)
    block_q = block_q or default_block_q(num_heads)
    pages_per_block = pages_per_block or default_pages_per_block(page_size, max_blocks)
    num_work = pl.cdiv(num_tokens, block_q) + num_seqs_padded
    work_seq, work_start, num_work_valid = build_work_list(cu_q_lens, num_seqs, block_q, num_work)
    q_padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))  # [T + bq, H, W]: every block in bounds

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    inputs = [q_padded, latent.c]
    scratch = [
        pltpu.VMEM((block_q, num_heads, width), q.dtype),
        pltpu.VMEM((block_q, num_heads, v_width), q.dtype),
        pltpu.VMEM((2, pages_per_block, page_size, width), latent.c.dtype),
    ]
    if latent.quantized:
        inputs.append(latent.c_scale.astype(jnp.float32).reshape(-1, 1, 1))  # [P, 1, 1]
        scratch.append(pltpu.SMEM((2, pages_per_block, 1, 1), jnp.float32))
    scratch += [pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA(())]

    kernel = functools.partial(
        _kernel,
        num_heads=num_heads,
        block_q=block_q,
        pages_per_block=pages_per_block,
        max_blocks=max_blocks,
        sm_scale=sm_scale,
        v_width=v_width,
        quantized=latent.quantized,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens + block_q, num_heads, v_width), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_work,),
            in_specs=[any_spec] * len(inputs),
            out_specs=any_spec,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(kv_lens, block_tables.reshape(-1), cu_q_lens, work_seq, work_start, num_work_valid, *inputs)
    return out[:num_tokens, :, :v_dim]
