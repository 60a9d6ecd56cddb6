"""bf16 vs float32 on the CPU backend: why `runtime/steps/execution_plan.py` unrolls bf16 layers, measured.

    python -m benchmarks.cpu_dtype --ops                               # the dot spellings alone
    python -m benchmarks.cpu_dtype --breakdown .cache/peers/smollm2-135m-hf   # a decode step's matmuls / attention
    python -m benchmarks.cpu_dtype .cache/peers/tiny-llama .cache/peers/smollm2-135m-hf --repeats 3

`--ops`: XLA:CPU matmuls as jnp spells them, [16, 576] rows (SmolLM2's hidden size), bf16:
a bf16-output dot vs the float32-accumulating one `models.quantization.qdot` uses, inside a
30-layer scan vs unrolled, and the tied LM head as `embed.T` vs contracted in place; float32
for comparison. Engine mode: one decode step of 16 sequences (128-token prompts, then greedy
decode; the median ms per `engine.step()` over 30 steps) for float32, bf16 with the plan's
layers (unrolled) and bf16 with the layers scanned, each engine in a fresh process, the
variants alternated in every repeat.

`--breakdown CKPT`: the two big parts of a bf16 decode step of 16 sequences (~200-token
contexts) of a dense checkpoint, each jitted alone with the checkpoint's shapes: every
projection and MLP matmul of every layer plus the tied LM head, and every layer's attention
(`ragged_paged_attention_chunked`, bf16 pages); compare with the engine's step time.
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

VARIANTS = (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "scan"))


def _time(fn, *args, reps: int = 10) -> float:
    """Best of 3 batches of `reps` calls, ms per call (`fn` may return a pytree)."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def ops() -> dict:
    """ms of each dot spelling (best of 3 x 10 calls)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    L, H, I, V, M = 30, 576, 1536, 49152, 16
    dims = (((1,), (0,)), ((), ()))

    def bf16_out(a, b):
        return a @ b

    def f32_acc(a, b):
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(a.dtype)

    def mlp_scan(dot):
        def run(x, up, down):
            def body(h, w):
                return dot(dot(h, w[0]), w[1]) * 0.001, None

            return lax.scan(body, x, (up, down))[0]

        return jax.jit(run)

    def mlp_unrolled(dot):
        def run(x, ups, downs):
            for w_up, w_down in zip(ups, downs):
                x = dot(dot(x, w_up), w_down) * 0.001
            return x

        return jax.jit(run)

    out = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dtype).name
        x = jnp.ones((M, H), dtype)
        up, down = jnp.ones((L, H, I), dtype), jnp.ones((L, I, H), dtype)
        ups, downs = [up[i] for i in range(L)], [down[i] for i in range(L)]
        spellings = (("bf16_out", bf16_out), ("f32_acc", f32_acc)) if dtype == jnp.bfloat16 else (("f32", f32_acc),)
        for label, dot in spellings:
            out[f"{name} 30-layer MLP, scan, {label}"] = _time(mlp_scan(dot), x, up, down)
            out[f"{name} 30-layer MLP, unrolled, {label}"] = _time(mlp_unrolled(dot), x, ups, downs)
        embed = jnp.ones((V, H), dtype)
        out[f"{name} tied head, embed.T"] = _time(jax.jit(lambda h, e: f32_acc(h, e.T)), x, embed)
        out[f"{name} tied head, contracted in place"] = _time(
            jax.jit(lambda h, e: lax.dot_general(h, e, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)),
            x,
            embed,
        )
    return out


def breakdown(checkpoint: str, rows: int = 16) -> dict:
    """ms of one decode step's matmuls alone and attention alone (see the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.kv_cache import KVPages
    from pallas_kernels.rpa_chunked import ragged_paged_attention_chunked

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    L, H, I, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or H // Hq
    bf = jnp.bfloat16

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(bf)

    shapes = dict(q=(H, Hq * D), k=(H, Hkv * D), v=(H, Hkv * D), o=(Hq * D, H), g=(H, I), u=(H, I), d=(I, H))
    layers = [{n: jnp.ones(s, bf) for n, s in shapes.items()} for _ in range(L)]

    def matmuls(x, layers, embed):
        for w in layers:
            q, k, v = dot(x, w["q"]), dot(x, w["k"]), dot(x, w["v"])
            x = x + dot(q * 0.01, w["o"]) + 1e-3 * (k[:, :1] + v[:, :1])  # k, v used: not dead code
            x = x + dot(jax.nn.silu(dot(x, w["g"])) * dot(x, w["u"]), w["d"]) * 0.001
        return lax.dot_general(x, embed, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    pages_per_seq, page_size = 17, 16
    kv = KVPages.create(rows * pages_per_seq + 1, page_size, Hkv, D, dtype=bf, bit_storage=True)
    tables = 1 + np.arange(rows * pages_per_seq, dtype=np.int32).reshape(rows, pages_per_seq)
    kv_lens = np.random.default_rng(0).integers(150, 260, rows).astype(np.int32)
    cu = np.arange(rows + 1, dtype=np.int32)

    def attention(q, kv, kv_lens, tables, cu):
        for _ in range(L):
            q = ragged_paged_attention_chunked(q, kv, kv_lens, tables, cu, jnp.int32(rows), sm_scale=D**-0.5)
        return q

    return {
        "layers": L,
        "rows": rows,
        "matmuls_ms": _time(jax.jit(matmuls), jnp.ones((rows, H), bf), layers, jnp.ones((V, H), bf)),
        "attention_ms": _time(jax.jit(attention), jnp.ones((rows, Hq, D), bf), kv, kv_lens, tables, cu),
    }


def decode_step_ms(checkpoint: str, dtype: str, layer_loop: str, num_seqs: int = 16, steps: int = 30) -> float:
    """Median ms per engine.step() of a decode-only batch (run in a fresh process by `main`)."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=checkpoint,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=512,
            max_model_len=2048,
            dtype=dtype,
            layer_loop=layer_loop,
            load_tokenizer=False,
        )
    )
    vocab = engine.model.cfg.vocab_size
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        prompt = rng.integers(3, vocab, 128).tolist()
        engine.add_request(
            EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=steps + 12, temperature=0.0, ignore_eos=True))
        )
    for _ in range(8):  # prefill chunks and the first decode steps
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoints", nargs="*")
    parser.add_argument("--ops", action="store_true", help="time the dot spellings alone")
    parser.add_argument("--breakdown", default=None, metavar="CHECKPOINT", help="a dense checkpoint's step parts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("CHECKPOINT", "DTYPE", "LAYER_LOOP"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps({"ms": decode_step_ms(*args.one)}))
        return 0
    report: dict = {"cpu_count": os.cpu_count()}
    if args.ops:
        report["ops_ms"] = ops()
        for k, v in report["ops_ms"].items():
            print(f"{v:8.2f} ms  {k}", flush=True)
    if args.breakdown:
        report["breakdown"] = breakdown(args.breakdown)
        print("decode step parts, 16 rows:", report["breakdown"], flush=True)
    for checkpoint in args.checkpoints:
        runs: dict[str, list[float]] = {f"{d}/{loop}": [] for d, loop in VARIANTS}
        for r in range(args.repeats):
            for dtype, loop in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.cpu_dtype", "--one", checkpoint, dtype, loop],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                ms = json.loads(out.stdout.strip().splitlines()[-1])["ms"]
                runs[f"{dtype}/{loop}"].append(ms)
                print(
                    f"{Path(checkpoint).name} {dtype} layers {loop}: {ms:.1f} ms/step (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        medians = {k: float(np.median(v)) for k, v in runs.items()}
        report[Path(checkpoint).name] = {
            "runs_ms": runs,
            "median_ms": medians,
            "bf16_over_f32_speed": medians["float32/auto"] / medians["bfloat16/auto"],
        }
        print(
            f"{Path(checkpoint).name}: float32 {medians['float32/auto']:.1f}, bf16 {medians['bfloat16/auto']:.1f} "
            f"(plan), bf16 scanned {medians['bfloat16/scan']:.1f} ms/step",
            flush=True,
        )
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
