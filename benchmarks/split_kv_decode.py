"""Split-KV decode grid for small batches (GPU): does splitting each sequence's pages over S
programs beat the one-program-per-(sequence, kv head) kernel and XLA at batch <= 16?

    python -m benchmarks.split_kv_decode --json out.json        # on a GPU: the grid, timed
    python -m benchmarks.split_kv_decode --check                # anywhere: kernel vs reference, interpret

The serving kernel (pallas_kernels/rpa_kernel_gpu.py) runs one program per (query block, kv head):
a decode step of B sequences is B x Hkv programs, which leaves most of an H200's 132 SMs idle at
small B (docs/kernels.md: it loses to XLA's gather reference at B <= 8). Flash-decoding splits the
context: program (b, h, s) walks pages [s * n / S, (s + 1) * n / S) of sequence b and writes its
unnormalised partial output with its running max and sum; a jnp combine rescales the S partials
(out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s). This prototype (decode only: one query per
sequence, no window, no soft cap) is here to measure that grid before the serving kernel takes it.
Per (batch, context, KV dtype) it times: the serving kernel (`pallas`), XLA's reference
(`reference`), and split-KV with S in `--splits`; each split result is checked against the
reference before it is timed (max abs error in the row).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_cache import KVPages
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.rpa_common import MASK_VALUE

ATTN = dict(q_heads=32, kv_heads=8, head_dim=128)  # benchmarks/kernels.py's decode shape (Llama-3-8B)


def _split_kernel(kv_lens_ref, block_tables_ref, q_ref, k_ref, v_ref, *rest, splits, sm_scale, quantized):
    if quantized:
        k_scale_ref, v_scale_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    b, head, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    rows = q_ref.shape[2]
    kv_len = kv_lens_ref[b]
    num_pages = (kv_len + page_size - 1) // page_size
    per_split = (num_pages + splits - 1) // splits
    lo = s * per_split
    hi = jnp.minimum(lo + per_split, num_pages)
    q = q_ref[b, head, :, :]  # [rows, D]
    col = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    v_row = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)

    def attend_page(block, carry):
        m_prev, l_prev, acc_prev = carry
        page = block_tables_ref[b, block]
        k = k_ref[page, head, :, :].astype(q.dtype)  # [ps, D]
        v = v_ref[page, head, :, :].astype(q.dtype)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [rows, ps]
        if quantized:
            scores = scores * k_scale_ref[page, head]
        visible = block * page_size + col < kv_len
        scores = jnp.where(visible, scores * sm_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        probs = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_next = alpha * l_prev + jnp.sum(probs, axis=1)
        if quantized:
            probs = jnp.where(visible, probs * v_scale_ref[page, head], 0.0)
        v = jnp.where(block * page_size + v_row < kv_len, v, jnp.zeros((), q.dtype))
        pv = jnp.dot(probs.astype(q.dtype), v, preferred_element_type=jnp.float32)
        return m_next, l_next, alpha[:, None] * acc_prev + pv

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(lo, hi, attend_page, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


@functools.partial(jax.jit, static_argnames=("splits", "sm_scale", "interpret"))
def split_kv_decode(q, kv: KVPages, kv_lens, block_tables, *, splits: int, sm_scale: float, interpret=False):
    """q: [B, Hq, D] (one query per sequence, at position kv_len - 1); pages as ragged_paged_attention.
    Returns [B, Hq, D] in q's dtype."""
    B, num_q_heads, head_dim = q.shape
    hkv = kv.num_kv_heads
    group = num_q_heads // hkv
    rows = max(16, 1 << (group - 1).bit_length())  # Triton tiles: a power of two, at least 16
    q_rows = jnp.pad(q.reshape(B, hkv, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    inputs = [kv_lens, block_tables, q_rows, kv.k, kv.v] + ([kv.k_scale, kv.v_scale] if kv.quantized else [])
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    kernel = functools.partial(_split_kernel, splits=splits, sm_scale=sm_scale, quantized=kv.quantized)
    acc, m, l_sum = pl.pallas_call(
        kernel,
        grid=(B, hkv, splits),
        in_specs=[full(x) for x in inputs],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, hkv, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((B, hkv, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((B, hkv, splits, rows), jnp.float32),
        ],
        interpret=interpret,
    )(*inputs)
    top = jnp.max(m, axis=2, keepdims=True)  # [B, Hkv, 1, rows]
    weight = jnp.exp(m - top)  # empty splits: exp(MASK_VALUE - top) = 0
    out = jnp.sum(weight[..., None] * acc, axis=2) / jnp.sum(weight * l_sum, axis=2)[..., None]
    return out[:, :, :group].reshape(B, num_q_heads, head_dim).astype(q.dtype)


def _case(key, batch, context, page_size, kv_dtype, attn):
    pages_per_seq = -(-context // page_size)
    shape = (1 + batch * pages_per_seq, attn["kv_heads"], page_size, attn["head_dim"])
    kk, vk, qk = jax.random.split(key, 3)
    k = jax.random.normal(kk, shape, jnp.float32).astype(kv_dtype)
    v = jax.random.normal(vk, shape, jnp.float32).astype(kv_dtype)
    fp8 = jnp.dtype(kv_dtype).itemsize == 1
    scale = (lambda: jnp.full(shape[:2], 0.5, jnp.float32)) if fp8 else (lambda: None)
    kv = KVPages(k=k, v=v, k_scale=scale(), v_scale=scale())
    tables = (1 + jnp.arange(batch)[:, None] * pages_per_seq + jnp.arange(pages_per_seq)).astype(jnp.int32)
    kv_lens = jnp.full((batch,), context, jnp.int32) - jnp.arange(batch, dtype=jnp.int32) % page_size
    q = jax.random.normal(qk, (batch, attn["q_heads"], attn["head_dim"]), jnp.float32).astype(jnp.bfloat16)
    return q, kv, kv_lens, tables


def _rpa(impl, q, kv, kv_lens, tables, interpret=False):
    B = q.shape[0]
    cu = jnp.arange(B + 1, dtype=jnp.int32)
    return ragged_paged_attention(
        q, kv, kv_lens, tables, cu, jnp.int32(B), sm_scale=q.shape[-1] ** -0.5, impl=impl, interpret=interpret
    )


def _time(fn, repeats):
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_grid(args) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    for kv_name in args.kv_dtypes.split(","):
        kv_dtype = {"bf16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn}[kv_name]
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                q, kv, kv_lens, tables = _case(key, batch, context, args.page_size, kv_dtype, ATTN)
                kv_bytes = (
                    2 * int(jnp.sum(kv_lens)) * ATTN["kv_heads"] * ATTN["head_dim"] * jnp.dtype(kv_dtype).itemsize
                )
                want = _rpa("reference", q, kv, kv_lens, tables)
                row = {"kv_dtype": kv_name, "batch": batch, "context": context, "kv_bytes": kv_bytes, "ms": {}}
                variants = {"pallas": lambda: _rpa("pallas", q, kv, kv_lens, tables)}
                variants["reference"] = lambda: _rpa("reference", q, kv, kv_lens, tables)
                for s in map(int, args.splits.split(",")):
                    variants[f"split{s}"] = functools.partial(
                        split_kv_decode, q, kv, kv_lens, tables, splits=s, sm_scale=ATTN["head_dim"] ** -0.5
                    )
                for name, fn in variants.items():
                    try:
                        got = fn()
                        row.setdefault("max_abs_err", {})[name] = float(
                            jnp.max(jnp.abs(got - want).astype(jnp.float32))
                        )
                        row["ms"][name] = 1e3 * _time(fn, args.repeats)
                    except Exception as err:  # a variant failing (e.g. out of memory) is a row entry
                        row["ms"][name] = None
                        row.setdefault("errors", {})[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                best = min((v, k) for k, v in row["ms"].items() if v is not None)
                row["best"] = best[1]
                print(
                    f"{kv_name} B={batch:<3} ctx={context:<6} "
                    + " ".join(f"{k}={v:.3f}" if v is not None else f"{k}=fail" for k, v in row["ms"].items())
                    + f" ms  best {best[1]}",
                    flush=True,
                )
                rows.append(row)
    return rows


def check(interpret=True) -> float:
    """The split kernel against the reference on a tiny case (CPU: Pallas interpret mode)."""
    attn = dict(q_heads=6, kv_heads=2, head_dim=64)
    worst = 0.0
    for kv_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        q, kv, kv_lens, tables = _case(jax.random.key(1), 3, 70, 16, kv_dtype, attn)
        want = _rpa("reference", q, kv, kv_lens, tables).astype(jnp.float32)
        for s in (1, 2, 3, 8):
            got = split_kv_decode(q, kv, kv_lens, tables, splits=s, sm_scale=64**-0.5, interpret=interpret)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
            worst = max(worst, err)
            if not err <= 2e-2 * float(jnp.max(jnp.abs(want))):
                raise AssertionError(f"split {s}, {jnp.dtype(kv_dtype).name}: max abs error {err}")
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--splits", default="2,4,8,16")
    parser.add_argument("--kv-dtypes", default="bf16,fp8_e4m3")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="only the interpret-mode check against the reference")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.check:
        print(f"split-KV decode matches the reference (max abs error {check():.2e})")
        return
    print(f"device: {jax.devices()[0].device_kind}; check: max abs error {check(interpret=False):.2e}", flush=True)
    rows = run_grid(args)
    if args.json:
        meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "attention": ATTN, **vars(args)}
        with open(args.json, "w") as out:
            json.dump({"meta": meta, "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
