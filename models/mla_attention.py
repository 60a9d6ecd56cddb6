"""Multi-head latent attention (MLA), DeepSeek-V3's attention layer, over paged latent rows.

Per token the layer caches one row of `cfg.mla.latent_width` = L + R channels (`LatentPages`):
the RMS-normed latent c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:L]) followed by the RoPE'd
shared key k_pe = rope(kv_a_proj_with_mqa(x)[L:]). HF expands the latent per head through
kv_b_proj into K = [c W_UK_h, k_pe] and V = c W_UV_h; here the up-projections are absorbed
instead (pallas_kernels/mla.py): each head's query becomes [q_nope_h W_UK_h^T, rope(q_pe_h)]
against the row, the op returns softmax(.) @ c per head, and W_UV_h maps that to the head's value.

    q:   x -> q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj      [T, H, nope + R]
    row: x -> kv_a_proj_with_mqa -> [kv_a_layernorm(c) | rope(k_pe)] [T, L + R]  (written to the pages)
    out: op([q_nope W_UK^T | rope(q_pe)], rows) W_UV -> o_proj        [T, H*V] -> [T, hidden]

Kimi Linear's MLA (`MLAConfig.rope` False) leaves both R-channel parts unrotated (NoPE).
`rope_interleave` (HF's default) rotates interleaved pairs and writes them de-interleaved: the
same as taking the even channels then the odd ones and rotating halves. The op's implementation
follows the attention back-end the execution plan chose (`mla_impl`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from models import mla_split, ops
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.quantization import dequantize, is_quantized
from pallas_kernels import mla
from pallas_kernels.kernel_impls import resolve
from pallas_kernels.kv_cache import KVPages
from pallas_kernels.kv_write import write_kv

# attention back-ends that name their target platform (pallas_kernels/ragged_paged_attention.py)
TARGETS = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
# HF builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not `rms_norm_eps`
LATENT_NORM_EPS = 1e-6


def mla_params(cfg: ModelConfig, get, lin, a: str) -> dict:
    """One layer's MLA weights from HF tensors under prefix `a` (`layers.{i}.self_attn.`); Linear
    weights [in, out] as `lin` reads them."""
    m, H, hidden = cfg.mla, cfg.num_heads, cfg.hidden_size
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    p = {}
    if m.q_lora_rank:
        p["q_a_proj"] = lin(a + "q_a_proj", m.q_lora_rank, hidden)
        p["q_a_norm"] = get(a + "q_a_layernorm.weight", (m.q_lora_rank,))
        p["q_b_proj"] = lin(a + "q_b_proj", H * qk, m.q_lora_rank)
    else:
        p["q_proj"] = lin(a + "q_proj", H * qk, hidden)
    p["kv_a_proj"] = lin(a + "kv_a_proj_with_mqa", m.latent_width, hidden)
    p["kv_a_norm"] = get(a + "kv_a_layernorm.weight", (m.kv_lora_rank,))
    p["kv_b_proj"] = lin(a + "kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    p["o_proj"] = lin(a + "o_proj", hidden, H * m.v_head_dim)
    return p


def mla_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes `mla_params` returns (for `models.weights.abstract_params`)."""
    m, H, hidden = cfg.mla, cfg.num_heads, cfg.hidden_size
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    shapes = (
        {"q_a_proj": (hidden, m.q_lora_rank), "q_a_norm": (m.q_lora_rank,), "q_b_proj": (m.q_lora_rank, H * qk)}
        if m.q_lora_rank
        else {"q_proj": (hidden, H * qk)}
    )
    return {
        **shapes,
        "kv_a_proj": (hidden, m.latent_width),
        "kv_a_norm": (m.kv_lora_rank,),
        "kv_b_proj": (m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim)),
        "o_proj": (H * m.v_head_dim, hidden),
    }


def mla_impl(opts: ops.KernelOptions, latent: mla.LatentPages) -> str:
    """The MLA op's implementation: the attention back-end's name where the MLA op has one (the
    execution plan picked it for this platform), else the MLA op's own "auto" there (the target
    platform for "pallas_tpu" / "pallas_gpu"); where that names nothing (Pallas interpret mode on
    CPU, or a TPU / GPU, before MLA kernels exist) or cannot read the pages' bit storage,
    "chunked", the jnp path every platform runs."""
    choice = opts.attention if opts.attention in mla.KERNELS else "auto"
    platform = TARGETS.get(opts.attention, jax.default_backend())  # `jaxserve plan` targets a chip from a CPU host
    try:
        name = resolve(mla.KERNELS, choice, platform, opts.interpret)
    except ValueError:
        name = "chunked"
    if latent.view is not None and not mla.KERNELS[name].kv_bits:
        name = "chunked"
    return name


def write_latent(latent: mla.LatentPages, rows, slots, opts: ops.KernelOptions, max_seqs: int | None):
    """rows [T, L + R] into the pages at `slots` (-1: padding): the KV write of a one-head layer
    whose K is the rows (its V, the same pages, is not read back); FP8 scale rules as KV's."""
    pages = latent.c[:, None]  # [P, 1, ps, W]
    scale = None if latent.c_scale is None else latent.c_scale[:, None]
    kv = KVPages(k=pages, v=pages, k_scale=scale, v_scale=scale, view=latent.view)
    whole_pages = opts.impl("attention") == "pallas_tpu"  # as models.ops.write_kv: no scatter into the pool on TPU
    out = write_kv(kv, rows[:, None], rows[:, None], slots, whole_pages=whole_pages, max_seqs=max_seqs)
    c_scale = None if out.k_scale is None else out.k_scale[:, 0]
    return mla.LatentPages(c=out.k[:, 0], c_scale=c_scale, view=latent.view)


def absorbed_weight(w):
    """kv_b_proj [L, H*(nope + V)] as a float array. Absorbed, it is used per head on both sides of
    attention (W_UK against the query's nope channels, W_UV after), contracting its output
    columns, across which a quantized weight's per-column scales cannot be factored out of a
    matmul: a quantized one (models/quant_rules.py) is dequantized here, in the step."""
    if not is_quantized(w):
        return w
    deq = dequantize(w)
    return deq if w.perm is None else jnp.zeros_like(deq).at[w.perm].set(deq)  # act-order rows back in order


def _rms_norm(x, w, eps: float):
    x32 = x.astype(jnp.float32)
    return w * (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _rope(x, cos, sin, interleaved: bool):
    """x [T, heads, R] rotated by cos / sin [T, R] (HF's rotate-half; `interleaved`: pairs
    (x0, x1), (x2, x3), ... rotated and written de-interleaved, HF's rope_interleave)."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None].astype(x.dtype) + rotated * sin[:, None].astype(x.dtype)


def mla_layer(p, x, latent: mla.LatentPages, batch: ForwardBatch, rope, page_offset, cfg: ModelConfig, opts):
    """x [T, hidden] -> ([T, hidden], latent with this step's rows written). `page_offset`: the
    layer group's first page in the stacked pool (as `transformer.attention_layer`)."""
    m, H, T = cfg.mla, cfg.num_heads, x.shape[0]
    L, R, nope, eps = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, LATENT_NORM_EPS
    rows = batch.num_valid_rows
    if m.q_lora_rank:
        q = ops.linear(x, p["q_a_proj"], opts, valid_rows=rows)
        q = ops.linear(_rms_norm(q, p["q_a_norm"], eps), p["q_b_proj"], opts, valid_rows=rows)
    else:
        q = ops.linear(x, p["q_proj"], opts, valid_rows=rows)
    q = q.reshape(T, H, nope + R)  # [T, H, nope + R]
    kv = ops.linear(x, p["kv_a_proj"], opts, valid_rows=rows)  # [T, L + R]
    cos, sin = rope
    c = _rms_norm(kv[:, :L], p["kv_a_norm"], eps)  # [T, L]
    k_pe, q_pe = kv[:, L:], q[..., nope:]  # [T, R], [T, H, R]
    if m.rope:  # else NoPE (Kimi Linear): the R channels as projected
        k_pe = _rope(k_pe[:, None], cos, sin, m.rope_interleave)[:, 0]
        q_pe = _rope(q_pe, cos, sin, m.rope_interleave)

    page_size = latent.page_size
    slots = jnp.where(batch.slot_mapping < 0, -1, batch.slot_mapping + page_offset * page_size)
    new_rows, max_seqs = jnp.concatenate([c, k_pe], axis=-1), batch.block_tables.shape[0]  # [T, L + R]

    w_kv_b = absorbed_weight(p["kv_b_proj"]).reshape(L, H, nope + m.v_head_dim)  # [L, H, nope + V]
    w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
    q_latent = jnp.einsum("thn,lhn->thl", q[..., :nope], w_uk.astype(q.dtype))  # [T, H, L]
    q_abs = jnp.concatenate([q_latent, q_pe], axis=-1)  # [T, H, L + R]
    if opts.tp is not None and opts.tp.latent_split:  # the pool's tokens split over the chips (models/mla_split.py)
        out, latent = mla_split.split_mla(
            q_abs,
            new_rows,
            slots,
            latent,
            batch,
            batch.block_tables + page_offset,
            tp=opts.tp,
            sm_scale=m.softmax_scale,
            v_dim=L,
            write=lambda lat, r, s: write_latent(lat, r, s, opts, max_seqs),
        )
    else:
        latent = write_latent(latent, new_rows, slots, opts, max_seqs)
        out = _attend(q_abs, latent, batch, page_offset, cfg, opts)  # [T, H, L]
    o = jnp.einsum("thl,lhv->thv", out, w_uv.astype(out.dtype)).reshape(T, H * m.v_head_dim)
    return ops.linear(o, p["o_proj"], opts, valid_rows=rows), latent


def _attend(q_abs, latent: mla.LatentPages, batch: ForwardBatch, page_offset, cfg: ModelConfig, opts):
    """The MLA op over the (replicated) pool: [T, H, L]; heads split under TP."""
    impl = mla_impl(opts, latent)
    attend = functools.partial(
        mla.mla_ragged_paged_attention,
        sm_scale=cfg.mla.softmax_scale,
        v_dim=cfg.mla.kv_lora_rank,
        impl=impl,
        interpret=opts.interpret,
    )
    if opts.tp is not None and mla.KERNELS[impl].per_shard:  # a kernel cannot be split by GSPMD: shard_map
        heads = P(None, opts.tp.axis) if opts.tp.attention else P()  # q, out [T, H, .]; the rows whole
        attend = jax.shard_map(
            attend, mesh=opts.tp.mesh, in_specs=(heads,) + (P(),) * 5, out_specs=heads, check_vma=False
        )
    return attend(q_abs, latent, batch.kv_lens, batch.block_tables + page_offset, batch.cu_q_lens, batch.num_seqs)
