"""The CPU plan's native kernels and weight layout against the jnp paths they replace, side by side.

    python -m benchmarks.cpu_native --json benchmarks/results/cpu-2core-r8/cpu-native.json
    python -m benchmarks.cpu_native --engine .cache/peers/tiny-llama .cache/peers/qwen3_5-small \
        .cache/peers/smollm2-135m-hf            # + the engine's decode step with / without them

Parts (each a ratio of two spellings in one process, best of 3 x 10 calls):
- decode attention: SmolLM2-135M's heads (Hq 9, Hkv 3, D 64), 16 rows of 150-260 bf16 tokens,
  30 layers each with its own page pool (so pages come from memory, as in a step):
  `pallas_kernels/cpu_native.ragged_paged_attention` vs the jnp decode pass of
  `rpa_chunked` (impl "native" vs "chunked");
- prefill attention: the same heads, 4 fresh 128-token prompts in one ragged step, 30 layers;
- GDN recurrence: the hybrid's GDN shape (H 8, Hk 4, K = V = 128), 16 one-token rows,
  6 layers each with its own state pool: `cpu_native.gdn_recurrent` vs the jnp per-token loop;
- projections: SmolLM2's 30 layers of q/k/v/o/gate/up/down dots in bf16 at 4 / 16 / 64 / 512
  rows, weights [in, out] vs [out, in] (`models.quantization.OutInWeight`, XLA's dot) vs packed
  for the native matmul (`models.quantization.PackedWeight`).
`--engine`: the median ms of an engine decode step (16 sequences, bf16, `benchmarks.cpu_dtype`)
in fresh processes with the native kernels on and off (`JAXSERVE_NATIVE=0`), alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import write_json
from benchmarks.cpu_dtype import _time


def _attention_stack_ms(q, pools, kv_lens, tables, cu, num_seqs: int, D: int) -> dict:
    """ms for `q` through one ragged attention call per pool (a layer each): jnp "chunked" vs "native"."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    def stack(impl):
        def run(q, pools):
            for kv in pools:
                q = ragged_paged_attention(q, kv, kv_lens, tables, cu, jnp.int32(num_seqs), sm_scale=D**-0.5, impl=impl)
            return q

        return jax.jit(run)

    return {impl: _time(stack(impl), q, pools) for impl in ("chunked", "native")}


def attention(layers: int = 30, rows: int = 16, pages: int = 4096) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kv_cache import KVPages

    Hq, Hkv, D, ps, MB = 9, 3, 64, 16, 128
    rng = np.random.default_rng(0)
    bits = lambda: jax.lax.bitcast_convert_type(
        jnp.asarray(rng.standard_normal((pages, Hkv, ps, D)), jnp.bfloat16), jnp.uint16
    )
    pools = [KVPages(k=bits(), v=bits(), view="bfloat16") for _ in range(layers)]
    tables = jnp.asarray(1 + rng.permutation(pages - 1)[: rows * MB].reshape(rows, MB).astype(np.int32))
    kv_lens = jnp.asarray(rng.integers(150, 260, rows).astype(np.int32))
    cu = jnp.arange(rows + 1, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, Hq, D)), jnp.bfloat16)

    out = _attention_stack_ms(q, pools, kv_lens, tables, cu, rows, D)
    return {"layers": layers, "rows": rows, "ms": out, "speedup": out["chunked"] / out["native"]}


def gdn(layers: int = 6, rows: int = 16) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gdn import gated_delta_rule

    H, Hk, K, V, slots = 8, 4, 128, 128, 2 * rows + 1
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    q = f(rows, Hk, K) / np.sqrt(K)
    k = f(rows, Hk, K) / np.sqrt(K)
    v, g, beta = f(rows, H, V), -jnp.abs(f(rows, H)) * 0.1, jax.nn.sigmoid(f(rows, H))
    pools = [f(slots, H, K, V) * 0.1 for _ in range(layers)]
    cu = jnp.arange(rows + 1, dtype=jnp.int32)
    slot_ids = jnp.arange(1, rows + 1, dtype=jnp.int32)
    init = jnp.ones(rows, bool)

    def stack(impl):
        def run(pools):
            outs, new = [], []
            for pool in pools:
                o, pool = gated_delta_rule(q, k, v, g, beta, pool, cu, slot_ids, init, jnp.int32(rows), impl=impl)
                outs.append(o)
                new.append(pool)
            return outs, new

        return jax.jit(run, donate_argnums=0)

    out = {}
    for impl in ("chunked", "native"):  # 16 tokens: "chunked" is the jnp per-token loop there
        fn = stack(impl)
        state = [p.copy() for p in pools]
        _, state = fn(state)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(10):
                _, state = fn(state)
            jax.block_until_ready(state)
            best = min(best, (time.perf_counter() - t) / 10)
        out[impl] = best * 1e3
    return {"layers": layers, "rows": rows, "ms": out, "speedup": out["chunked"] / out["native"]}


def projections(layers: int = 30) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from models.quantization import out_in, packed, qdot

    H, I, Hq, Hkv, D = 576, 1536, 9, 3, 64
    rng = np.random.default_rng(2)
    shapes = dict(q=(H, Hq * D), k=(H, Hkv * D), v=(H, Hkv * D), o=(Hq * D, H), g=(H, I), u=(H, I), d=(I, H))
    in_out = [
        {n: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.02, jnp.bfloat16) for n, s in shapes.items()}
        for _ in range(layers)
    ]
    transposed = [{n: out_in(w) for n, w in layer.items()} for layer in in_out]
    native = [{n: packed(w) for n, w in layer.items()} for layer in in_out]

    def run(x, params):
        for w in params:
            h = x * lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6).astype(x.dtype)
            a, b, c = qdot(h, w["q"]), qdot(h, w["k"]), qdot(h, w["v"])
            x = x + qdot(a, w["o"]) + 1e-3 * (b[:, :1] + c[:, :1])
            x = x + qdot(jax.nn.silu(qdot(x, w["g"])) * qdot(x, w["u"]), w["d"])
        return x

    fn = jax.jit(run)
    out = {}
    for rows in (4, 16, 64, 512):
        x = jnp.ones((rows, H), jnp.bfloat16)
        ms = {"in_out": _time(fn, x, in_out), "out_in": _time(fn, x, transposed), "packed": _time(fn, x, native)}
        out[rows] = {
            "ms": ms,
            "speedup_out_in": ms["in_out"] / ms["out_in"],
            "speedup_packed": ms["out_in"] / ms["packed"],
        }
    return {"layers": layers, "rows": out}


def prefill_attention(layers: int = 30, seqs: int = 4, length: int = 128) -> dict:
    """SmolLM2's heads, `seqs` fresh prompts of `length` tokens in one ragged step (causal), each
    layer its own pool: the C++ ragged kernel vs the jnp chunked path (impl "native" vs "chunked")."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kv_cache import KVPages

    Hq, Hkv, D, ps, pages = 9, 3, 64, 16, 1024
    rng = np.random.default_rng(3)
    bits = lambda: jax.lax.bitcast_convert_type(
        jnp.asarray(rng.standard_normal((pages, Hkv, ps, D)), jnp.bfloat16), jnp.uint16
    )
    pools = [KVPages(k=bits(), v=bits(), view="bfloat16") for _ in range(layers)]
    mb = length // ps
    tables = jnp.asarray(1 + rng.permutation(pages - 1)[: seqs * mb].reshape(seqs, mb).astype(np.int32))
    kv_lens = jnp.full((seqs,), length, jnp.int32)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32) * length
    q = jnp.asarray(rng.standard_normal((seqs * length, Hq, D)), jnp.bfloat16)

    out = _attention_stack_ms(q, pools, kv_lens, tables, cu, seqs, D)
    return {"layers": layers, "seqs": seqs, "length": length, "ms": out, "speedup": out["chunked"] / out["native"]}


def engine(checkpoints: list[str], repeats: int) -> dict:
    report = {}
    for checkpoint in checkpoints:
        runs: dict[str, list[float]] = {"native": [], "jnp": []}
        for r in range(repeats):
            for label in ("native", "jnp") if r % 2 == 0 else ("jnp", "native"):
                env = {**os.environ, "JAXSERVE_NATIVE": "1" if label == "native" else "0"}
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.cpu_dtype", "--one", checkpoint, "bfloat16", "auto"],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                runs[label].append(json.loads(out.stdout.strip().splitlines()[-1])["ms"])
                print(f"{Path(checkpoint).name} {label}: {runs[label][-1]:.1f} ms/step", flush=True)
        med = {k: float(np.median(v)) for k, v in runs.items()}
        report[Path(checkpoint).name] = {"runs_ms": runs, "median_ms": med, "speedup": med["jnp"] / med["native"]}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", nargs="*", default=[], metavar="CHECKPOINT")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from pallas_kernels import cpu_native

    if not cpu_native.available():
        print(f"native kernels unavailable: {cpu_native._state.get('error')}", file=sys.stderr)
        return 1
    report: dict = {"cpu_count": os.cpu_count()}
    for name, part in (
        ("decode_attention", attention),
        ("prefill_attention", prefill_attention),
        ("gdn_recurrent", gdn),
        ("projections", projections),
    ):
        report[name] = part()
        print(name, json.dumps(report[name]), flush=True)
    if args.engine:
        report["engine_decode_step_bf16"] = engine(args.engine, args.repeats)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
