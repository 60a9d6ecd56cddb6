"""Kernel micro-benchmarks: time each op over serving shapes, report achieved bandwidth or
FLOP rate and its ratio to the device roofline.

    python -m benchmarks.kernels --impl pallas            # on an H200 / TPU: the real numbers
    python -m benchmarks.kernels --impl reference --quick # anywhere: proves the script runs
    python -m benchmarks.kernels --only rpa_decode,gdn_decode --json kernels.json

Ops and what is reported (bytes and FLOPs are the algorithmic minimum, not what a kernel moves):
  rpa_decode   ragged paged attention, one query per sequence, batch 1-256 x context 1k-32k:
               GB/s of KV read (K and V of every context token, plus FP8 scales).
  rpa_prefill  one sequence of T = 512-8k tokens, causal: TFLOP/s (4 * Hq * D * T^2 / 2).
  kv_write     scatter T tokens' K/V into pages: GB/s of K/V written.
  gdn_prefill  gated delta rule, one sequence of T = 512-8k tokens: TFLOP/s of the chunked
               (WY, C = 64) form, per token and head 2C(3K + 2V) + 6KV.
  gdn_decode   one token for each of B sequences: GB/s of recurrent state read + written.
  causal_conv  depthwise conv (width 4) over T tokens of C = 2 Hk K + H V channels: GB/s.
  hbm_copy     XLA's own elementwise pass over a large bf16 array (read + write): the HBM
               bandwidth a kernel can reach on this device, to read the roofline against.
Shapes follow a Llama-3-8B attention layer (Hq 32, Hkv 8, D 128) and a Qwen3-Next GDN layer
(Hk 16, H 32, K = V = 128). Times are the median of `--repeats` runs after one warm-up
(compile) call. Rooflines are spec-sheet figures (H200 4.8 TB/s HBM and 989 dense bf16
TFLOP/s; H100 SXM 3.35 TB/s / 989 TFLOP/s; TPU v5e 819 GB/s / 197 TFLOP/s, v6e 1640 GB/s /
918 TFLOP/s, v5p 2765 GB/s / 459 TFLOP/s); `hbm_copy` measures what is reachable in practice
(docs/kernels.md has the H200 run). CPU has no roofline here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.causal_conv1d import causal_conv1d
from pallas_kernels.gdn import gated_delta_rule
from pallas_kernels.kv_cache import KVPages
from pallas_kernels.kv_write import write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

# device_kind -> (HBM bytes/s, dense bf16 FLOP/s)
ROOFLINES = {
    "NVIDIA H200": (4.8e12, 989e12),
    "NVIDIA H100 80GB HBM3": (3.35e12, 989e12),
    "TPU v5 lite": (819e9, 197e12),
    "TPU v6 lite": (1640e9, 918e12),
    "TPU v5": (2765e9, 459e12),
}
OPS = ("rpa_decode", "rpa_prefill", "kv_write", "gdn_prefill", "gdn_decode", "causal_conv", "hbm_copy")
KV_DTYPES = {"bf16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
FULL = {
    "rpa_decode": [(b, c) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)],
    "rpa_prefill": [512, 2048, 8192],
    "kv_write": [256, 8192],
    "gdn_prefill": [512, 2048, 8192],
    "gdn_decode": [1, 64, 256],
    "causal_conv": [512, 8192],
    "hbm_copy": [2**30, 2**32],
}
QUICK = {
    "rpa_decode": [(1, 1024), (4, 1024)],
    "rpa_prefill": [256],
    "kv_write": [64],
    "gdn_prefill": [128],
    "gdn_decode": [4],
    "causal_conv": [256],
    "hbm_copy": [2**20],
}
ATTN = dict(q_heads=32, kv_heads=8, head_dim=128)
GDN = dict(key_heads=16, heads=32, key_dim=128, value_dim=128, chunk=64, conv_width=4)
QUICK_ATTN = dict(q_heads=8, kv_heads=2, head_dim=128)
QUICK_GDN = dict(key_heads=2, heads=4, key_dim=128, value_dim=128, chunk=64, conv_width=4)


def time_call(fn, args, repeats):
    """Median seconds of `fn(*args)` over `repeats` runs, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _paged_kv(key, num_seqs, context, attn, page_size, kv_dtype):
    """Pages for `num_seqs` sequences of `context` tokens, consecutive after the null page."""
    pages_per_seq = -(-context // page_size)
    shape = (1 + num_seqs * pages_per_seq, attn["kv_heads"], page_size, attn["head_dim"])
    k_key, v_key = jax.random.split(key)
    k, v = _normal(k_key, shape, kv_dtype), _normal(v_key, shape, kv_dtype)
    fp8 = jnp.dtype(kv_dtype).itemsize == 1
    scale = (lambda: jnp.ones(shape[:2], jnp.float32)) if fp8 else (lambda: None)
    kv = KVPages(k=k, v=v, k_scale=scale(), v_scale=scale())
    tables = 1 + jnp.arange(num_seqs)[:, None] * pages_per_seq + jnp.arange(pages_per_seq)
    return kv, tables.astype(jnp.int32)


def bench_rpa(case, *, decode, attn, page_size, kv_dtype, impl, repeats, key, **_):
    num_seqs, context = case if decode else (1, case)
    q_len = 1 if decode else context
    kv, tables = _paged_kv(key, num_seqs, context, attn, page_size, kv_dtype)
    q = _normal(key, (num_seqs * q_len, attn["q_heads"], attn["head_dim"]), jnp.bfloat16)
    args = (
        q,
        kv,
        jnp.full((num_seqs,), context, jnp.int32),
        tables,
        (jnp.arange(num_seqs + 1) * q_len).astype(jnp.int32),
        jnp.int32(num_seqs),
    )
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=attn["head_dim"] ** -0.5, impl=impl))
    seconds = time_call(fn, args, repeats)
    if decode:
        kv_bytes = num_seqs * context * kv.bytes_per_token()
        return dict(shape=f"B={num_seqs} ctx={context}", seconds=seconds, bytes=kv_bytes)
    flops = 4 * attn["q_heads"] * attn["head_dim"] * context * context / 2
    return dict(shape=f"T={context}", seconds=seconds, flops=flops)


def bench_kv_write(tokens, *, attn, page_size, kv_dtype, repeats, key, **_):
    kv, _ = _paged_kv(key, 1, tokens, attn, page_size, kv_dtype)
    new = _normal(key, (tokens, attn["kv_heads"], attn["head_dim"]), jnp.bfloat16)
    slots = (page_size + jnp.arange(tokens)).astype(jnp.int32)
    seconds = time_call(write_kv, (kv, new, new, slots), repeats)
    return dict(shape=f"T={tokens}", seconds=seconds, bytes=tokens * kv.bytes_per_token())


def _gdn_args(key, tokens, num_seqs, gdn):
    keys = jax.random.split(key, 5)
    hk, h, kd, vd = gdn["key_heads"], gdn["heads"], gdn["key_dim"], gdn["value_dim"]
    unit = lambda x: x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True).astype(x.dtype)
    q = unit(_normal(keys[0], (tokens, hk, kd), jnp.bfloat16)) * kd**-0.5
    k = unit(_normal(keys[1], (tokens, hk, kd), jnp.bfloat16))
    v = _normal(keys[2], (tokens, h, vd), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (tokens, h)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (tokens, h)))
    state = jnp.zeros((num_seqs + 1, h, kd, vd), jnp.float32)
    per_seq = tokens // num_seqs
    cu = (jnp.arange(num_seqs + 1) * per_seq).astype(jnp.int32)
    slots = (1 + jnp.arange(num_seqs)).astype(jnp.int32)
    return (q, k, v, g, beta, state, cu, slots, jnp.ones((num_seqs,), bool), jnp.int32(num_seqs))


def bench_gdn(case, *, decode, gdn, impl, repeats, key, **_):
    num_seqs, tokens = (case, case) if decode else (1, case)
    args = _gdn_args(key, tokens, num_seqs, gdn)
    fn = jax.jit(lambda *a: gated_delta_rule(*a, impl=impl, chunk_size=gdn["chunk"]))
    seconds = time_call(fn, args, repeats)
    h, kd, vd, c = gdn["heads"], gdn["key_dim"], gdn["value_dim"], gdn["chunk"]
    if decode:
        return dict(shape=f"B={num_seqs}", seconds=seconds, bytes=2 * num_seqs * h * kd * vd * 4)
    flops = tokens * h * (2 * c * (3 * kd + 2 * vd) + 6 * kd * vd)
    return dict(shape=f"T={tokens}", seconds=seconds, flops=flops)


def bench_conv(tokens, *, gdn, impl, repeats, key, **_):
    channels = 2 * gdn["key_heads"] * gdn["key_dim"] + gdn["heads"] * gdn["value_dim"]
    width = gdn["conv_width"]
    x = _normal(key, (tokens, channels), jnp.bfloat16)
    weight = _normal(key, (channels, width), jnp.bfloat16)
    state = jnp.zeros((2, width - 1, channels), jnp.float32)
    args = (x, weight, state, jnp.int32([0, tokens]), jnp.int32([1]), jnp.bool_([True]), jnp.int32(1))
    fn = jax.jit(lambda *a: causal_conv1d(*a, impl=impl))
    seconds = time_call(fn, args, repeats)
    return dict(shape=f"T={tokens} C={channels}", seconds=seconds, bytes=2 * tokens * channels * 2)


def bench_copy(elements, *, repeats, key, **_):
    x = _normal(key, (elements,), jnp.bfloat16)
    seconds = time_call(jax.jit(lambda x: x * 2), (x,), repeats)
    return dict(shape=f"{2 * elements / 2**20:.0f} MiB", seconds=seconds, bytes=2 * 2 * elements)


def run(ops, *, impl, quick, kv_dtype, page_size, repeats):
    device = jax.devices()[0]
    roofline = ROOFLINES.get(device.device_kind)
    cases = QUICK if quick else FULL
    attn, gdn = (QUICK_ATTN, QUICK_GDN) if quick else (ATTN, GDN)
    common = dict(
        attn=attn,
        gdn=gdn,
        page_size=page_size,
        kv_dtype=KV_DTYPES[kv_dtype],
        impl=impl,
        repeats=repeats,
        key=jax.random.key(0),
    )
    runners = {
        "rpa_decode": lambda c: bench_rpa(c, decode=True, **common),
        "rpa_prefill": lambda c: bench_rpa(c, decode=False, **common),
        "kv_write": lambda c: bench_kv_write(c, **common),
        "gdn_prefill": lambda c: bench_gdn(c, decode=False, **common),
        "gdn_decode": lambda c: bench_gdn(c, decode=True, **common),
        "causal_conv": lambda c: bench_conv(c, **common),
        "hbm_copy": lambda c: bench_copy(c, **common),
    }
    rows = []
    for op in ops:
        for case in cases[op]:
            try:
                row = runners[op](case)
            except Exception as error:  # e.g. out of device memory at the largest shapes
                row = dict(shape=str(case), seconds=None, error=f"{type(error).__name__}: {error}"[:200])
            row = dict(op=op, impl=impl, kv_dtype=kv_dtype, device=device.device_kind, **row)
            if row["seconds"]:
                if "bytes" in row:
                    row["achieved"] = row["bytes"] / row["seconds"] / 1e9
                    row["unit"] = "GB/s"
                    row["roofline_fraction"] = row["bytes"] / row["seconds"] / roofline[0] if roofline else None
                else:
                    row["achieved"] = row["flops"] / row["seconds"] / 1e12
                    row["unit"] = "TFLOP/s"
                    row["roofline_fraction"] = row["flops"] / row["seconds"] / roofline[1] if roofline else None
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row) -> str:
    if row["seconds"] is None:
        return f"| {row['op']} | {row['shape']} | failed: {row['error']} | | |"
    fraction = row["roofline_fraction"]
    share = "no roofline" if fraction is None else f"{100 * fraction:.1f}%"
    return (
        f"| {row['op']} | {row['shape']} | {1e3 * row['seconds']:.3f} | {row['achieved']:.4g} {row['unit']} | {share} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=("pallas", "reference"), default="pallas")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--only", default=",".join(OPS), help=f"comma list of {OPS}")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    ops = [op for op in args.only.split(",") if op]
    unknown = set(ops) - set(OPS)
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    if args.impl == "pallas" and jax.default_backend() == "cpu":
        parser.error(
            "--impl pallas needs a TPU or GPU (the CPU runs the kernels only in interpret "
            "mode, which says nothing about speed); use --impl reference here"
        )
    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), impl {args.impl}, "
        f"KV {args.kv_dtype}, page size {args.page_size}\n"
    )
    print("| op | shape | ms | achieved | of spec-sheet roofline |\n|---|---|---:|---:|---:|")
    rows = run(
        ops, impl=args.impl, quick=args.quick, kv_dtype=args.kv_dtype, page_size=args.page_size, repeats=args.repeats
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
